"""jobs: routing, the parameter routing table of the model a job's latest attempt built

Not batch mode: on SQLite it would copy jobs and drop its triggers (0005); SQLite adds and drops
this column in place.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 11:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("routing", JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "routing")
