"""The distribution: `pip install muonforge` is the client and the command line's client commands,
without torch or the server; the extras (`server`, `train`) are what the service commands need,
and a service command without them says what to install. The system test installs the project
into an environment that has the base dependencies alone and runs the client there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from contract.export import CONFIG_FILE, EXPORT_KEY
from muonforge import extras
from muonforge.cli import main
from tests.support.net import closed_port_url

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
HEAVY = {"torch", "celery", "sqlalchemy", "fastapi", "uvicorn", "alembic", "psycopg", "numpy"}
PACKAGES = [name.rstrip("*") for name in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]


def names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(line).name) for line in requirements}


def test_the_base_install_is_the_client_without_the_server_or_torch():
    base = names(PROJECT["dependencies"])
    assert base & HEAVY == set()
    assert {"httpx", "pydantic", "pyyaml", "rich"} <= base


def test_the_server_and_the_engine_are_extras():
    optional = {extra: names(lines) for extra, lines in PROJECT["optional-dependencies"].items()}
    assert HEAVY - {"torch"} <= optional["server"]
    assert {"torch", "numpy", "safetensors"} <= optional["train"]
    assert "torch" not in optional["server"], "the API runs without the engine (an export imports it lazily)"


def test_every_install_line_installs_the_extras_its_commands_need():
    assert "pip install --quiet --disable-pip-version-check -e '.[server,train,dev]'" in (ROOT / "Makefile").read_text()
    assert "pip install --no-cache-dir -e '.[server,train]'" in (ROOT / "Dockerfile").read_text()


def test_this_environment_has_every_extra():
    """The names of pyproject.toml's requirements are those the installed packages answer to."""
    assert extras.missing(PROJECT["optional-dependencies"]) == []


BOTH = ("the server and the training engine", "server,train", "fastapi, torch")
SERVER = ("the server", "server", "fastapi")


@pytest.mark.parametrize(
    "argv, needed",
    [
        (["up"], BOTH),
        (["worker"], BOTH),
        (["api"], SERVER),
        (["migrate"], SERVER),
        (["keys", "list"], SERVER),
        (["tenants", "set-cap", "acme", "3"], SERVER),
        (["train", "no-such-spec.yaml", "--out", "run"], ("the training engine", "train", "torch")),
    ],
)
def test_a_service_command_without_its_extras_names_them(monkeypatch, capsys, tmp_path, argv, needed):
    monkeypatch.setattr(extras, "installed", lambda name: name not in ("fastapi", "torch"))
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1
    what, pip, absent = needed
    line = f"error: muonforge {argv[0]} needs {what} (not installed: {absent}): pip install 'muonforge[{pip}]'"
    assert capsys.readouterr().err.splitlines() == [line]
    assert list(tmp_path.iterdir()) == [], "the command did not start"


def test_the_missing_packages_are_named_up_to_four():
    line = extras.explain("up", ("server", "train"), ["a", "b", "c", "d", "e", "f"])
    assert line == (
        "muonforge up needs the server and the training engine (not installed: a, b, c, d and 2 more):"
        " pip install 'muonforge[server,train]'"
    )


# -- a base install, offline ---------------------------------------------------------------------
def base_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's requirements outside any extra."""
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(name).decode())
    wanted = [Requirement(line) for line in message.get_all("Requires-Dist") or []]
    return [r for r in wanted if r.marker is None or r.marker.evaluate({"extra": ""})]


def closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions that ``requirements`` need, theirs included, as this
    environment has them (pip's resolution of the same requirements, without an index)."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        dist = metadata.distribution(requirement.name)
        name = canonicalize_name(dist.metadata["Name"])
        if name in found and not requirement.extras:
            continue
        found[name] = dist
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *requirement.extras}):
                todo.append(sub)
    return list(found.values())


