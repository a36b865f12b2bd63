"""Tenants as operators see them: what each holds, and its job cap.

A tenant's ``job_cap`` is the number of queued plus running jobs it may have: NULL takes the
server's ``MUONFORGE_TENANT_JOB_CAP``, 0 suspends it (a submission answers 403
``tenant_suspended``; its jobs already queued or running go on). API processes read the cap
with the tenant of a verified key, which they keep for ``auth_cache_seconds``
(app.services.auth), so a change reaches them within that time; nothing tells them sooner.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.errors import NotFound, ValidationFailed
from app.repositories.tenants import TenantFigures, TenantRepository

DEFAULT = "default"  # the word that sets the cap back to the server's


def job_cap(tenant_cap: int | None, server_cap: int) -> int:
    """The cap that applies: the tenant's own, else the server's."""
    return server_cap if tenant_cap is None else tenant_cap


def parse_job_cap(text: str) -> int | None:
    """A job cap as an operator writes it: an integer >= 0, or ``default`` (None: the server's)."""
    text = text.strip()
    if text.lower() == DEFAULT:
        return None
    try:
        cap = int(text)
    except ValueError:
        raise ValidationFailed(f"the job cap is a whole number >= 0 or {DEFAULT!r}, not {text!r}", "N") from None
    if cap < 0:
        raise ValidationFailed(f"the job cap is a whole number >= 0 or {DEFAULT!r}, not {cap}", "N")
    return cap


def list_tenants(session: Session) -> list[TenantFigures]:
    """Every tenant by name: queued plus running jobs, bytes stored (datasets and models), unrevoked keys."""
    return TenantRepository(session).figures()


def set_job_cap(session: Session, name: str, cap: int | None) -> tuple[TenantFigures, int | None]:
    """Set the job cap of the tenant named ``name`` (None: the server's).

    Returns the tenant as it now is and its previous cap.
    """
    repo = TenantRepository(session)
    tenant = repo.by_name(name)
    if tenant is None:
        raise NotFound(f"no tenant {name!r}", param="tenant")
    previous = tenant.job_cap
    repo.set_job_cap(tenant.id, cap)
    return repo.figures(tenant.id)[0], previous
