"""Request dependencies, declared once as Annotated aliases.

A request's database work runs as one unit in one worker thread: authenticate, call the
service, commit once, then the after-commit actions. Holding a pooled connection across several
thread hops (one per sync dependency) deadlocks under load once every thread waits for a
connection that a request parked between hops is holding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from app.db.session import session_factory
from app.services.auth import authenticate
from app.settings import Settings

log = logging.getLogger("muonforge.api")
T = TypeVar("T")
bearer = HTTPBearer(auto_error=False, description="An API key from `muonforge keys create`.")


class UnitOfWork:
    """``await work(service_fn, *args)`` runs ``service_fn(session, tenant, *args)`` for the
    request's tenant in one thread and one transaction."""

    def __init__(self, settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> None:
        self.settings = settings
        self._authorization = f"{credentials.scheme} {credentials.credentials}" if credentials else None

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        return await run_in_threadpool(self._run, fn, args)

    def _run(self, fn: Callable[..., T], args: tuple) -> T:
        with session_factory(self.settings.sqlalchemy_url)() as session:
            tenant = authenticate(session, self._authorization)
            result = fn(session, tenant, *args)
            session.commit()
            actions = session.info.pop("after_commit", [])
        for action in actions:
            try:
                action()
            except Exception:  # the job is stored as queued; the reaper re-sends its task later
                log.exception("after-commit action failed")
        return result


def unit_of_work(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> UnitOfWork:
    return UnitOfWork(request.app.state.settings, credentials)


Work = Annotated[UnitOfWork, Depends(unit_of_work)]
