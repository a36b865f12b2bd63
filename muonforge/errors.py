"""What the clients raise, all ``MuonforgeError``.

An error answer of the API is an ``ApiError`` (a subclass per kind), a server that cannot be
reached ``ConnectionFailed``, and a client that is not configured ``ConfigError``.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping


class MuonforgeError(Exception):
    """Anything the client raises on purpose.

    ``attempts``: how many times the request was sent (retries included); ``waited``: the seconds
    spent waiting between them.
    """

    attempts: int = 1
    waited: float = 0.0


class ConfigError(MuonforgeError, ValueError):
    """The client lacks a setting: ``problem`` (e.g. "no API key"), fixed by the environment
    variable ``env`` or the argument ``argument``."""

    def __init__(self, problem: str, env: str, argument: str) -> None:
        super().__init__(f"{problem}: set {env} or pass {argument}=")
        self.problem, self.env, self.argument = problem, env, argument


class ConnectionFailed(MuonforgeError):
    """No answer from the server at ``url``: refused, unresolvable, timed out or cut off.
    ``timed_out``: the connection was made but the answer did not come in time."""

    def __init__(self, url: str, reason: str, timed_out: bool = False) -> None:
        super().__init__(f"cannot reach the server at {url}: {reason}")
        self.url, self.reason, self.timed_out = url, reason, timed_out


class ApiError(MuonforgeError):
    """An error answer of the API.

    ``status``, ``code``, ``message``, ``param`` (the offending field, dotted, or None),
    ``request_id`` (when the server or a proxy sent one) and ``request`` (what was asked:
    "GET http://127.0.0.1:8000/v1/jobs/job_1").
    """

    request: str | None = None

    def __init__(self, status: int, code: str, message: str, param: str | None, request_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" ({param})" if param else ""))
        self.status, self.code, self.message, self.param = status, code, message, param
        self.request_id = request_id


class Unauthorized(ApiError):
    """401 or 403: the API key is missing, wrong or revoked (401), or not allowed to do this (403)."""


class Forbidden(Unauthorized):
    """403: the API key is valid but may not do this."""


class NotFound(ApiError):
    """404: no such object for this tenant (another tenant's object answers the same)."""


class Conflict(ApiError):
    """409: the request contradicts the object's state (cancelling a finished job, deleting a
    dataset an unfinished job uses, an Idempotency-Key reused with another body)."""


class PayloadTooLarge(ApiError):
    """413: an upload over the server's limit (`payload_too_large`) or the tenant's storage quota
    (`storage_quota_exceeded`)."""


class ValidationError(ApiError):
    """422: a field is invalid; ``param`` names it (the first, when several are); ``fields`` lists
    every invalid field as ``(param, message)``."""

    fields: list[tuple[str | None, str]]


class RateLimited(ApiError):
    """429: too many jobs queued or running; ``retry_after`` is the server's wait, in seconds."""

    retry_after: float | None = None


class ServerError(ApiError):
    """5xx: the server failed (or a proxy in front of it)."""


KINDS: dict[int, type[ApiError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationError,
    429: RateLimited,
}


def api_error(status: int, body: bytes, headers: Mapping[str, str], retry_after: float | None = None) -> ApiError:
    """The exception for an error answer: its kind from the status, its fields from the body.

    The body is ``{"error": {code, message, param, errors?}}`` (or the text of another server's
    answer: a proxy's page, a server that is not muonforge).
    """
    try:
        error = json.loads(body)["error"]
        code, message, param = error["code"], error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        error, code, message, param = {}, ("internal" if status >= 500 else "http_error"), _text(body, status), None
    kind = ServerError if status >= 500 else KINDS.get(status, ApiError)
    exc = kind(status, code, message, param, headers.get("x-request-id"))
    if isinstance(exc, RateLimited):
        exc.retry_after = retry_after
    if isinstance(exc, ValidationError):
        exc.fields = _fields(error) or [(param, message)]
    return exc


def _fields(error: dict) -> list[tuple[str | None, str]]:
    """The ``errors`` list of a 422 (every invalid field), when the server sent one."""
    try:
        return [(e.get("param"), str(e["message"])) for e in error.get("errors") or ()]
    except (AttributeError, KeyError, TypeError):
        return []


def _text(body: bytes, status: int) -> str:
    """Another server's error page in a few words: an HTML page's title, else its text."""
    text = body.decode(errors="replace")
    if title := re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL):
        text = title.group(1)
    elif re.match(r"\s*<", text):
        text = re.sub(r"<[^>]*>", " ", text)
    return " ".join(html.unescape(text).split())[:300] or f"HTTP {status}"
