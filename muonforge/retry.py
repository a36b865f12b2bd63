"""When the clients send a request again and how long they wait first, for Client and AsyncClient.

One pure function (``retry_delay``) and the bookkeeping of one call's failures (``Attempts``).
"""

from __future__ import annotations

import enum
import logging
import os
import random
import re
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import httpx

from muonforge.errors import ConnectionFailed, MuonforgeError, api_error

log = logging.getLogger("muonforge.client")

RETRY_STATUSES = (429, 500, 502, 503, 504)
TRANSIENT = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # the request never left


class Repeat(enum.Enum):
    """Whether a request may be sent again after a failure."""

    SAFE = "safe"  # repeating it cannot do twice what was asked once: a GET, a POST with an Idempotency-Key
    UNSENT = "unsent"  # only when the server surely did not act on it: no connection, or 429
    NEVER = "never"  # its body cannot be sent again (a stream that cannot be rewound)


@dataclass(frozen=True)
class Retry:
    """How the clients retry 429, 5xx, connection failures and timeouts.

    At most ``max_retries`` times, waiting the server's Retry-After, or else ``backoff`` × 2^n
    seconds (at most ``max_backoff``) with jitter. A Retry-After over ``max_wait`` seconds is not
    waited for: the error is raised.
    """

    max_retries: int = 4
    backoff: float = 0.5
    max_backoff: float = 8.0
    max_wait: float = 60.0


NO_RETRY = Retry(max_retries=0)


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """A Retry-After header as seconds from ``now`` (Unix time): delta-seconds or an HTTP date.
    None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now)
    except (TypeError, ValueError):
        return None


def retry_delay(
    policy: Retry,
    retries: int,
    repeat: Repeat,
    *,
    status: int | None = None,
    error: Exception | None = None,
    retry_after: float | None = None,
    jitter: float = 0.5,
) -> float | None:
    """Seconds to wait before sending a request again; None: do not retry.

    The request has been retried ``retries`` times and now failed with the HTTP ``status`` or the
    transport ``error``. ``retry_after`` is the server's wait in seconds, ``jitter`` a number in
    [0, 1) that keeps many clients from retrying in step.
    """
    if retries >= policy.max_retries or repeat is Repeat.NEVER:
        return None
    if error is not None:
        retryable = isinstance(error, UNSENT) or (repeat is Repeat.SAFE and isinstance(error, TRANSIENT))
    else:  # a 429 was refused before anything was done; a 5xx may have done part of it
        retryable = status == 429 or (repeat is Repeat.SAFE and status in RETRY_STATUSES)
    if not retryable:
        return None
    if retry_after is not None:
        return retry_after if retry_after <= policy.max_wait else None
    return min(policy.max_backoff, policy.backoff * 2**retries) * (0.5 + jitter / 2)


def describe(error: BaseException, timeout: float | None = None) -> str:
    """A transport error in a few words: "connection refused", "no answer within 30 s", ..."""
    if isinstance(error, httpx.ConnectTimeout):
        return "connection timed out"
    if isinstance(error, httpx.TimeoutException):
        return f"no answer within {timeout:g} s" if timeout else "timed out"
    cause: BaseException | None = error
    while cause is not None:  # the socket's own error says most: "connection refused"
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno).lower()
        cause = cause.__cause__ or cause.__context__
    text = re.sub(r"^\[Errno -?\d+\] ", "", str(error)).strip().rstrip(".")
    return (text[0].lower() + text[1:]) if text else type(error).__name__


class Attempts:
    """The failures of one call so far.

    Each failure gives the wait before the next attempt, or raises what the caller gets: the
    ApiError of the last answer, or ConnectionFailed; either says how many attempts were made and
    how long was waited between them. A wait the server asked for (Retry-After) is logged as a
    warning, the others as info.
    """

    def __init__(self, policy: Retry, repeat: Repeat, url: str, what: str, timeout: float | None = None) -> None:
        self.policy, self.repeat, self.url, self.what, self.timeout = policy, repeat, url, what, timeout
        self.retries = 0
        self.waited = 0.0

    def after_response(self, response: httpx.Response) -> float:
        """``response`` is an error answer, already read."""
        retry_after = retry_after_seconds(response.headers.get("retry-after"), time.time())
        status = response.status_code
        error = api_error(status, response.content, response.headers, retry_after)
        method, _, path = self.what.partition(" ")
        error.request = f"{method} {self.url}{path}"
        delay = retry_delay(
            self.policy, self.retries, self.repeat, status=status, retry_after=retry_after, jitter=random.random()
        )
        if delay is None:
            raise self._final(error)
        if retry_after is not None:
            log.warning(
                "%s (%d %s); waiting %g s as the server asks, then retry %d of %d",
                error.message,
                status,
                error.code,
                delay,
                self.retries + 1,
                self.policy.max_retries,
            )
        return self._next(delay, f"HTTP {status}")

    def after_error(self, error: httpx.TransportError) -> float:
        delay = retry_delay(self.policy, self.retries, self.repeat, error=error, jitter=random.random())
        reason = describe(error, self.timeout)
        if delay is None:
            timed_out = isinstance(error, httpx.TimeoutException) and not isinstance(error, UNSENT)
            raise self._final(ConnectionFailed(self.url, reason, timed_out)) from error
        return self._next(delay, reason)

    def reset(self) -> None:
        """The call made progress (a stream delivered an event): count its failures afresh."""
        self.retries, self.waited = 0, 0.0

    def _next(self, delay: float, reason: str) -> float:
        self.retries += 1
        self.waited += delay
        log.info("%s: %s; retry %d in %.1f s", self.what, reason, self.retries, delay)
        return delay

    def _final(self, error: MuonforgeError) -> MuonforgeError:
        error.attempts, error.waited = self.retries + 1, self.waited
        return error
