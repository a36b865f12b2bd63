"""Request dependencies, declared once as Annotated aliases."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from app.db.models import Tenant
from app.db.session import session_factory
from app.services.auth import authenticate
from app.settings import Settings

log = logging.getLogger("muonforge.api")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    """One session per request, committed once at the end; then the after-commit actions run."""
    with session_factory(settings.sqlalchemy_url)() as session:
        yield session
        session.commit()
        for action in session.info.pop("after_commit", []):
            try:
                action()
            except Exception:  # the job is stored as queued; the reaper re-sends its task later
                log.exception("after-commit action failed")


SessionDep = Annotated[Session, Depends(get_session)]


def current_tenant(session: SessionDep, authorization: Annotated[str | None, Header()] = None) -> Tenant:
    return authenticate(session, authorization)


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]
