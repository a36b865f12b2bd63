"""Webhooks on real Postgres: endpoints, deliveries signed as Standard Webhooks signs them and
received by a real HTTP server, retries, the allow-list, tenant isolation, pagination; a job run
by a real worker; and the pure parts (the retry schedule, the signature, the allow-list)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.db.models import WebhookAttempt, WebhookDelivery
from app.db.session import transaction
from app.main import create_app
from app.repositories.webhooks import WebhookRepository
from app.services.webhook_delivery import next_attempt_at, prune_log, retry_delay, signature
from app.services.webhook_destinations import AllowList, NotAllowed, Unresolved, resolve
from app.settings import Settings
from contract.webhooks import DeliveryStatus
from muonforge import Client
from tests.support.api import new_key
from tests.support.cli import muonforge
from tests.support.http_stub import Reply, StubServer, scripted
from tests.support.net import wait_for
from tests.support.specs import tiny_spec

OK = Reply(200, b"")


def verify(secret: str, headers, body: bytes, tolerance: int = 300) -> bool:
    """What a receiver does: docs/service.md ("Webhooks") shows this function."""
    msg_id, timestamp = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(timestamp)) > tolerance:  # an old request replayed
        return False
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    expected = base64.b64encode(mac).decode()
    return any(
        hmac.compare_digest(sig.removeprefix("v1,"), expected)
        for sig in headers["webhook-signature"].split()
        if sig.startswith("v1,")
    )


def create(client, auth, url: str, events=("job.succeeded", "job.failed", "job.cancelled")) -> dict:
    r = client.post("/v1/webhooks", json={"url": url, "events": list(events)}, headers=auth)
    assert r.status_code == 201, r.text
    return r.json()


def deliveries(client, auth, webhook_id: str, **params) -> dict:
    r = client.get(f"/v1/webhooks/{webhook_id}/deliveries", params=params, headers=auth)
    assert r.status_code == 200, r.text
    return r.json()


def finished_delivery(client, auth, webhook_id: str, timeout: float = 30) -> dict:
    """The endpoint's latest delivery, once it is delivered or failed."""

    def done():
        data = deliveries(client, auth, webhook_id)["data"]
        return data and data[0]["status"] != "pending" and data[0]

    return wait_for(done, timeout=timeout)


def cancelled_job(client, auth) -> dict:
    job = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()
    return client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth).json()


def test_a_job_run_by_a_worker_is_delivered_once_signed_and_not_to_an_endpoint_that_did_not_ask(client, auth, worker):
    with StubServer(scripted(OK)) as receiver, StubServer(scripted(OK)) as failures_only:
        hook = create(client, auth, f"{receiver.url}/hooks/muonforge", ["job.succeeded"])
        other = create(client, auth, f"{failures_only.url}/hook", ["job.failed"])
        assert hook["secret"].startswith("whsec_") and len(base64.b64decode(hook["secret"][6:])) == 32
        job = client.post("/v1/jobs", json=tiny_spec(steps=4), headers=auth).json()
        wait_for(lambda: client.get(f"/v1/jobs/{job['id']}", headers=auth).json()["status"] == "succeeded", 120)
        delivery = finished_delivery(client, auth, hook["id"])
        final = client.get(f"/v1/jobs/{job['id']}", headers=auth).json()

        assert delivery["status"] == "delivered" and delivery["event_type"] == "job.succeeded"
        assert [a["status_code"] for a in delivery["attempts"]] == [200]
        assert len(receiver.requests) == 1
        request = receiver.requests[0]
        assert (request.method, request.path) == ("POST", "/hooks/muonforge")
        assert request.headers["webhook-id"] == delivery["id"]
        assert request.headers["content-type"] == "application/json"
        assert verify(hook["secret"], request.headers, request.body)
        assert not verify(hook["secret"], request.headers, request.body + b" ")
        message = json.loads(request.body)
        assert message == delivery["payload"]
        assert message["type"] == "job.succeeded" and message["data"] == final  # the Job as the API shows it
        assert datetime.fromisoformat(message["timestamp"]) >= datetime.fromisoformat(final["finished_at"])
        # The endpoint that takes job.failed only: nothing queued, nothing sent.
        assert deliveries(client, auth, other["id"])["data"] == [] and failures_only.requests == []


