"""API keys end to end: `muonforge keys create/list/revoke` as processes, against a real API
process whose key cache lasts one second (MUONFORGE_AUTH_CACHE_SECONDS=1); and the guard that
ends an open events stream once its key is revoked."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import threading
import time
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import select, text, update

from app.db.base import utcnow
from app.db.models import ApiKey
from app.db.session import transaction
from app.services.auth import authenticate, hash_key
from app.services.event_stream import while_key_valid
from tests.support.cli import service_command
from tests.support.net import wait_for
from tests.support.services import ROOT, running_api, service_env
from tests.support.specs import tiny_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

CACHE_SECONDS = 1
HINT = "; `muonforge keys list` shows the ids and prefixes"


@pytest.fixture(scope="module")
def api(settings, tmp_path_factory):
    """The API with a one-second key cache."""
    with running_api(
        settings, tmp_path_factory.mktemp("keys-api"), MUONFORGE_AUTH_CACHE_SECONDS=str(CACHE_SECONDS)
    ) as url:
        yield url


def keys(settings, *args: str) -> subprocess.CompletedProcess:
    """``muonforge keys ARGS`` as a process, on the test database."""
    return service_command(settings, "keys", *args)


def create(settings, tenant: str, name: str | None = None) -> str:
    out = keys(settings, "create", "--tenant", tenant, *(["--name", name] if name else []))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def listed(settings, *args: str) -> dict[str, dict[str, str]]:
    """`muonforge keys list ARGS`: its rows by id, each {column: value}."""
    out = keys(settings, "list", *args)
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    columns = ["id", "tenant", "name", "prefix", "created", "last used", "revoked"]
    assert header.split() == ["id", "tenant", "name", "prefix", "created", "last", "used", "revoked"]
    table = {}
    for row in rows:
        # A time is "-" or "<age> ago": join each "ago" to its age, then split into columns.
        cells = row.replace(" ago", "_ago").split()
        assert len(cells) == len(columns), row
        table[cells[0]] = dict(zip(columns, (c.replace("_ago", " ago") for c in cells), strict=True))
    return table


def key_row(settings, key: str) -> ApiKey:
    with transaction(settings) as session:
        return session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(key))).one()


def test_a_revoked_key_is_refused_once_the_cache_has_expired(settings, api):
    tenant = f"revoke-{secrets.token_hex(4)}"
    laptop, ci = create(settings, tenant, "laptop"), create(settings, tenant, "ci")
    assert httpx.get(f"{api}/v1/jobs", headers=bearer(laptop)).status_code == 200

    out = keys(settings, "revoke", laptop[:10])  # by prefix
    assert out.returncode == 0, out.stderr
    row = key_row(settings, laptop)
    assert out.stdout.startswith(f"revoked {row.id} ({laptop[:10]}…, 'laptop', tenant '{tenant}')")
    assert row.revoked_at is not None

    answer = wait_for(lambda: (r := httpx.get(f"{api}/v1/jobs", headers=bearer(laptop))).status_code == 401 and r)
    assert answer.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{api}/v1/jobs", headers=bearer(ci)).status_code == 200, "the tenant's other key holds"
    again = keys(settings, "revoke", row.id)  # by id: already done
    assert again.returncode == 0 and "was already revoked" in again.stdout


def test_an_open_events_stream_ends_once_its_key_is_revoked(settings, api):
    tenant = f"stream-{secrets.token_hex(4)}"
    watcher, admin = create(settings, tenant, "watcher"), create(settings, tenant, "admin")
    job = httpx.post(f"{api}/v1/jobs", json=tiny_spec(), headers=bearer(watcher)).json()  # no worker: stays queued
    received: list[tuple[str, str]] = []  # (event, id)
    first = threading.Event()

    def follow() -> None:
        event = event_id = ""
        with httpx.stream("GET", f"{api}/v1/jobs/{job['id']}/events", headers=bearer(watcher), timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("id: "):
                    event_id = line.removeprefix("id: ")
                elif not line and event:
                    received.append((event, event_id))
                    event = ""
                    first.set()

    stream = threading.Thread(target=follow, daemon=True)
    stream.start()
    # And `muonforge logs --follow`, the client's reconnecting stream, with the same key.
    env = service_env(settings) | {"MUONFORGE_API_URL": api, "MUONFORGE_API_KEY": watcher}
    logs = subprocess.Popen(
        [sys.executable, "-m", "muonforge.cli", "logs", job["id"], "--follow"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert first.wait(30), "the stream sent nothing"
    assert received[0][0] == "status"
    assert logs.stdout.readline().split() == ["status", "queued", "(attempt", "0)"]

    assert keys(settings, "revoke", key_row(settings, watcher).id).returncode == 0
    stream.join(timeout=60)
    assert not stream.is_alive(), "the stream of a revoked key is still open"
    assert "done" not in [event for event, _ in received], "it ended without done: the job goes on"
    try:
        assert logs.wait(timeout=60) == 3
    finally:
        logs.kill()
    assert logs.stderr.read() == (
        "error: the server refused the API key from MUONFORGE_API_KEY: unknown or revoked API key (401 unauthorized)\n"
    )

    reconnect = httpx.get(
        f"{api}/v1/jobs/{job['id']}/events", headers=bearer(watcher) | {"Last-Event-ID": received[-1][1]}
    )  # what any SSE client does next
    assert reconnect.status_code == 401 and reconnect.json()["error"]["code"] == "unauthorized"
    cancelled = httpx.post(f"{api}/v1/jobs/{job['id']}/cancel", headers=bearer(admin))
    assert cancelled.json()["status"] == "cancelled"


def test_keys_list_shows_names_prefixes_last_use_and_revocation(settings, api):
    tenant = f"list-{secrets.token_hex(4)}"
    laptop, ci = create(settings, tenant, "laptop"), create(settings, tenant, "ci")
    unnamed = create(settings, f"{tenant}-other")
    assert httpx.get(f"{api}/v1/jobs", headers=bearer(laptop)).status_code == 200
    assert keys(settings, "revoke", ci).returncode == 0  # by the key itself

    rows = listed(settings, "--tenant", tenant)
    laptop_id, ci_id = key_row(settings, laptop).id, key_row(settings, ci).id
    assert list(rows) == [laptop_id, ci_id], "oldest first"
    assert rows[laptop_id]["tenant"] == tenant and rows[laptop_id]["name"] == "laptop"
    assert rows[laptop_id]["prefix"] == laptop[:10] and rows[ci_id]["prefix"] == ci[:10]
    assert rows[laptop_id]["created"].endswith(" ago")
    assert rows[laptop_id]["last used"].endswith(" ago") and rows[laptop_id]["revoked"] == "-"
    assert rows[ci_id]["last used"] == "-" and rows[ci_id]["revoked"].endswith(" ago")

    everything = listed(settings)
    other = everything[key_row(settings, unnamed).id]
    assert {laptop_id, ci_id} <= set(everything) and other["name"] == "-" and other["tenant"] == f"{tenant}-other"
    assert not any(key in json.dumps(everything) for key in (laptop, ci, unnamed)), "never the keys themselves"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (("revoke", "key_nope"), f"error: no API key 'key_nope'{HINT}"),
        (("revoke", "mf_" + "x" * 43), f"error: no API key 'mf_xxxxxxx…'{HINT}"),  # never the whole key
        (("list", "--tenant", "nobody-at-all"), "error: no tenant 'nobody-at-all'"),
    ],
)
def test_an_unknown_key_or_tenant_is_one_line_and_status_2(settings, args, line):
    out = keys(settings, *args)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")


def test_last_use_is_written_once_not_per_request(settings, api):
    key = create(settings, f"used-{secrets.token_hex(4)}")
    assert key_row(settings, key).last_used_at is None
    assert httpx.get(f"{api}/v1/jobs", headers=bearer(key)).status_code == 200
    first_use = key_row(settings, key).last_used_at
    assert first_use is not None

    def row_version() -> str:  # Postgres' xmin changes with every write of the row
        with transaction(settings) as session:
            return session.execute(
                text("SELECT xmin::text FROM api_keys WHERE key_hash = :h"), {"h": hash_key(key)}
            ).scalar()

    version = row_version()
    for _ in range(4):  # each round after the cache has expired: the key is looked up again
        time.sleep(CACHE_SECONDS + 0.2)
        assert httpx.get(f"{api}/v1/jobs", headers=bearer(key)).status_code == 200
    assert row_version() == version, "no write while the last use is under a minute old"
    assert key_row(settings, key).last_used_at == first_use


def test_a_last_use_over_a_minute_old_is_written_again(settings):
    key = create(settings, f"stale-{secrets.token_hex(4)}")
    long_ago = utcnow() - timedelta(minutes=5)
    with transaction(settings) as session:
        session.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(key)).values(last_used_at=long_ago))
    with transaction(settings) as session:
        authenticate(session, f"Bearer {key}")
    assert key_row(settings, key).last_used_at > long_ago + timedelta(minutes=4)


def guarded(source, answers: list[bool]) -> list:
    """What ``while_key_valid`` passes on from ``source`` while the key checks give ``answers``."""

    async def key_valid() -> bool:
        return answers.pop(0)

    async def collect() -> list:
        return [event async for event in while_key_valid(source, key_valid, every=0)]

    return asyncio.run(collect())


def test_the_stream_guard_passes_events_on_in_order_and_raises_what_the_stream_raises():
    async def events():
        for i in range(1000):
            yield i
        raise RuntimeError("lost the database")

    async def finite():
        for i in range(3):
            yield i

    assert guarded(finite(), [True] * 10) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="lost the database"):
        guarded(events(), [True] * 10)


def test_the_stream_guard_ends_a_waiting_stream_once_the_key_fails_and_closes_it():
    closed = []

    async def waiting():
        try:
            yield "status"
            await asyncio.Event().wait()  # nothing more for ever, as a queued job's stream
        finally:
            closed.append(True)

    assert guarded(waiting(), [True, False]) == ["status"]
    assert closed == [True]
