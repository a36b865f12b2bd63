"""Declarative base: stable constraint names, time-ordered string ids, UTC timestamps."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import ClassVar

from sqlalchemy import JSON, DateTime, MetaData, String, Table, TypeDecorator
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Alembic sees the same names on every database (STYLE.md convention 3).
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


def new_id(prefix: str) -> str:
    """``prefix_`` + 26 base-32 characters: 48 bits of milliseconds then 80 random bits, so ids
    sort by creation time (the list cursor) and are unguessable."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        value, r = divmod(value, 32)
        chars.append(_CROCKFORD[r])
    return f"{prefix}_{''.join(reversed(chars))}"


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    # Every model maps a Table (DeclarativeBase says FromClause, which also allows a mapped SELECT).
    __table__: ClassVar[Table]


class Timestamped:
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


IdColumn = String(40)
JSONDoc = JSON().with_variant(JSONB(), "postgresql")