def test_cancelling_a_queued_job_delivers_job_cancelled(client, auth):
    with StubServer(scripted(OK)) as receiver:
        hook = create(client, auth, receiver.url)
        job = cancelled_job(client, auth)
        delivery = finished_delivery(client, auth, hook["id"])
    assert delivery["status"] == "delivered" and delivery["event_type"] == "job.cancelled"
    assert delivery["payload"]["data"]["id"] == job["id"] and delivery["payload"]["data"]["status"] == "cancelled"
    assert verify(hook["secret"], receiver.requests[0].headers, receiver.requests[0].body)


def test_a_receiver_that_fails_twice_gets_the_same_message_a_third_time(client, auth):
    with StubServer(scripted(Reply(500), Reply(500), then=OK)) as receiver:
        hook = create(client, auth, receiver.url, ["job.cancelled"])
        cancelled_job(client, auth)
        delivery = finished_delivery(client, auth, hook["id"])
    assert delivery["status"] == "delivered" and delivery["finished_at"] and delivery["next_attempt_at"] is None
    assert [(a["status_code"], a["error"]) for a in delivery["attempts"]] == [
        (500, "answered 500"),
        (500, "answered 500"),
        (200, None),
    ]
    assert all(a["duration_ms"] >= 0 for a in delivery["attempts"])
    assert [r.headers["webhook-id"] for r in receiver.requests] == [delivery["id"]] * 3  # the idempotency id
    assert len({r.body for r in receiver.requests}) == 1
    assert all(verify(hook["secret"], r.headers, r.body) for r in receiver.requests)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.2:8080/hook",
        "http://10.0.0.1/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/hook",
        "http://0x7f000002/",
        "http://nowhere.invalid/hook",
        "http://127.0.0.1:99999/",
    ],
)
def test_a_url_outside_the_allow_list_is_refused_at_creation(client, auth, url):
    r = client.post("/v1/webhooks", json={"url": url, "events": ["job.failed"]}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "url", r.text
    assert client.get("/v1/webhooks", headers=auth).json()["data"] == []


def test_the_request_is_validated(client, auth):
    for body, param in (
        ({"url": "ftp://127.0.0.1/x", "events": ["job.failed"]}, "url"),
        ({"url": "http://127.0.0.1/x", "events": ["job.started"]}, "events.0"),
        ({"url": "http://127.0.0.1/x", "events": []}, "events"),
    ):
        r = client.post("/v1/webhooks", json=body, headers=auth)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text


def test_with_no_allow_list_nothing_is_allowed_and_the_error_says_what_to_set(settings, auth):
    with TestClient(create_app(settings.model_copy(update={"webhook_allow": ""}), reaper=False)) as bare:
        r = bare.post("/v1/webhooks", json={"url": "http://127.0.0.1/x", "events": ["job.failed"]}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "url"
    assert "MUONFORGE_WEBHOOK_ALLOW" in r.json()["error"]["message"]


def test_a_delivery_whose_destination_left_the_allow_list_is_not_sent(client, settings, auth):
    with StubServer(scripted(OK), host="127.0.0.2") as outside:
        assert httpx.post(outside.url).status_code == 200  # reachable ...
        outside.requests.clear()
        # ... and allowed when the endpoint was created: the operator narrowed the list since.
        wider = settings.model_copy(update={"webhook_allow": "127.0.0.0/8"})
        with TestClient(create_app(wider, reaper=False)) as before:
            hook = create(before, auth, outside.url, ["job.cancelled"])
        cancelled_job(client, auth)
        delivery = finished_delivery(client, auth, hook["id"])
        time.sleep(3 * settings.webhook_poll_seconds)
        assert outside.requests == []
    assert delivery["status"] == "failed" and len(delivery["attempts"]) == 1
    assert "127.0.0.2 is outside the destinations" in delivery["last_error"]
    assert delivery["attempts"][0]["status_code"] is None and delivery["attempts"][0]["error"] == delivery["last_error"]


def test_another_tenants_endpoint_is_not_found_and_deliveries_paginate(client, settings, auth):
    with StubServer(scripted(OK)) as receiver:
        hook = create(client, auth, receiver.url, ["job.cancelled"])
        other = {"Authorization": f"Bearer {new_key(settings)}"}
        for method, path in (("get", ""), ("get", "/deliveries"), ("delete", "")):
            r = getattr(client, method)(f"/v1/webhooks/{hook['id']}{path}", headers=other)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert client.get("/v1/webhooks", headers=other).json()["data"] == []
        assert client.get(f"/v1/webhooks/{hook['id']}", headers=auth).json() == {
            k: hook[k] for k in ("id", "url", "events", "created_at")
        }  # the secret is shown at creation only

        for _ in range(5):
            cancelled_job(client, auth)
        wait_for(lambda: len(receiver.requests) == 5)
        seen, after = [], None
        while True:
            page = deliveries(client, auth, hook["id"], limit=2, **({"after": after} if after else {}))
            assert len(page["data"]) <= 2
            seen += [d["id"] for d in page["data"]]
            if not page["has_more"]:
                assert page["next_after"] is None
                break
            after = page["next_after"]
        assert len(seen) == 5 and seen == sorted(seen, reverse=True)  # newest first
        assert set(seen) == {r.headers["webhook-id"] for r in receiver.requests}

    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=auth).status_code == 204
    assert client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth).status_code == 404
    assert client.get("/v1/webhooks", headers=auth).json()["data"] == []


