"""The webhook delivery loop that each API process runs beside its reaper.

It sends the outbox's due deliveries (app.services.webhooks), signed as Standard Webhooks signs
them, and tries a failed one again with exponential backoff and jitter until the retry window
(24 h) has passed.

One attempt: claim the delivery (a short transaction, WebhookRepository.claim_due), check its URL
against the allow-list and resolve it (app.services.webhook_destinations), POST to the checked
address, record the outcome (another short transaction, fenced by the attempt's number). Several
API processes share the work; one that dies mid-attempt leaves its claim to lapse and the delivery
is sent again with the same ``webhook-id``: at least once (docs/service.md, "Webhooks").
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx

from app.db.base import utcnow
from app.db.session import retrying, transaction
from app.repositories.webhooks import Claimed, WebhookRepository
from app.services.webhook_destinations import NotAllowed, Unresolved, resolve
from app.services.webhooks import SECRET_PREFIX
from app.settings import Settings
from contract.webhooks import DeliveryStatus

log = logging.getLogger("muonforge.webhooks")
# Each wait about 6 times the one before: 5 s, 30 s, 3 min, 18 min, 1.8 h, then the cap (2 h) until
# the window closes, about 17 attempts in 24 h (Svix's schedule grows about as fast).
GROWTH = 6.0
JITTER = 0.2  # waits vary by +-20%, so receivers that failed together are not all tried again together
USER_AGENT = "muonforge-webhooks"
ERROR_CHARS = 500  # the width of the error columns
PRUNE_SECONDS = 600.0  # how often an API process removes deliveries older than webhook_log_days
PRUNE_BATCH = 1000  # deliveries deleted per transaction (short row locks on a long log)
RECORD_PATIENCE = 30.0  # seconds an outcome is retried through a database outage (then the claim lapses)


@dataclass(frozen=True)
class Outcome:
    """What one attempt got: the answer's status code, or the error; ``final``: no retry."""

    status_code: int | None = None
    error: str | None = None
    final: bool = False

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,`` and the base64 HMAC-SHA256 of
    ``{message_id}.{timestamp}.{body}`` under the key that ``secret`` (``whsec_`` + base64) holds."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def retry_delay(failures: int, base: float, most: float, jitter: float) -> float:
    """Seconds to wait after the ``failures``-th failed attempt in a row (1, 2, ...).

    ``base * GROWTH ** (failures - 1)``, at most ``most``, then scaled by 1 - JITTER ... 1 + JITTER
    as ``jitter`` (a uniform draw in [0, 1]) goes from 0 to 1.
    """
    delay = min(base * GROWTH ** min(failures - 1, 32), most)
    return delay * (1 - JITTER + 2 * JITTER * jitter)


def next_attempt_at(
    created_at: datetime, now: datetime, failures: int, settings: Settings, jitter: float
) -> datetime | None:
    """When to try again after the ``failures``-th failed attempt; None once the retry window,
    counted from the event, has passed. The last try falls at the window's end."""
    deadline = created_at + timedelta(seconds=settings.webhook_retry_window_seconds)
    if now >= deadline:
        return None
    delay = retry_delay(failures, settings.webhook_retry_base_seconds, settings.webhook_retry_max_seconds, jitter)
    return min(now + timedelta(seconds=delay), deadline)


def lease(settings: Settings) -> timedelta:
    """How long a claim lasts: the lookup, connect, send and wait for the answer, with room to spare."""
    return timedelta(seconds=4 * settings.webhook_timeout_seconds + 30)


