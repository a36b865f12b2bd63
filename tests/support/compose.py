"""docker-compose.yml as `docker compose` reads it, for tests on a machine without Docker: YAML
(merge keys included) with ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
``${VAR:?error}``, ``${VAR?error}`` and ``$$`` interpolated from an environment, as the Compose
specification's interpolation section describes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
# A .env for the tests: one value per secret the file requires.
SECRETS = {
    "POSTGRES_PASSWORD": "pg-secret",
    "REDIS_PASSWORD": "redis-secret",
    "METRICS_TOKEN": "metrics-secret",
    "MINIO_PASSWORD": "minio-secret",
}
VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))")


class MissingVariable(ValueError):
    """A ``${VAR:?error}`` whose variable is unset or empty: compose stops with the error."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``value`` (a loaded YAML document) with every string interpolated from ``env``."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        name = match["name"] or match["bare"]
        op, arg, current = match["op"], match["arg"], env.get(name)
        missing = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":?", "?") and missing:
            raise MissingVariable(f"{name}: {arg}")
        if op in (":-", "-") and missing:
            return arg
        return current or ""

    return VARIABLE.sub(substitute, value)


def raw_compose() -> dict[str, Any]:
    """The file as YAML, nothing interpolated."""
    return yaml.safe_load(COMPOSE.read_text())


def load_compose(env: dict[str, str]) -> dict[str, Any]:
    """The file as compose runs it with ``env`` (its .env)."""
    return interpolate(raw_compose(), env)


def required_variables() -> set[str]:
    """The variables the file requires (``${VAR:?...}``)."""
    return {m["name"] for m in VARIABLE.finditer(COMPOSE.read_text()) if m["op"] in (":?", "?")}
