"""The web app: server-rendered page shells (Jinja, autoescaped) whose plain scripts read the
same /v1 API as every other client, served by the API process itself (same origin, no CDN)."""
