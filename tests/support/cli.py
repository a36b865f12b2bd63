"""The `muonforge` console script from this checkout, run to completion with its output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.services import ROOT, clean_env, service_env


def command(*args: object) -> list[str]:
    """``muonforge ARGS`` as an argv (the console script runs ``main()`` of ``muonforge.cli``)."""
    return [sys.executable, "-m", "muonforge.cli", *map(str, args)]


def client_env(url: str | None, key: str | None) -> dict[str, str]:
    """This environment without any MUONFORGE_ setting, then the server's URL and the key if given."""
    return clean_env(**({"MUONFORGE_API_URL": url} if url else {}), **({"MUONFORGE_API_KEY": key} if key else {}))


def muonforge(
    *args: object, url: str | None = None, key: str | None = None, cwd: Path = ROOT, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``muonforge ARGS`` with MUONFORGE_API_URL and MUONFORGE_API_KEY set (unset where None)."""
    env = client_env(url, key)
    return subprocess.run(command(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def service_command(settings: Any, *args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    """``muonforge ARGS`` as a process on the test's database and Redis (``settings``): a service
    command such as keys, tenants or migrate."""
    env = service_env(settings)
    return subprocess.run(command(*args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