def copy_distribution(dist: metadata.Distribution, site: Path) -> None:
    """The files of an installed distribution (its RECORD), copied into another site-packages;
    its scripts outside site-packages are left out."""
    for file in dist.files or []:
        source = Path(dist.locate_file(file))
        if ".." in file.parts or not source.is_file():
            continue
        (site / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, site / file)


def checked(*command: str, cwd: Path | None = None) -> None:
    run = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    """A virtual environment (no system site-packages) with this project's wheel, built from
    this checkout by its build backend and installed by pip, and the wheel's base requirements
    alone, copied from this environment: no index, no download."""
    tmp = tmp_path_factory.mktemp("base-install")
    for part in [*PACKAGES, "pyproject.toml", "README.md"]:
        source, target = ROOT / part, tmp / "src" / part
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("node_modules", "__pycache__"))
        else:
            shutil.copy2(source, target)
    build = "import importlib, sys; importlib.import_module(sys.argv[1]).build_wheel(sys.argv[2])"  # PEP 517
    backend = PYPROJECT["build-system"]["build-backend"]
    checked(sys.executable, "-c", build, backend, str(tmp / "dist"), cwd=tmp / "src")
    [wheel] = (tmp / "dist").glob("muonforge-*.whl")
    venv = tmp / "venv"
    checked(sys.executable, "-m", "venv", "--without-pip", str(venv))
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for dist in closure(base_requirements(wheel)):
        copy_distribution(dist, site)
    python = str(venv / "bin" / "python")
    pip = (sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "--python", python)
    checked(*pip, "install", "--no-deps", "--no-index", str(wheel))
    return venv


def run_in(venv: Path, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MUONFORGE_", "PYTHON", "VIRTUAL_ENV"))}
    program = str(venv / "bin" / command[0])
    return subprocess.run([program, *command[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.system
def test_a_base_install_runs_the_client_and_its_commands(base_venv, tmp_path):
    probe = f"""
import importlib.util, json, sys
from pathlib import Path
from muonforge import Client
from contract.spec import JobSpec
from muonforge.transfer import write_export_config
spec = JobSpec.model_validate({{"model": {{"arch": "gpt"}}, "data": {{"builtin": "synthetic"}}}})
config = json.loads(write_export_config(Path(sys.argv[1])).read_text())
installed = [m for m in {sorted(HEAVY | {"safetensors", "redis"})!r} if importlib.util.find_spec(m)]
print(json.dumps({{"arch": spec.model.arch, "config": config, "installed": installed}}))
"""
    weights = tmp_path / "model.safetensors"
    write_safetensors(weights, {EXPORT_KEY: json.dumps({"arch": "gpt", "vocab_size": 64})})
    run = run_in(base_venv, "python", "-c", probe, str(weights), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"arch": "gpt", "config": {"arch": "gpt", "vocab_size": 64}, "installed": []}

    usage = run_in(base_venv, "muonforge", "--help", cwd=tmp_path)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: muonforge"), usage.stderr

    url = closed_port_url()
    jobs = run_in(base_venv, "muonforge", "jobs", "--url", url, "--api-key", "mf_x", cwd=tmp_path)
    assert jobs.returncode == 3, jobs.stderr
    [line] = jobs.stderr.splitlines()
    assert line.startswith(f"error: cannot reach the server at {url}: connection refused;"), line

    for command, needed in [(("up",), "server,train"), (("train", "x", "--out", "y"), "train")]:
        refused = run_in(base_venv, "muonforge", *command, cwd=tmp_path)
        assert refused.returncode == 1, refused.stderr
        [line] = refused.stderr.splitlines()
        assert line.startswith(f"error: muonforge {command[0]} needs the "), line
        assert line.endswith(f"): pip install 'muonforge[{needed}]'"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([weights.name, CONFIG_FILE]), "nothing started"


def write_safetensors(path: Path, metadata_: dict[str, str]) -> None:
    """A safetensors file of one tensor with ``metadata_``, written with the safetensors package."""
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(2, dtype=np.float32)}, str(path), metadata=metadata_)
