"""datasets: columns, a parquet dataset's column names as its upload read them

Not batch mode: SQLite adds and drops this column in place.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 12:45:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.add_column("datasets", sa.Column("columns", JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("datasets", "columns")
