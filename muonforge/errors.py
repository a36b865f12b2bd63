"""What the clients raise: an error answer of the API (``ApiError`` and a subclass per kind), a
server that cannot be reached (``ConnectionFailed``), a client that is not configured
(``ConfigError``). All are ``MuonforgeError``."""

from __future__ import annotations

import json
from collections.abc import Mapping


class MuonforgeError(Exception):
    """Anything the client raises on purpose."""


class ConfigError(MuonforgeError, ValueError):
    """The client lacks a setting: ``problem`` (e.g. "no API key"), fixed by the environment
    variable ``env`` or the argument ``argument``."""

    def __init__(self, problem: str, env: str, argument: str) -> None:
        super().__init__(f"{problem}: set {env} or pass {argument}=")
        self.problem, self.env, self.argument = problem, env, argument


class ConnectionFailed(MuonforgeError):
    """No answer from the server at ``url``: refused, unresolvable, timed out or cut off."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach the server at {url}: {reason}")
        self.url, self.reason = url, reason


class ApiError(MuonforgeError):
    """An error answer of the API: ``status``, ``code``, ``message``, ``param`` (the offending
    field, dotted, or None) and ``request_id`` (when the server or a proxy sent one)."""

    def __init__(self, status: int, code: str, message: str, param: str | None, request_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" ({param})" if param else ""))
        self.status, self.code, self.message, self.param = status, code, message, param
        self.request_id = request_id


class Unauthorized(ApiError):
    """401 or 403: the API key is missing, wrong or revoked."""


class NotFound(ApiError):
    """404: no such object for this tenant (another tenant's object answers the same)."""


class Conflict(ApiError):
    """409: the request contradicts the object's state (cancelling a finished job, an
    Idempotency-Key reused with another body)."""


class PayloadTooLarge(ApiError):
    """413: an upload over the server's limit."""


class ValidationError(ApiError):
    """422: a field is invalid; ``param`` names it."""


class RateLimited(ApiError):
    """429: too many jobs queued or running; ``retry_after`` is the server's wait, in seconds."""

    retry_after: float | None = None


class ServerError(ApiError):
    """5xx: the server failed (or a proxy in front of it)."""


KINDS: dict[int, type[ApiError]] = {
    401: Unauthorized, 403: Unauthorized, 404: NotFound, 409: Conflict, 413: PayloadTooLarge,
    422: ValidationError, 429: RateLimited,
}  # fmt: skip


def api_error(status: int, body: bytes, headers: Mapping[str, str], retry_after: float | None = None) -> ApiError:
    """The exception for an error answer: its kind from the status, its fields from the
    ``{"error": {code, message, param}}`` body (or the raw text when a proxy answered)."""
    try:
        error = json.loads(body)["error"]
        code, message, param = error["code"], error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        code, message, param = ("internal" if status >= 500 else "http_error"), body.decode(errors="replace"), None
        message = " ".join(message.split())[:300] or f"HTTP {status}"
    kind = ServerError if status >= 500 else KINDS.get(status, ApiError)
    exc = kind(status, code, message, param, headers.get("x-request-id"))
    if isinstance(exc, RateLimited):
        exc.retry_after = retry_after
    return exc
