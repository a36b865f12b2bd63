"""docker-compose.yml run as plain processes (no Docker engine here): Redis with its password,
the migration, the API and the CPU worker with the commands and environment compose gives them
(hosts, ports and paths pointed at this machine), and the healthchecks compose runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from tests.support.compose import SECRETS, load_compose
from tests.support.net import free_port, wait_for
from tests.support.s3 import moto_server
from tests.support.services import PG_ADMIN, ROOT, create_database, drop_database, unavailable

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's


def local(command: list[str]) -> list[str]:
    """A compose command as a process here: `muonforge` and `python` from this checkout."""
    program = {"muonforge": [sys.executable, "-m", "muonforge.cli"], "python": [sys.executable]}
    return program.get(command[0], command[:1]) + command[1:]


def healthy(check: list[str], env: dict[str, str]) -> bool:
    """Whether a compose healthcheck (["CMD", ...] or ["CMD-SHELL", "..."]) passes."""
    kind, *command = check
    argv = ["sh", "-c", command[0]] if kind == "CMD-SHELL" else local(command)
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, timeout=30).returncode == 0


class Stack:
    """The processes started so far, stopped at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Path:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            self.procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
        return log

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_the_compose_services_run_as_processes(tmp_path):
    services = load_compose(SECRETS)["services"]
    server = shutil.which("redis-server")
    if server is None or shutil.which("redis-cli") is None:
        unavailable("needs redis-server and redis-cli to run the compose file's Redis")
    database, stack = create_database(), Stack(tmp_path)
    # The bucket of the compose file's MinIO, on moto's S3 server standing in for it.
    store_server, store_endpoint = moto_server()
    bucket = urlsplit(services["api"]["environment"]["MUONFORGE_ARTIFACT_URL"]).netloc
    httpx.put(f"{store_endpoint}/{bucket}", timeout=10).raise_for_status()
    try:
        # Redis, with the password from .env.
        redis_port = free_port()
        redis_cmd = [
            server,
            *services["redis"]["command"][1:],
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(tmp_path),
            "--save",
            "",
        ]
        stack.start("redis", redis_cmd, dict(os.environ))
        wait_for(lambda: ping(redis_port, SECRETS["REDIS_PASSWORD"]))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port).ping()
        check = services["redis"]["healthcheck"]["test"]
        check = [check[0], check[1].replace("redis-cli", f"redis-cli -p {redis_port}")]
        no_auth = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        assert healthy(check, no_auth | services["redis"]["environment"])
        assert not healthy(check, no_auth), "without the password: NOAUTH, no PONG"

        def env_of(name: str) -> dict[str, str]:
            """The service's environment, its hosts, ports and paths on this machine."""
            env = {k: v for k, v in os.environ.items() if not k.startswith("MUONFORGE_")} | {"OMP_NUM_THREADS": "1"}
            env |= services[name]["environment"]
            base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
            env["MUONFORGE_DATABASE_URL"] = f"{base}/{database}"  # trust auth: the password is not asked for
            env["MUONFORGE_REDIS_URL"] = env["MUONFORGE_REDIS_URL"].replace("@redis:6379", f"@127.0.0.1:{redis_port}")
            env["MUONFORGE_ARTIFACT_DIR"] = str(tmp_path / "artifacts")
            env["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL"].replace("http://minio:9000", store_endpoint)
            if "MUONFORGE_WORKER_ALIVE_FILE" in env:
                env["MUONFORGE_WORKER_ALIVE_FILE"] = str(tmp_path / "worker-alive")
            return env

        # The migration, then the API as compose runs them.
        migrate = subprocess.run(local(services["migrate"]["command"]), env=env_of("migrate"), cwd=ROOT, timeout=120)
        assert migrate.returncode == 0
        api_port = free_port()
        api_cmd = [arg.replace("0.0.0.0", "127.0.0.1") for arg in services["api"]["command"]]
        api_cmd[api_cmd.index("--port") + 1] = str(api_port)
        api_env = env_of("api")
        stack.start("api", local(api_cmd), api_env)
        url = f"http://127.0.0.1:{api_port}"
        api_check = [part.replace(":8000/", f":{api_port}/") for part in services["api"]["healthcheck"]["test"]]
        wait_for(lambda: healthy(api_check, api_env), timeout=60)
        assert httpx.get(f"{url}/readyz").json()["checks"] == {"database": "ok", "broker": "ok"}

        # /metrics: only with the token from .env.
        refused = httpx.get(f"{url}/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {SECRETS['METRICS_TOKEN']}"})
        assert scraped.status_code == 200 and "muonforge_jobs" in scraped.text

        # Behind the TLS proxy (X-Forwarded-Proto: https) the session cookie is Secure.
        created = subprocess.run(
            local(["muonforge", "keys", "create", "--tenant", "compose"]),
            env=api_env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        key = created.stdout.strip().splitlines()[-1]
        proxied = httpx.post(f"{url}/v1/session", json={"api_key": key}, headers={"X-Forwarded-Proto": "https"})
        assert proxied.status_code == 200 and "secure" in proxied.headers["set-cookie"].lower()
        direct = httpx.post(f"{url}/v1/session", json={"api_key": key})
        assert "secure" not in direct.headers["set-cookie"].lower()

        # The CPU worker: healthy once ready, and it runs a device: cpu job.
        worker_env, worker_check = env_of("worker-cpu"), services["worker-cpu"]["healthcheck"]["test"]
        assert not healthy(worker_check, worker_env), "not started: its file was never touched"
        log = stack.start("worker", local(services["worker-cpu"]["command"]), worker_env)
        wait_for(lambda: b" ready." in log.read_bytes(), timeout=90)
        wait_for(lambda: healthy(worker_check, worker_env), timeout=60)
        headers = {"Authorization": f"Bearer {key}"}
        spec = {
            "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
            "data": {"builtin": "synthetic"},
            "train": {"steps": 5, "batch_size": 4, "eval_every": 5, "checkpoint_every": 5, "device": "cpu"},
        }
        job = httpx.post(f"{url}/v1/jobs", json=spec, headers=headers).json()

        def finished() -> dict | None:
            current = httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers).json()
            return current if current["status"] in ("succeeded", "failed", "cancelled") else None

        assert wait_for(finished, timeout=120)["status"] == "succeeded"
        listed = httpx.get(f"{url}/v1/jobs/{job['id']}/checkpoints", headers=headers).json()["data"]
        stored = httpx.get(f"{url}/v1/jobs/{job['id']}/checkpoints/5", headers=headers)  # from the bucket
        assert stored.status_code == 200 and len(stored.content) == listed[0]["bytes"]
        assert not (tmp_path / "artifacts" / "jobs" / job["id"] / "checkpoints").exists()  # the bucket's alone
    finally:
        stack.stop()
        store_server.stop()
        drop_database(database)


def ping(port: int, password: str) -> bool:
    try:
        return redis.Redis(port=port, password=password, socket_connect_timeout=1).ping()
    except redis.ConnectionError:
        return False