def test_the_delivery_log_keeps_finished_deliveries_for_webhook_log_days(client, settings, auth):
    with StubServer(scripted(OK)) as receiver:
        hook = create(client, auth, receiver.url, ["job.cancelled"])
    now = datetime.now(UTC)
    rows = {
        "old": (DeliveryStatus.DELIVERED, now - timedelta(days=31), None),
        "old_failed": (DeliveryStatus.FAILED, now - timedelta(days=40), None),
        "recent": (DeliveryStatus.DELIVERED, now - timedelta(days=29), None),
        "pending": (DeliveryStatus.PENDING, None, now + timedelta(days=1)),  # never pruned, however old
    }
    ids = {name: f"msg_prune_{name}_{hook['id'][-8:]}" for name in rows}
    body = json.dumps({"type": "job.cancelled", "timestamp": now.isoformat(), "data": {}})
    with transaction(settings) as session:
        WebhookRepository(session).add_deliveries(
            [
                {
                    "id": ids[name],
                    "endpoint_id": hook["id"],
                    "event_type": "job.cancelled",
                    "body": body,
                    "status": status,
                    "attempts": 1,
                    "next_attempt_at": due,
                    "finished_at": finished,
                    "created_at": now - timedelta(days=60),
                }
                for name, (status, finished, due) in rows.items()
            ]
        )
        session.add_all(
            WebhookAttempt(delivery_id=i, number=1, at=now - timedelta(days=41), duration_ms=5, status_code=200)
            for i in ids.values()
        )
    assert prune_log(settings) >= 2
    with transaction(settings) as session:
        kept = set(session.scalars(select(WebhookDelivery.id).where(WebhookDelivery.id.in_(ids.values()))))
        of = WebhookAttempt.delivery_id
        attempts = set(session.scalars(select(of).where(of.in_(ids.values()))))
    assert kept == attempts == {ids["recent"], ids["pending"]}
    listed = {d["id"] for d in deliveries(client, auth, hook["id"])["data"]}
    assert listed == kept


def test_the_endpoint_cap(client, auth, monkeypatch, settings):
    monkeypatch.setattr(settings, "webhook_tenant_cap", 2)
    first = create(client, auth, "http://127.0.0.1:9/a")
    create(client, auth, "http://127.0.0.1:9/b")
    r = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/c", "events": ["job.failed"]}, headers=auth)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    client.delete(f"/v1/webhooks/{first['id']}", headers=auth)
    create(client, auth, "http://127.0.0.1:9/c")


def test_the_client_and_the_command_line(api_url, settings):
    key = new_key(settings)
    with StubServer(scripted(OK)) as receiver, Client(api_url, key) as api:
        created = muonforge("webhooks", "create", receiver.url, "--events", "job.cancelled", url=api_url, key=key)
        assert created.returncode == 0, created.stderr
        secret = created.stdout.splitlines()[-1]  # alone on the last line
        [hook] = list(api.list_webhooks())
        assert api.get_webhook(hook["id"]) == hook and hook["events"] == ["job.cancelled"]
        job = api.create_job(tiny_spec())
        api.cancel_job(job["id"])
        wait_for(lambda: [d["status"] for d in api.webhook_deliveries(hook["id"])] == ["delivered"])
        assert api.webhook_deliveries_page(hook["id"], limit=1)["data"][0]["payload"]["data"]["id"] == job["id"]
        assert verify(secret, receiver.requests[0].headers, receiver.requests[0].body)
        shown = muonforge("webhooks", "deliveries", hook["id"], url=api_url, key=key)
        assert "job.cancelled" in shown.stdout and "delivered" in shown.stdout and "200" in shown.stdout
        assert muonforge("webhooks", "delete", hook["id"], url=api_url, key=key).returncode == 0
        assert list(api.list_webhooks()) == []
    refused = muonforge("webhooks", "create", "http://10.0.0.1/hook", url=api_url, key=key)
    assert refused.returncode == 2 and "url: 10.0.0.1 is outside" in refused.stderr, refused.stderr


