"""A worker's healthcheck: a file that the worker touches while it is well.

With MUONFORGE_WORKER_ALIVE_FILE set, a thread of the worker checks what the API's /readyz
checks (the database and the broker answer) every ALIVE_SECONDS and touches the file when both
do. ``python -m worker.health`` exits 0 while the file is at most STALE_SECONDS old, 1 otherwise:
a container's healthcheck that costs one small process and no round trip.

Not ``celery inspect ping``: a solo-pool worker (one process per device) runs its job in the
loop that would answer the ping, so it would look dead for as long as it trains.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

from app.settings import Settings, get_settings

log = logging.getLogger("muonforge.worker")
ALIVE_SECONDS = 10.0
STALE_SECONDS = 3 * ALIVE_SECONDS  # two checks missed in a row: unhealthy


def keep_alive(settings: Settings, path: Path, stop: threading.Event) -> None:
    """Touch ``path`` every ALIVE_SECONDS while the database and the broker answer, until ``stop``."""
    from app.api.observability import readiness

    while True:
        checks = readiness(settings)
        try:
            if all(state == "ok" for state in checks.values()):
                path.touch()
            else:
                log.warning("not touching %s: %s", path, checks)
        except OSError as exc:
            log.warning("cannot touch %s: %s", path, exc)
        if stop.wait(ALIVE_SECONDS):
            return


def age(path: Path) -> float | None:
    """Seconds since ``path`` was last touched; None if it does not exist."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def main() -> int:
    path = get_settings().worker_alive_file
    if path is None:
        print("MUONFORGE_WORKER_ALIVE_FILE is not set", file=sys.stderr)
        return 2
    seconds = age(path)
    if seconds is None or seconds > STALE_SECONDS:
        since = "never touched" if seconds is None else f"last touched {seconds:.0f} s ago"
        print(f"unhealthy: {path} {since}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
