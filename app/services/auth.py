"""API keys: long random tokens, stored and looked up as SHA-256 hashes.

A key has 256 bits of entropy, so a fast hash is safe here and costs microseconds per request
(a password hash such as bcrypt would cost 50-100 ms on every call).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy.orm import Session

from app.db.models import Tenant
from app.errors import Unauthorized
from app.repositories.tenants import TenantRepository

KEY_PREFIX = "mf_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(session: Session, tenant_name: str) -> str:
    """Create (or reuse) the tenant and a new key for it; returns the key, shown once."""
    repo = TenantRepository(session)
    tenant = repo.get_or_create(tenant_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    repo.add_key(tenant, hash_key(key), key[:10])
    return key


def authenticate(session: Session, authorization: str | None) -> Tenant:
    """The tenant of ``Authorization: Bearer <key>``, or Unauthorized."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("send Authorization: Bearer <API key>")
    digest = hash_key(key.strip())
    found = TenantRepository(session).tenant_for_key_hash(digest)
    # The lookup is by hash; the constant-time compare guards the final equality check.
    if found is None or not hmac.compare_digest(found[1].key_hash, digest):
        raise Unauthorized("unknown or revoked API key")
    return found[0]
