"""Job specs as the commands read them (YAML or JSON files), and the errors for unusable input.

``InputError`` is input a command cannot use (exit status 2); ``SpecError``, a spec that cannot be
read or does not validate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class InputError(ValueError):
    """Input a command cannot use (exit status 2); the message is for people."""


class SpecError(InputError):
    """A job spec that cannot be read or does not validate."""


def read_spec(path: Path) -> dict[str, Any]:
    """A YAML or JSON job spec as a dict (not yet validated)."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise SpecError(yaml_problem(path, exc)) from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path} must hold a mapping (a JobSpec), not {type(raw).__name__}")
    return raw


def yaml_problem(path: Path, exc: Exception) -> str:
    """PyYAML's error on one line, as compilers write theirs: ``spec.yaml:3:5: <the problem>``."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return f"{path}: not valid YAML or JSON: {' '.join(str(exc).split())}"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: {problem}"


def with_source(raw: dict[str, Any], **source: str) -> dict[str, Any]:
    """The spec with its data source replaced (``path=`` or ``dataset_id=``)."""
    data = {k: v for k, v in (raw.get("data") or {}).items() if k not in ("dataset_id", "builtin", "path")}
    return {**raw, "data": {**data, **source}}


def load_spec(path: Path, data: Path | None = None) -> dict[str, Any]:
    """Read a job spec, apply ``--data``, validate it with JobSpec; return its dict."""
    import pydantic

    from contract.spec import JobSpec, error_path

    raw = read_spec(path)
    if data is not None:
        raw = with_source(raw, path=str(data))
    try:
        return JobSpec.model_validate(raw).model_dump()
    except pydantic.ValidationError as exc:
        fields = "; ".join(f"{error_path(e['loc']) or '(spec)'}: {e['msg']}" for e in exc.errors())
        raise SpecError(f"{path} is not a valid job spec: {fields}") from None
