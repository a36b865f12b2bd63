"""What the repositories' statements share."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult, Delete, Update
from sqlalchemy.orm import Session


def changed_rows(session: Session, statement: Update | Delete) -> int:
    """How many rows an UPDATE or DELETE without RETURNING matched."""
    # Session.execute is annotated to return a Result whatever the statement; for these it returns
    # a CursorResult, whose rowcount is SQLAlchemy's documented way to read the count.
    return cast("CursorResult[Any]", session.execute(statement)).rowcount
