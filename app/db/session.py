"""Engines and sessions for the one database URL of the settings (Postgres or embedded SQLite)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings

log = logging.getLogger("muonforge.db")


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # No pre-ping (it costs a round trip per request); connections are recycled every half hour.
    # 50 > the 40 threads of the API's thread pool, each holding at most one connection at a time.
    return create_engine(url, pool_size=20, max_overflow=30, pool_recycle=1800)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL lets the API read while a worker writes; foreign keys are off by default in SQLite.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    return make_engine(url)


@lru_cache(maxsize=8)
def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


def open_session(settings: Settings) -> Session:
    """A session on the settings' database."""
    return session_factory(settings.sqlalchemy_url)()


@contextmanager
def transaction(settings: Settings) -> Iterator[Session]:
    """``open_session`` that commits on success and rolls back on error (for tasks and the CLI)."""
    with open_session(settings) as session, session.begin():
        yield session


def on_commit(session: Session, action: Callable[[], None]) -> None:
    """Run ``action`` once the session's transaction has committed (not at all on rollback)."""
    session.info.setdefault("on_commit", []).append(action)


@event.listens_for(Session, "after_commit")
def _run_on_commit(session: Session) -> None:
    for action in session.info.pop("on_commit", []):
        try:
            action()
        except Exception:  # committed is committed: the caller must not see this as a failure
            log.exception("an after-commit action failed")


@event.listens_for(Session, "after_rollback")
def _forget_on_commit(session: Session) -> None:
    session.info.pop("on_commit", None)
