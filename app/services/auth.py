"""API keys: long random tokens, stored and looked up as SHA-256 hashes.

A key has 256 bits of entropy, so a fast hash is safe here and costs microseconds per request
(a password hash such as bcrypt would cost 50-100 ms on every call). A verified key is
remembered for ``auth_cache_seconds``, which saves a database round trip on every request; a
revoked key therefore keeps working for at most that long (an open events stream verifies its
key again as often, app.services.event_stream), and a tenant's new job cap (app.services.tenants)
applies after at most as long. Unknown keys are never remembered.

A key's ``last_used_at`` costs no write per request: it is written only when the key is looked
up in the database (a request after its cache entry expired, an open stream's check) and the
stored value is over ``LAST_USED_EVERY`` old, so at most once a minute per key, whatever the
traffic and the number of API processes, and it is precise to about a minute.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import ApiKey
from app.errors import Conflict, NotFound, Unauthorized
from app.repositories.tenants import TenantRepository

KEY_PREFIX = "mf_"
PREFIX_CHARS = 10  # stored and shown: "mf_" and 7 characters, to tell keys apart
MISSING_KEY = "send Authorization: Bearer <API key>"
LAST_USED_EVERY = timedelta(minutes=1)  # last_used_at is written at most this often per key


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


@dataclass(frozen=True)
class KeyInfo:
    """An API key as `muonforge keys list` shows it (never the key itself)."""

    id: str
    tenant: str
    name: str | None
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @classmethod
    def of(cls, key: ApiKey, tenant: str) -> KeyInfo:
        return cls(key.id, tenant, key.name, key.prefix, key.created_at, key.last_used_at, key.revoked_at)


def create_api_key(session: Session, tenant_name: str, name: str | None = None) -> str:
    """Create (or reuse) the tenant and a new key for it, named ``name``; returns the key, shown once."""
    repo = TenantRepository(session)
    tenant = repo.get_or_create(tenant_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    repo.add_key(tenant, hash_key(key), key[:PREFIX_CHARS], name)
    return key


def bearer_digest(authorization: str | None) -> str | None:
    """The hash of the key in ``Authorization: Bearer <key>``, or None without one."""
    scheme, _, key = (authorization or "").partition(" ")
    return hash_key(key.strip()) if scheme.lower() == "bearer" and key.strip() else None


def cached_tenant(authorization: str | None, cache: KeyCache) -> TenantRef | None:
    """The tenant of a key verified within the cache's time: no database, no thread."""
    digest = bearer_digest(authorization)
    return cache.get(digest) if digest else None


def authenticate(session: Session, authorization: str | None, cache: KeyCache | None = None) -> TenantRef:
    """The tenant of ``Authorization: Bearer <key>``, or Unauthorized."""
    digest = bearer_digest(authorization)
    if digest is None:
        raise Unauthorized(MISSING_KEY)
    if cache is not None and (tenant := cache.get(digest)) is not None:
        return tenant
    repo = TenantRepository(session)
    found = repo.tenant_for_key_hash(digest)
    # The lookup is by hash; the constant-time compare guards the final equality check.
    if found is None or not hmac.compare_digest(found[1].key_hash, digest):
        raise Unauthorized("unknown or revoked API key")
    tenant_row, api_key = found
    now = utcnow()
    if api_key.last_used_at is None or api_key.last_used_at <= now - LAST_USED_EVERY:
        repo.mark_key_used(api_key.id, now, unless_since=now - LAST_USED_EVERY)
    tenant = TenantRef(tenant_row.id, tenant_row.name, tenant_row.job_cap)
    if cache is not None:
        cache.put(digest, tenant)
    return tenant


def key_is_active(session: Session, key: str) -> bool:
    """Whether ``key`` is known and not revoked (a check that does not count as a use)."""
    return TenantRepository(session).tenant_for_key_hash(hash_key(key)) is not None


def list_api_keys(session: Session, tenant_name: str | None = None) -> list[KeyInfo]:
    """Every key (revoked ones too), or the tenant's: by tenant, then oldest first."""
    repo = TenantRepository(session)
    tenant_id = None
    if tenant_name is not None:
        tenant = repo.by_name(tenant_name)
        if tenant is None:
            raise NotFound(f"no tenant {tenant_name!r}", param="tenant")
        tenant_id = tenant.id
    return [KeyInfo.of(key, name) for key, name in repo.keys(tenant_id)]


def revoke_api_key(session: Session, ref: str) -> tuple[KeyInfo, bool]:
    """Revoke the key that ``ref`` names: its id, its prefix, or the key itself.

    Returns the key and whether this call revoked it (False: it already was).
    """
    ref = ref.strip()
    repo = TenantRepository(session)
    whole_key = ref.startswith(KEY_PREFIX) and len(ref) > PREFIX_CHARS
    found = repo.keys_matching(hash_key(ref) if whole_key else ref)
    if not found:
        shown = f"{ref[:PREFIX_CHARS]}…" if whole_key else ref  # never the whole key in a message
        raise NotFound(f"no API key {shown!r}", param="key")
    if len(found) > 1:
        ids = ", ".join(key.id for key, _ in found)
        raise Conflict(f"the prefix {ref!r} names {len(found)} keys ({ids}): give the id", param="key")
    key, tenant = found[0]
    if key.revoked_at is not None:
        return KeyInfo.of(key, tenant), False
    repo.revoke_key(key, utcnow())
    return KeyInfo.of(key, tenant), True


def tenant_name(session: Session, tenant: TenantRef) -> str:
    """The authenticated tenant's name (the unit of work has checked the key)."""
    return tenant.name
