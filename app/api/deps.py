"""Request dependencies, declared once as Annotated aliases.

A request's database work runs as one unit in one worker thread: authenticate, call the
service, commit once (then the actions registered with on_commit run). Holding a pooled
connection across several thread hops (one per sync dependency) deadlocks under load once every
thread waits for a connection that a request parked between hops is holding. The dependencies
themselves do no I/O and are coroutines: FastAPI runs a plain ``def`` dependency in the thread
pool, a hop (and two context switches) per dependency per request.
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
from app.services.auth import KeyCache, TenantRef, authenticate, cached_tenant
from app.services.intake import Intake
from app.settings import Settings

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

    async def __call__(
        self, fn: Callable[Concatenate[Session, TenantRef, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        if self._tenant is None:
            # A key verified within the cache's time is known here, on the event loop (else looked
            # up in a thread of its own), and the request counted against its tenant's rate before
            # its work takes a thread: a tenant over its rate costs no thread and no query.
            tenant = cached_tenant(self._authorization, self.key_cache)
            if tenant is None:
                tenant = await self.in_thread(authenticated, self.settings, self._authorization, self.key_cache)
            await self.request.app.state.tenant_limits.take_request(tenant.id)
            self._tenant = tenant
        tenant = self._tenant
        return await self.in_thread(self._run, tenant, lambda session, tenant: fn(session, tenant, *args, **kwargs))

    def in_thread(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """``fn(*args)`` in the thread pool, within the share of its threads the request's tenant
        may use (app.services.quotas.TenantThreads; not counted while the tenant is unknown)."""
        tenant_id = self._tenant.id if self._tenant is not None else None
        return self.request.app.state.tenant_threads.run(tenant_id, fn, *args)

    def _run(self, tenant: TenantRef, work: Callable[[Session, TenantRef], T]) -> T:
        with open_session(self.settings) as session:
            result = work(session, tenant)
            session.commit()
        return result

    async def key_still_valid(self) -> bool:
        """Whether the request's key is still known and not revoked, asked of the database (not
        the cache): what an open events stream checks every ``auth_cache_seconds``."""
        try:
            await self.in_thread(authenticated, self.settings, self._authorization)
        except Unauthorized:
            return False
        return True


def authenticated(settings: Settings, authorization: str | None, key_cache: KeyCache | None = None) -> TenantRef:
    """The key's tenant, looked up in the database (in a thread); its last use committed when due,
    in a transaction of its own (no row lock lasts as long as the request's work)."""
    with open_session(settings) as session:
        tenant = authenticate(session, authorization, key_cache)
        session.commit()
    return tenant


def request_key(authorization: str | None, session_key: str | None) -> str | None:
    """The request's key as an Authorization value: the header, else the web app's cookie."""
    return authorization or (f"Bearer {session_key}" if session_key else None)


async def unit_of_work(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    session_key: Annotated[str | None, Cookie(alias=SESSION_COOKIE, include_in_schema=False)] = None,
) -> UnitOfWork:
    """The request's key: the Authorization header, else the web app's session cookie."""
    header = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    return UnitOfWork(request, request_key(header, session_key), getattr(request.state, "tenant", None))


async def intake(request: Request) -> Intake:
    return request.app.state.intake


Work = Annotated[UnitOfWork, Depends(unit_of_work)]

# Ids as the service hands them out (``prefix_`` + base-32): anything else is a 422 naming the
# parameter, before a database sees it (Postgres refuses a NUL character in a string, for one).
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
JobId = Annotated[str, Path(pattern=ID_PATTERN, description="A job's id (`job_…`).")]
DatasetId = Annotated[str, Path(pattern=ID_PATTERN, description="A dataset's id (`ds_…`).")]
ModelId = Annotated[str, Path(pattern=ID_PATTERN, description="An uploaded model's id (`mdl_…`).")]
SweepId = Annotated[str, Path(pattern=ID_PATTERN, description="A sweep's id (`swp_…`).")]
WebhookId = Annotated[str, Path(pattern=ID_PATTERN, description="A webhook endpoint's id (`wh_…`).")]
After = Annotated[str | None, Query(pattern=ID_PATTERN, description="The previous page's `next_after`.")]
JobIntake = Annotated[Intake, Depends(intake)]