def send(http: httpx.Client, claimed: Claimed, settings: Settings) -> Outcome:
    """POST the delivery's body, signed, to the checked address of its endpoint's URL. The
    answer's body is not read: only its status counts, and a redirect is not followed."""
    try:
        destination = resolve(claimed.url, settings.webhook_allow_list, settings.webhook_require_https)
    except NotAllowed as exc:
        return Outcome(error=f"not sent: {exc}", final=True)
    except Unresolved as exc:
        return Outcome(error=str(exc))
    body, timestamp = claimed.body.encode(), int(time.time())
    headers = {
        **destination.headers,
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "webhook-id": claimed.id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(claimed.secret, claimed.id, timestamp, body),
    }
    try:
        sent = http.stream("POST", destination.url, content=body, headers=headers, extensions=destination.extensions)
        with sent as response:
            code = response.status_code
    except httpx.HTTPError as exc:
        return Outcome(error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    return Outcome(code, None if 200 <= code < 300 else f"answered {code}")


def deliver(settings: Settings, http: httpx.Client, claimed: Claimed) -> Outcome:
    """One attempt at a claimed delivery, its outcome recorded: delivered, due again later, or
    failed (outside the allow-list, or past the retry window)."""
    started, clock = utcnow(), time.monotonic()
    outcome = send(http, claimed, settings)
    duration_ms, now = round((time.monotonic() - clock) * 1000), utcnow()
    retry = None
    if not outcome.delivered and not outcome.final:  # every earlier attempt failed too: attempt n is failure n
        retry = next_attempt_at(claimed.created_at, now, claimed.attempt, settings, random.random())
    if outcome.delivered:
        values = {"status": DeliveryStatus.DELIVERED, "next_attempt_at": None, "finished_at": now}
    elif retry is not None:
        values = {"next_attempt_at": retry}
    else:
        values = {"status": DeliveryStatus.FAILED, "next_attempt_at": None, "finished_at": now}
    error = outcome.error[:ERROR_CHARS] if outcome.error else None

    def record() -> bool:
        with transaction(settings) as session:
            return WebhookRepository(session).record_attempt(
                claimed.id, claimed.attempt, started, duration_ms, outcome.status_code, error, **values
            )

    if retrying(record, f"webhook {claimed.id}: recording attempt {claimed.attempt}", RECORD_PATIENCE):
        level = logging.WARNING if values.get("status") == DeliveryStatus.FAILED else logging.INFO
        log.log(level, "webhook %s: attempt %d: %s", claimed.id, claimed.attempt, error or outcome.status_code)
    return outcome


def claim_due(settings: Settings, limit: int) -> list[Claimed]:
    now = utcnow()
    with transaction(settings) as session:
        return WebhookRepository(session).claim_due(now, now + lease(settings), limit)


def prune_log(settings: Settings) -> int:
    """Remove the deliveries that ended more than ``webhook_log_days`` ago, a batch per
    transaction; returns how many. Pending ones are never removed, however old."""
    before, removed = utcnow() - timedelta(days=settings.webhook_log_days), 0
    while True:
        with transaction(settings) as session:
            count = WebhookRepository(session).prune_finished(before, PRUNE_BATCH)
        removed += count
        if count < PRUNE_BATCH:
            return removed


def run_deliveries(settings: Settings, stop: threading.Event) -> None:
    """Send the due deliveries, up to ``webhook_concurrency`` at once, until ``stop`` is set.

    Each is sent from a thread of a pool. It looks for more every ``webhook_poll_seconds``, and as
    soon as an attempt ends (a backlog drains at the pace of the receivers, not of the poll). Every
    PRUNE_SECONDS, the delivery log is pruned (``prune_log``).
    """
    wake, next_prune = threading.Event(), time.monotonic() + PRUNE_SECONDS
    in_flight: set[Future] = set()
    client = httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False, trust_env=False)
    # trust_env=False: a proxy from the environment would resolve the host again itself.
    with client as http, ThreadPoolExecutor(settings.webhook_concurrency, thread_name_prefix="webhook") as pool:
        while not stop.is_set():
            in_flight = {f for f in in_flight if not f.done()}
            free = settings.webhook_concurrency - len(in_flight)
            try:
                claimed = claim_due(settings, free) if free > 0 else []
            except Exception:
                log.exception("claiming webhook deliveries failed")
                claimed = []
            for delivery in claimed:
                future = pool.submit(_deliver_logged, settings, http, delivery)
                future.add_done_callback(lambda _: wake.set())
                in_flight.add(future)
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + PRUNE_SECONDS
                try:
                    prune_log(settings)
                except Exception:
                    log.exception("pruning the webhook delivery log failed")
            wake.wait(settings.webhook_poll_seconds)
            wake.clear()


def _deliver_logged(settings: Settings, http: httpx.Client, claimed: Claimed) -> None:
    try:
        deliver(settings, http, claimed)
    except Exception:  # its claim lapses and the delivery is tried again
        log.exception("webhook %s: attempt %d failed", claimed.id, claimed.attempt)
