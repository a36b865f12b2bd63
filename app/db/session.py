"""Engines and sessions for the one database URL of the settings (Postgres or embedded SQLite)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, TypeVar

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker

from app.settings import Settings

T = TypeVar("T")
log = logging.getLogger("muonforge.db")


def make_engine(url: str, pool_size: int = 5, max_overflow: int = 10) -> Engine:
    """An engine on ``url``; for Postgres, with a pool of connections.

    The pool keeps ``pool_size`` connections open plus up to ``max_overflow`` opened under load (the
    defaults are SQLAlchemy's, for one-off uses such as a migration; a process's sessions use
    MUONFORGE_DB_POOL_SIZE and MUONFORGE_DB_MAX_OVERFLOW).
    """
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # Pre-ping: a connection is tested as it leaves the pool (one short round trip), so that after
    # a database restart no request or job meets a dead connection. Recycled every half hour.
    # The settings' defaults, 20 + 30 = 50, exceed the 40 threads of the API's thread pool, each
    # holding at most one connection at a time: no request waits for one. A smaller pool is safe
    # too (a request holds its connection only while its unit of work runs; none waits for another
    # while holding one): requests then queue for a connection (docs/deploy.md sizes it).
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_recycle=1800,
        pool_pre_ping=True,
        json_serializer=json_dumps,
        json_deserializer=orjson.loads,
    )


def json_dumps(value: Any) -> bytes:
    """JSON for Postgres' json and jsonb columns: orjson, several times the standard library's speed
    (a job's spec and its events are JSON). NaN and infinities are written as null."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL lets the API read while a worker writes; foreign keys are off by default in SQLite.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


@lru_cache(maxsize=8)
def engine_for(url: str, pool_size: int, max_overflow: int) -> Engine:
    return make_engine(url, pool_size, max_overflow)


@lru_cache(maxsize=8)
def session_factory(url: str, pool_size: int, max_overflow: int) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url, pool_size, max_overflow), expire_on_commit=False)


def open_session(settings: Settings) -> Session:
    """A session on the settings' database."""
    return session_factory(settings.sqlalchemy_url, settings.db_pool_size, settings.db_max_overflow)()


@contextmanager
def transaction(settings: Settings) -> Iterator[Session]:
    """``open_session`` that commits on success and rolls back on error (for tasks and the CLI)."""
    with open_session(settings) as session, session.begin():
        yield session


def on_commit(session: Session, action: Callable[[], None]) -> None:
    """Run ``action`` once the session's transaction has committed (not at all on rollback)."""
    session.info.setdefault("on_commit", []).append(action)


def on_rollback(session: Session, action: Callable[[], None]) -> None:
    """Run ``action`` once the session's transaction has ended without committing.

    That is rolled back, failed to commit, or closed before its commit (not at all once committed).
    What it undoes outside the database (a file written for a row) is then undone whatever stopped
    the commit.
    """
    session.info.setdefault("on_rollback", []).append(action)


@event.listens_for(Session, "after_commit")
def _run_on_commit(session: Session) -> None:
    session.info.pop("on_rollback", None)
    for action in session.info.pop("on_commit", []):
        try:
            action()
        except Exception:  # committed is committed: the caller must not see this as a failure
            log.exception("an after-commit action failed")


@event.listens_for(Session, "after_rollback")
def _forget_on_commit(session: Session) -> None:
    session.info.pop("on_commit", None)


@event.listens_for(Session, "after_transaction_end")
def _run_on_rollback(session: Session, transaction: SessionTransaction) -> None:
    # Every end of the outermost transaction comes here, a commit's too (after after_commit, which
    # has dropped the actions by then); a close without a rollback fires nothing else.
    if transaction.parent is not None:
        return
    for action in session.info.pop("on_rollback", []):
        try:
            action()
        except Exception:  # the transaction's own error, if any, is what the caller must see
            log.exception("an after-rollback action failed")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is the database being unreachable (a restart, an outage, a dropped
    connection) rather than a fault of the statement: worth trying again later."""
    if isinstance(exc, OperationalError | TimeoutError | ConnectionError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def retrying(fn: Callable[[], T], what: str, patience: float, first: float = 0.2, most: float = 5.0) -> T:
    """``fn()``, tried again while it fails for a transient reason (``is_transient``), with
    exponential backoff and full jitter, for up to ``patience`` seconds; then the last error."""
    deadline, delay = time.monotonic() + patience, first
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning("%s failed (%s: %s); trying again", what, type(exc).__name__, str(exc).splitlines()[0])
        time.sleep(random.uniform(0, delay))
        delay = min(2 * delay, most)
