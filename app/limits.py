"""Limits before work: a request's body is bounded, and a /v1 request is authenticated before a
byte of its body is read.

FastAPI reads (and parses) a body before it resolves a route's dependencies, so without this an
unauthenticated caller could make the API read a body of any size. ``BodyLimit`` is pure ASGI and
sits in front of the routes:

1. a declared Content-Length over the limit is answered 413 at once, nothing read;
2. a /v1 request with a body (POST, PUT, PATCH) is authenticated from its headers alone; the
   tenant is kept in the request's state, where the unit of work takes it (one lookup, not two).
   The web app's sign-in, whose body is the key, is only bounded;
3. the body is counted as it streams in, chunked uploads included: the request is refused with
   413 the moment the count passes the limit, so no more than the limit is ever read.

The limit is ``MUONFORGE_MAX_BODY_BYTES`` for JSON (a job spec is a few kB) and
``MUONFORGE_UPLOAD_LIMIT_BYTES`` plus the multipart framing for dataset uploads.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.db.session import open_session
from app.deps import SESSION_COOKIE, request_key
from app.errors import DomainError, error_response
from app.services.auth import KeyCache, TenantRef, authenticate, cached_tenant
from app.services.quotas import RequestRate
from app.settings import Settings

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SIGN_IN = "/v1/session"  # its body is the key: bounded, not authenticated beforehand
UPLOAD_PATHS = frozenset({"/v1/datasets"})
MULTIPART_SLACK = 64 * 1024  # boundaries, part headers and the form's other fields


class BodyLimit:
    def __init__(self, app: ASGIApp, settings: Settings, key_cache: KeyCache, request_rate: RequestRate) -> None:
        self.app, self.settings, self.key_cache, self.request_rate = app, settings, key_cache, request_rate

    def limit_for(self, path: str) -> int:
        if path in UPLOAD_PATHS:
            return self.settings.upload_limit_bytes + MULTIPART_SLACK
        return self.settings.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        path, headers = scope["path"], Headers(scope=scope)
        limit = self.limit_for(path)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await too_large(limit)(scope, receive, send)
        if path.startswith("/v1/") and path != SIGN_IN:
            try:
                session_key = cookie_parser(headers.get("cookie", "")).get(SESSION_COOKIE)
                authorization = request_key(headers.get("authorization"), session_key)
                # A key verified within the cache's time costs no thread; only a miss asks the database.
                tenant = cached_tenant(authorization, self.key_cache) or await run_in_threadpool(
                    self._authenticate, authorization
                )
                self.request_rate.take(tenant.id)
            except DomainError as exc:
                response = error_response(exc.status, exc.code, exc.message, exc.param, exc.headers)
                return await response(scope, receive, send)
            scope.setdefault("state", {})["tenant"] = tenant

        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # An HTTPException passes through FastAPI's body parsing (anything else would
                    # become a 400) to the error handlers, which answer 413.
                    raise HTTPException(413, body_limit_message(limit))
            return message

        await self.app(scope, counted, send)

    def _authenticate(self, authorization: str | None) -> TenantRef:
        with open_session(self.settings) as session:
            tenant = authenticate(session, authorization, self.key_cache)
            session.commit()  # the key's last use, when a lookup wrote it
        return tenant


def body_limit_message(limit: int) -> str:
    return f"the request body exceeds {limit:,} bytes"


def too_large(limit: int):
    response = error_response(413, "payload_too_large", body_limit_message(limit))
    response.headers["Connection"] = "close"  # the body was not read: the connection cannot be reused
    return response
