"""What the tests and the benchmarks share: ports and waiting (net), the service's processes and
databases (services, stack), job specs (specs), API and database helpers (api), a scriptable HTTP
server (http_stub), the console script in a pseudo-terminal (terminal) and docker-compose.yml as
Compose reads it (compose)."""
