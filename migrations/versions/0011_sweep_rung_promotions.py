"""sweep_rungs.promoted_at: when ASHA promoted a trial that waited at the rung (the promote form)

A nullable column, added and dropped in place (no SQLite batch copy).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 16:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db.base

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("sweep_rungs", sa.Column("promoted_at", app.db.base.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("sweep_rungs", "promoted_at")
