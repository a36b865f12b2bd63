"""Process management for `muonforge up` and `muonforge worker`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request


def default_queues() -> str:
    import torch

    return "default,cuda" if torch.cuda.is_available() else "default,cpu"


def worker_command(queues: str | None, concurrency: int) -> list[str]:
    """A Celery worker: solo pool for one process per device (no fork after CUDA init)."""
    pool = ["--pool", "solo"] if concurrency == 1 else ["--pool", "prefork", "--concurrency", str(concurrency)]
    return [
        sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
        "--queues", queues or default_queues(), *pool, "--prefetch-multiplier", "1",
        "--loglevel", "INFO", "--without-gossip", "--without-mingle",
    ]  # fmt: skip


def wait_ready(url: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    return False


def run_up(host: str, port: int, workers: int) -> int:
    """Migrate, start the API and the workers, print the URL and an API key, wait for Ctrl-C."""
    from app.db.session import transaction
    from app.migrate import upgrade
    from app.services.auth import create_api_key
    from app.settings import get_settings

    settings = get_settings()
    upgrade(settings)
    mode = "embedded (SQLite and a local broker under ./var)" if settings.embedded else "Postgres and Redis"
    print(f"muonforge: {mode}", flush=True)
    api = [sys.executable, "-m", "muonforge.cli", "api", "--host", host, "--port", str(port)]
    procs = [subprocess.Popen(api)]
    procs += [subprocess.Popen(worker_command(None, 1)) for _ in range(workers)]
    url = f"http://{host}:{port}"
    try:
        if not wait_ready(url):
            print("the API did not become ready", file=sys.stderr)
            return 1
        with transaction(settings) as session:
            key = create_api_key(session, "default")
        print(f"URL: {url}", flush=True)
        print(f"API key: {key}", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1  # a child died
    except KeyboardInterrupt:
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
