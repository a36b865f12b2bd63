"""docker-compose.yml and the Dockerfile cannot run here (no Docker engine): check that what
they run is what the tests run as processes, with settings the Settings class reads."""

from pathlib import Path

import yaml

from app.settings import Settings
from muonforge.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_compose_commands_are_valid_muonforge_invocations():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "api", "worker"} <= set(services)
    for name in ("migrate", "api", "worker"):
        command = services[name]["command"]
        assert command[0] == "muonforge", name
        build_parser().parse_args(command[1:])  # exits on an unknown subcommand or flag
    assert services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_compose_environment_names_are_settings():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    fields = {f"MUONFORGE_{name.upper()}" for name in Settings.model_fields}
    for name in ("migrate", "api", "worker"):
        env = compose["services"][name]["environment"]
        assert set(env) <= fields, set(env) - fields
        assert env["MUONFORGE_DATABASE_URL"].startswith("postgresql+psycopg://")


def test_dockerfile_copies_what_the_commands_need():
    text = (ROOT / "Dockerfile").read_text()
    for part in ("optim", "app", "worker", "muonforge", "migrations", "alembic.ini", "pyproject.toml"):
        assert f"COPY {part}" in text, part
    assert 'CMD ["muonforge", "api"' in text


def test_dockerfile_installs_the_locked_web_packages():
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY app/web/package.json app/web/package-lock.json" in text and "npm ci" in text
    assert "COPY --from=web /web/node_modules ./app/web/node_modules" in text
    assert "app/web/node_modules" in (ROOT / ".dockerignore").read_text()  # built in the image, not copied
