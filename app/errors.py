"""Domain errors, and the one way every error is rendered: ``{"error": {"code", "message",
"param"}}`` with its HTTP status (``install_error_handlers``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("muonforge.api")


class DomainError(Exception):
    code = "internal"
    status = 500

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.headers = message, param, headers or {}


class Unauthorized(DomainError):
    code, status = "unauthorized", 401


class NotFound(DomainError):
    code, status = "not_found", 404


class Conflict(DomainError):
    code, status = "conflict", 409


class PayloadTooLarge(DomainError):
    code, status = "payload_too_large", 413


class ValidationFailed(DomainError):
    code, status = "validation_error", 422


class RateLimited(DomainError):
    code, status = "rate_limited", 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


# The code of an error raised by the framework itself (no route, wrong method, ...), by status.
HTTP_CODES = {
    401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 409: "conflict", 413: "payload_too_large",
    422: "validation_error", 429: "rate_limited",
}  # fmt: skip


def error_response(
    status: int, code: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The one error body: ``{"error": {"code", "message", "param"}}``."""
    body = {"error": {"code": code, "message": message, "param": param}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _domain_error(_: Request, exc: DomainError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.param, exc.headers)


async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return error_response(422, "validation_error", message, ".".join(loc) or None)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = HTTP_CODES.get(exc.status_code, "internal")
    return error_response(exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal", "internal error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(DomainError, _domain_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