# -- the pure parts -----------------------------------------------------------------------------------
def test_the_signature_is_the_standard_webhooks_reference():
    # The example of the Standard Webhooks specification (standard-webhooks.md, "Verifying webhook authenticity").
    assert (
        signature(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            b'{"test": 2432232314}',
        )
        == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    )


def test_the_retry_schedule():
    waits = [retry_delay(n, 5.0, 7200.0, 0.5) for n in range(1, 9)]
    assert waits == pytest.approx([5, 30, 180, 1080, 6480, 7200, 7200, 7200])
    assert [retry_delay(1, 5.0, 7200.0, j) for j in (0.0, 1.0)] == pytest.approx([4.0, 6.0])  # +-20%
    assert retry_delay(10_000, 5.0, 7200.0, 0.5) == 7200.0  # no overflow

    settings = Settings(webhook_retry_base_seconds=5.0)
    created = datetime(2026, 1, 1, tzinfo=UTC)
    now, failures = created, 0
    while (after := next_attempt_at(created, now, failures + 1, settings, 0.5)) is not None:
        assert after > now
        now, failures = after, failures + 1
    assert now == created + timedelta(hours=24)  # the last try falls at the window's end
    assert failures + 1 == 17  # attempts in all, the first included (jitter 0.5: none)
    assert next_attempt_at(created, created + timedelta(hours=25), 3, settings, 0.5) is None


def test_the_allow_list():
    allow = AllowList.parse(" 127.0.0.1, 10.1.0.0/16 ,hooks.example.com,public")
    assert allow.hosts == {"hooks.example.com"} and allow.public
    for address, allowed in (
        ("127.0.0.1", True),
        ("127.0.0.2", False),
        ("10.1.200.3", True),
        ("10.2.0.1", False),
        ("8.8.8.8", True),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("::ffff:10.1.0.1", True),
        ("::ffff:192.168.0.1", False),
        ("::1", False),
    ):
        assert allow.allows_address(ipaddress.ip_address(address)) == allowed, address
    assert not AllowList.parse("") and not AllowList.parse(" , ")
    with pytest.raises(ValueError, match=r"'10\.0\.0\.0/33'"):
        AllowList.parse("10.0.0.0/33")
    for wrong in ("not a host!", "10.0.0.300"):
        with pytest.raises(ValueError):
            Settings(webhook_allow=wrong)


def test_a_host_is_checked_by_every_address_it_resolves_to_and_the_request_goes_to_the_checked_one():
    allow = AllowList.parse("203.0.113.0/24, trusted.example")

    def lookup(answers):
        return lambda host, port: answers

    pinned = resolve("https://hooks.example:8443/a?b=1", allow, lookup=lookup(["203.0.113.7"]))
    assert pinned.url == "https://203.0.113.7:8443/a?b=1"
    assert pinned.headers == {"Host": "hooks.example:8443"} and pinned.extensions == {"sni_hostname": "hooks.example"}
    with pytest.raises(NotAllowed, match=r"10\.0\.0\.5"):  # one address inside, one outside: refused
        resolve("http://hooks.example/", allow, lookup=lookup(["203.0.113.7", "10.0.0.5"]))
    assert resolve("http://trusted.example/", allow, lookup=lookup(["10.0.0.5"])).url == "http://10.0.0.5/"
    with pytest.raises(Unresolved):
        resolve("http://hooks.example/", allow, lookup=lookup([]))
    with pytest.raises(NotAllowed, match="https://"):
        resolve("http://203.0.113.7/", allow, require_https=True)
    assert resolve("http://203.0.113.7/x", allow).url == "http://203.0.113.7/x"  # an address: no lookup
