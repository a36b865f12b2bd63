"""Request dependencies, declared once as Annotated aliases.

A request's database work runs as one unit in one worker thread: authenticate, call the
service, commit once (then the actions registered with on_commit run). Holding a pooled
connection across several thread hops (one per sync dependency) deadlocks under load once every
thread waits for a connection that a request parked between hops is holding.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Concatenate, ParamSpec, TypeVar

from fastapi import Cookie, Depends, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.db.session import open_session
from app.errors import Unauthorized
from app.messaging.live_bus import LiveBus, live_bus
from app.services.auth import TenantRef, authenticate, cached_tenant
from app.services.intake import Intake

T = TypeVar("T")
P = ParamSpec("P")
bearer = HTTPBearer(auto_error=False, description="An API key from `muonforge keys create`.")
# The web app's sign-in keeps the key in this cookie: HttpOnly (page scripts never see it) and
# SameSite=Strict (no other site's page can make the browser send it), for the browser session.
SESSION_COOKIE = "muonforge_key"


class UnitOfWork:
    """A request's unit of work: one service call for its tenant, in one thread and one transaction.

    ``await work(service_fn, *args)`` runs ``service_fn(session, tenant, *args)``; after the commit
    the actions registered with on_commit run, e.g. publishing job events to ``bus``.
    """

    def __init__(self, request: Request, authorization: str | None, tenant: TenantRef | None = None) -> None:
        self.request, self.settings, self.key_cache = request, request.app.state.settings, request.app.state.key_cache
        self.bus: LiveBus = live_bus(self.settings)
        self._authorization = authorization
        self._tenant = tenant  # admitted already (app.api.limits, for requests with a body)

    def with_key(self, key: str) -> UnitOfWork:
        """The same unit of work for the tenant of ``key`` (a sign-in's key, not the request's)."""
        return UnitOfWork(self.request, f"Bearer {key}")

    def cached_tenant(self) -> TenantRef | None:
        """The request's tenant if already known (authenticated before, or its key cached)."""
        return self._tenant or cached_tenant(self._authorization, self.key_cache)

    def _admit(self, tenant: TenantRef) -> TenantRef:
        """The request's tenant, its request counted once against the tenant's rate."""
        if self._tenant is None:
            self.request.app.state.request_rate.take(tenant.id)
            self._tenant = tenant
        return self._tenant

    async def __call__(
        self, fn: Callable[Concatenate[Session, TenantRef, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        # A key verified within the cache's time is admitted here, on the event loop: a tenant
        # over its rate costs no thread and no query (429s stay cheap under a flood).
        if self._tenant is None and (tenant := self.cached_tenant()) is not None:
            self._admit(tenant)
        return await self.in_thread(self._run, lambda session, tenant: fn(session, tenant, *args, **kwargs))

    def in_thread(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """``fn(*args)`` in the thread pool, within the share of its threads the request's tenant
        may use (app.services.quotas.TenantThreads; not counted while the tenant is unknown)."""
        tenant_id = self._tenant.id if self._tenant is not None else None
        return self.request.app.state.tenant_threads.run(tenant_id, fn, *args)

    def _run(self, fn: Callable[[Session, TenantRef], T]) -> T:
        with open_session(self.settings) as session:
            tenant = self._tenant or self._admit(authenticate(session, self._authorization, self.key_cache))
            # A key looked up in the database (a cache miss) may have had its last use written:
            # commit that now, so that no row lock or SQLite write lock lasts as long as the work.
            # Nothing was sent on a cache hit, and then this commit sends nothing either.
            session.commit()
            result = fn(session, tenant)
            session.commit()
        return result

    async def key_still_valid(self) -> bool:
        """Whether the request's key is still known and not revoked, asked of the database (not
        the cache): what an open events stream checks every ``auth_cache_seconds``."""
        return await self.in_thread(self._verify)

    def _verify(self) -> bool:
        with open_session(self.settings) as session:
            try:
                authenticate(session, self._authorization)
            except Unauthorized:
                return False
            session.commit()  # its last use, when due
        return True


def request_key(authorization: str | None, session_key: str | None) -> str | None:
    """The request's key as an Authorization value: the header, else the web app's cookie."""
    return authorization or (f"Bearer {session_key}" if session_key else None)


def unit_of_work(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    session_key: Annotated[str | None, Cookie(alias=SESSION_COOKIE, include_in_schema=False)] = None,
) -> UnitOfWork:
    """The request's key: the Authorization header, else the web app's session cookie."""
    header = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    return UnitOfWork(request, request_key(header, session_key), getattr(request.state, "tenant", None))


def intake(request: Request) -> Intake:
    return request.app.state.intake


Work = Annotated[UnitOfWork, Depends(unit_of_work)]

# Ids as the service hands them out (``prefix_`` + base-32): anything else is a 422 naming the
# parameter, before a database sees it (Postgres refuses a NUL character in a string, for one).
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
JobId = Annotated[str, Path(pattern=ID_PATTERN, description="A job's id (`job_…`).")]
DatasetId = Annotated[str, Path(pattern=ID_PATTERN, description="A dataset's id (`ds_…`).")]
SweepId = Annotated[str, Path(pattern=ID_PATTERN, description="A sweep's id (`swp_…`).")]
WebhookId = Annotated[str, Path(pattern=ID_PATTERN, description="A webhook endpoint's id (`wh_…`).")]
After = Annotated[str | None, Query(pattern=ID_PATTERN, description="The previous page's `next_after`.")]
JobIntake = Annotated[Intake, Depends(intake)]
