"""models: objects, each file's size and sha256 as the artifact store holds it (null for rows before)

Not batch mode: SQLite adds and drops this column in place.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 15:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.add_column("models", sa.Column("objects", JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("models", "objects")
