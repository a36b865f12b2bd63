"""Domain errors. One handler (app.main) renders each as
``{"error": {"code", "message", "param"}}`` with its HTTP status."""

from __future__ import annotations


class DomainError(Exception):
    code = "internal"
    status = 500

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.headers = message, param, headers or {}

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "param": self.param}}


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
