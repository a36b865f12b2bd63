"""Request dependencies, declared once as Annotated aliases.

A request's database work runs as one unit in one worker thread: authenticate, call the
service, commit once (then the actions registered with on_commit run). Holding a pooled
connection across several thread hops (one per sync dependency) deadlocks under load once every
thread waits for a connection that a request parked between hops is holding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from app.db.session import open_session
from app.services.auth import authenticate

T = TypeVar("T")
bearer = HTTPBearer(auto_error=False, description="An API key from `muonforge keys create`.")


class UnitOfWork:
    """``await work(service_fn, *args)`` runs ``service_fn(session, tenant, *args)`` for the
    request's tenant in one thread and one transaction. It also carries the API process's
    shared parts: the key cache, the admission estimate and the JobWriter."""

    def __init__(self, request: Request, credentials: HTTPAuthorizationCredentials | None) -> None:
        state = request.app.state
        self.settings, self.key_cache, self.admission = state.settings, state.key_cache, state.admission
        self.writer = state.writer
        self._authorization = f"{credentials.scheme} {credentials.credentials}" if credentials else None

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        return await run_in_threadpool(self._run, fn, args)

    def _run(self, fn: Callable[..., T], args: tuple) -> T:
        with open_session(self.settings) as session:
            tenant = authenticate(session, self._authorization, self.key_cache)
            result = fn(session, tenant, *args)
            session.commit()
        return result


def unit_of_work(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> UnitOfWork:
    return UnitOfWork(request, credentials)


Work = Annotated[UnitOfWork, Depends(unit_of_work)]
