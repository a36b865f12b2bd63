"""Limits before work: a request's body bounded, its key checked and its tenant's quotas taken.

FastAPI reads (and parses) a body before it resolves a route's dependencies, so ``Limits`` is pure
ASGI in front of the routes: a body over the limit answers 413 and is never read past it, and a
/v1 request other than the sign-in is authenticated from its headers and admitted (a rate token,
for a stream a slot) here, or refused with 401 or 429 before any routing, dependency or thread.
The tenant found is kept in the request's state for its unit of work. docs/service.md, "Limits
before work" and "Per-tenant limits", describes each step.
"""

from __future__ import annotations

import asyncio
import re

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.deps import SESSION_COOKIE, authenticated, request_key
from app.api.streams import serve_stream
from app.errors import DomainError, Unauthorized, error_response
from app.services.auth import MISSING_KEY, KeyCache, TenantRef, bearer_digest, cached_tenant
from app.services.quotas import TenantLimits
from app.settings import Settings
from app.storage.base import MAX_PART_BYTES

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SIGN_IN = "/v1/session"  # its body is the key: bounded, not authenticated beforehand
UPLOAD_PATHS = frozenset({"/v1/datasets"})
MODEL_UPLOAD_PATH = "/v1/models"  # a model archive: MUONFORGE_MAX_MODEL_BYTES
UPLOAD_PART_PATH = re.compile(r"^/v1/uploads/[^/]+/parts/[^/]+$")  # one part of a resumable upload
EVENTS_PATH = re.compile(r"^/v1/jobs/[^/]+/events$")  # a stream: it takes one of the tenant's stream slots
MULTIPART_SLACK = 64 * 1024  # boundaries, part headers and the form's other fields


class Limits:
    def __init__(
        self,
        app: ASGIApp,
        settings: Settings,
        key_cache: KeyCache,
        tenant_limits: TenantLimits,
    ) -> None:
        self.app, self.settings, self.key_cache, self.tenant_limits = app, settings, key_cache, tenant_limits
        self._lookups: dict[str, asyncio.Future[TenantRef]] = {}  # key digest -> its lookup in flight

    def limit_for(self, path: str) -> int:
        if path in UPLOAD_PATHS:
            return self.settings.upload_limit_bytes + MULTIPART_SLACK
        if path == MODEL_UPLOAD_PATH:
            return self.settings.max_model_bytes + MULTIPART_SLACK
        if UPLOAD_PART_PATH.match(path):
            return MAX_PART_BYTES
        return self.settings.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method, headers = scope["path"], scope["method"], Headers(scope=scope)
        with_body = method in BODY_METHODS
        limit = self.limit_for(path)
        declared = headers.get("content-length", "") if with_body else ""
        if declared.isdigit() and int(declared) > limit:
            return await too_large(limit)(scope, receive, send)
        if path.startswith("/v1/") and path != SIGN_IN:
            tenant = None
            try:
                session_key = cookie_parser(headers.get("cookie", "")).get(SESSION_COOKIE)
                authorization = request_key(headers.get("authorization"), session_key)
                tenant = await self._tenant(authorization)
                await self.tenant_limits.take_request(tenant.id)
                scope.setdefault("state", {})["tenant"] = tenant
                if method == "GET" and EVENTS_PATH.match(path):
                    # The stream's slot is taken here and held until its response ends: of a
                    # burst of stream requests, only those that get a slot reach the routes.
                    async with self.tenant_limits.stream_slot(tenant.id):
                        scope["state"]["stream_slot"] = tenant.id
                        return await serve_stream(self.app, scope, receive, send)
            except DomainError as exc:
                response = error_response(exc.status, exc.code, exc.message, exc.param, exc.headers)
                retry_after = float(exc.headers.get("Retry-After", 0))
                if (
                    exc.status == 429
                    and tenant is not None
                    and not await self.tenant_limits.pause_refusal(tenant.id, retry_after)
                ):
                    response.headers["Connection"] = "close"
                return await response(scope, receive, send)
        if not with_body:
            return await self.app(scope, receive, send)

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

    async def _tenant(self, authorization: str | None) -> TenantRef:
        """The key's tenant: from the cache on the event loop, else looked up in a thread.

        One lookup per key at a time: when a busy key's cache entry expires, the requests in flight
        with it wait for the first one's lookup instead of each taking a thread and a query.
        """
        if (tenant := cached_tenant(authorization, self.key_cache)) is not None:
            return tenant
        digest = bearer_digest(authorization)
        if digest is None:
            raise Unauthorized(MISSING_KEY)
        if (pending := self._lookups.get(digest)) is not None:
            return await asyncio.shield(pending)
        pending = self._lookups[digest] = asyncio.get_running_loop().create_future()
        try:
            tenant = await run_in_threadpool(authenticated, self.settings, authorization, self.key_cache)
        except BaseException as exc:
            pending.set_exception(exc)
            pending.exception()  # retrieved: no warning when no other request waited for it
            raise
        else:
            pending.set_result(tenant)
            return tenant
        finally:
            del self._lookups[digest]


def body_limit_message(limit: int) -> str:
    return f"the request body exceeds {limit:,} bytes"


def too_large(limit: int):
    response = error_response(413, "payload_too_large", body_limit_message(limit))
    response.headers["Connection"] = "close"  # the body was not read: the connection cannot be reused
    return response
