"""Domain errors, and the one way every error is rendered (``install_error_handlers``).

Every error answers ``{"error": {"code", "message", "param"}}`` with its HTTP status.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import TypedDict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from contract.spec import error_path

log = logging.getLogger("muonforge.api")


class DomainError(Exception):
    code = "internal"
    status = 500

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.headers = message, param, headers or {}


class Unauthorized(DomainError):
    code, status = "unauthorized", 401


class Forbidden(DomainError):
    code, status = "forbidden", 403


class TenantSuspended(Forbidden):
    code = "tenant_suspended"


class NotFound(DomainError):
    code, status = "not_found", 404


class Conflict(DomainError):
    code, status = "conflict", 409


class PayloadTooLarge(DomainError):
    code, status = "payload_too_large", 413


class StorageQuotaExceeded(PayloadTooLarge):
    code = "storage_quota_exceeded"


class DatasetInUse(Conflict):
    code = "dataset_in_use"


class ModelInUse(Conflict):
    code = "model_in_use"


class ValidationFailed(DomainError):
    code, status = "validation_error", 422


class ServiceUnavailable(DomainError):
    """A service the request needs (the artifact store) cannot be reached: retry later."""

    code, status = "service_unavailable", 503


class UploadNotPending(Conflict):
    """A part or a completion of an upload that is completing, completed or cancelled."""

    code = "upload_not_pending"


class UploadPartsMismatch(Conflict):
    """A completion whose parts are not the ones stored (missing, extra, or another sha256)."""

    code = "upload_parts_mismatch"


class UploadExpired(DomainError):
    """An upload past its expiry: its parts are deleted."""

    code, status = "upload_expired", 410


class ArtifactChanged(DomainError):
    """A stored object's bytes are not the ones its row records (changed behind the service's
    back): the store, upstream of the API, answered with something other than what was stored."""

    code, status = "artifact_changed", 502


class RateLimited(DomainError):
    code, status = "rate_limited", 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
# The code of an error raised by the framework itself (no route, wrong method, ...), by status.
HTTP_CODES = {
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    422: "validation_error",
    429: "rate_limited",
}


class FieldError(TypedDict):
    """One invalid field of a request: ``{"param": "optimizer.lr", "message": "..."}``."""

    param: str | None
    message: str


def error_response(
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    errors: list[FieldError] | None = None,
) -> JSONResponse:
    """The one error body: ``{"error": {"code", "message", "param"}}``; a 422 of the request's
    validation also lists every invalid field in ``errors`` (``[{"param", "message"}]``)."""
    error: dict[str, object] = {"code": code, "message": message, "param": param}
    if errors is not None:
        error["errors"] = errors
    return JSONResponse({"error": error}, status_code=status, headers=headers)


async def _domain_error(_: Request, exc: DomainError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.param, exc.headers)


def _field(error: dict) -> FieldError:
    """One pydantic error as ``{"param": "optimizer.lr", "message": "..."}``."""
    loc = [str(p) for p in error.get("loc", ())]
    where, loc = (loc[0], loc[1:]) if loc and loc[0] in ("body", "query", "path", "header") else (None, loc)
    message = str(error.get("msg", "invalid request")).removeprefix("Value error, ")
    return {"param": (error_path(loc) if where == "body" else ".".join(loc)) or None, "message": message}


async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    fields = [_field(error) for error in exc.errors()] or [FieldError(param=None, message="invalid request")]
    return error_response(422, "validation_error", fields[0]["message"], fields[0]["param"], errors=fields)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 400:  # FastAPI could not parse the body (not JSON, not UTF-8, a broken form)
        return error_response(422, "validation_error", "the request body could not be parsed", "body")
    if exc.status_code == 405:  # every method of the path, not only those of the first route that matched it
        headers["Allow"] = ", ".join(allowed_methods(request))
    code = HTTP_CODES.get(exc.status_code, "internal")
    return error_response(exc.status_code, code, str(exc.detail), headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """The methods some route answers on the request's path (routes of one path may live in
    several routers, each with its own methods)."""
    routes = request.app.router.routes
    return [m for m in METHODS if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # The id the answer and the log share: a proxy's X-Request-ID when it sent one, else a new one.
    request_id = request.headers.get("x-request-id", "")
    if not re.fullmatch(r"[\w.:-]{1,100}", request_id):
        request_id = f"req_{uuid.uuid4().hex[:16]}"
    log.exception("unhandled error (request %s)", request_id, exc_info=exc)
    return error_response(500, "internal", "internal error", headers={"X-Request-ID": request_id})


def install_error_handlers(app: FastAPI) -> None:
    # FastAPI's exception_handler takes a handler of the class it is registered for (Starlette's
    # add_exception_handler is annotated for handlers of any Exception).
    app.exception_handler(DomainError)(_domain_error)
    app.exception_handler(RequestValidationError)(_invalid_request)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_unexpected)
