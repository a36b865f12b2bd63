"""API keys: long random tokens, stored and looked up as SHA-256 hashes.

A key has 256 bits of entropy, so a fast hash is safe here and costs microseconds per request
(a password hash such as bcrypt would cost 50-100 ms on every call). A verified key is
remembered for ``auth_cache_seconds``, which saves a database round trip on every request; a
revoked key therefore keeps working for at most that long. Unknown keys are never remembered.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.errors import Unauthorized
from app.repositories.tenants import TenantRepository

KEY_PREFIX = "mf_"


@dataclass(frozen=True)
class TenantRef:
    """The authenticated tenant of a request: what services need of it, safe to cache."""

    id: str
    name: str
    job_cap: int | None


class KeyCache:
    """Verified key hashes -> TenantRef, for ``ttl`` seconds, at most ``size`` entries (LRU)."""

    def __init__(self, ttl: float, size: int = 10_000) -> None:
        self.ttl, self.size = ttl, size
        self._entries: OrderedDict[str, tuple[float, TenantRef]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> TenantRef | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None or entry[0] < time.monotonic():
                return None
            self._entries.move_to_end(digest)
            return entry[1]

    def put(self, digest: str, tenant: TenantRef) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            self._entries[digest] = (time.monotonic() + self.ttl, tenant)
            self._entries.move_to_end(digest)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(session: Session, tenant_name: str) -> str:
    """Create (or reuse) the tenant and a new key for it; returns the key, shown once."""
    repo = TenantRepository(session)
    tenant = repo.get_or_create(tenant_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    repo.add_key(tenant, hash_key(key), key[:10])
    return key


def authenticate(session: Session, authorization: str | None, cache: KeyCache | None = None) -> TenantRef:
    """The tenant of ``Authorization: Bearer <key>``, or Unauthorized."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("send Authorization: Bearer <API key>")
    digest = hash_key(key.strip())
    if cache is not None and (tenant := cache.get(digest)) is not None:
        return tenant
    found = TenantRepository(session).tenant_for_key_hash(digest)
    # The lookup is by hash; the constant-time compare guards the final equality check.
    if found is None or not hmac.compare_digest(found[1].key_hash, digest):
        raise Unauthorized("unknown or revoked API key")
    tenant = TenantRef(found[0].id, found[0].name, found[0].job_cap)
    if cache is not None:
        cache.put(digest, tenant)
    return tenant


def tenant_name(session: Session, tenant: TenantRef) -> str:
    """The authenticated tenant's name (the unit of work has checked the key)."""
    return tenant.name
