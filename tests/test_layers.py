"""The layers (docs/architecture.md): what each package may import, read from the source, and
what importing the client really loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.net import closed_port_url

ROOT = Path(__file__).resolve().parents[1]
STDLIB = sys.stdlib_module_names
SERVER = ("app", "worker", "torch", "sqlalchemy", "fastapi", "celery", "alembic", "numpy", "redis", "psycopg")


def imports(path: Path) -> set[str]:
    """The top-level-qualified modules a file imports, at any depth (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def offenders(package: str, allowed) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / package).rglob("*.py")
        for module in imports(path)
        if not allowed(module)
    )


def top(module: str) -> str:
    return module.split(".")[0]


def test_optim_imports_only_torch():
    assert offenders("optim", lambda m: top(m) in STDLIB or top(m) in ("torch", "optim")) == []


def test_the_contract_imports_only_pydantic():
    allowed = ("pydantic", "pydantic_core", "contract")
    assert offenders("contract", lambda m: top(m) in STDLIB or top(m) in allowed) == []


def test_the_engine_never_imports_the_service_or_the_client():
    def allowed(m: str) -> bool:
        return top(m) not in ("app", "muonforge") and (top(m) != "worker" or m.startswith("worker.engine"))

    assert offenders("worker/engine", allowed) == []


def test_the_app_imports_only_the_engines_torch_free_facts():
    assert offenders("app", lambda m: top(m) != "worker" or m == "worker.engine.facts") == []
    facts = imports(ROOT / "worker/engine/facts.py")
    assert {top(m) for m in facts} <= {"__future__", "typing", "contract"}, facts
    # torch only where a checkpoint is read for an export, when one is asked for, and where an
    # uploaded model's config is built on the meta device to check its weights, when one is uploaded
    torch = [p.relative_to(ROOT).as_posix() for p in (ROOT / "app").rglob("*.py") if "torch" in map(top, imports(p))]
    assert sorted(torch) == ["app/services/export.py", "app/services/hf_export.py", "app/services/model_weights.py"]


def server_modules_after(code: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``code`` in a fresh interpreter (a SystemExit is caught); the run, and the server or
    torch packages it loaded, from the last line it printed."""
    probe = f"""
import sys
try:
    {code}
except SystemExit:
    pass
print(sorted({{m.split(".")[0] for m in sys.modules}} & set({SERVER!r})))
"""
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run, ast.literal_eval(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "code",
    [
        "import muonforge",
        "import muonforge.cli, muonforge.client_commands",
        "from muonforge.cli import main; import sys; sys.argv = ['muonforge', 'jobs', '--help']; main()",
        "from muonforge.cli import main; main(['--help'])",
    ],
)
def test_the_client_loads_no_server_or_torch_module(code):
    """What `pip install muonforge` users run: the client, and a client command up to its request."""
    assert server_modules_after(code)[1] == []


def test_a_client_command_runs_to_its_connection_error_without_the_server():
    """`muonforge jobs` against a port nobody listens on: its request made (and retried), the
    connection error's line and exit status 3, and still no server or torch module loaded."""
    url = closed_port_url()
    code = f"from muonforge.cli import main; print('exit', main(['jobs', '--url', {url!r}, '--api-key', 'mf_x']))"
    run, loaded = server_modules_after(code)
    assert loaded == []
    assert "exit 3" in run.stdout.splitlines()
    [line] = run.stderr.splitlines()
    assert line.startswith(f"error: cannot reach the server at {url}: connection refused;"), line
