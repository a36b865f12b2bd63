"""Engines and sessions for the one database URL of the settings (Postgres or embedded SQLite)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


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


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


@contextmanager
def transaction(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error (for tasks and the CLI)."""
    with session_factory(url)() as session, session.begin():
        yield session
