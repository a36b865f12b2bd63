"""User-facing entry points: the ``muonforge`` CLI and the Python client (``from muonforge import Client``)."""

from muonforge.client import ApiError, Client

__all__ = ["ApiError", "Client"]
