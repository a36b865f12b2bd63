"""User-facing entry points: the ``muonforge`` CLI and the Python clients.

``from muonforge import Client, AsyncClient``.
"""

from muonforge.async_client import AsyncClient
from muonforge.client import FINISHED, STATUSES, Client, Event, Retry
from muonforge.errors import (
    ApiError,
    ConfigError,
    Conflict,
    ConnectionFailed,
    Forbidden,
    MuonforgeError,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServerError,
    Unauthorized,
    ValidationError,
)

__all__ = [
    "FINISHED",
    "STATUSES",
    "ApiError",
    "AsyncClient",
    "Client",
    "ConfigError",
    "Conflict",
    "ConnectionFailed",
    "Event",
    "Forbidden",
    "MuonforgeError",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "Retry",
    "ServerError",
    "Unauthorized",
    "ValidationError",
]
