"""checkpoints: sha256, the digest of the object the row records (null for rows written before)

Not batch mode: SQLite adds and drops this column in place.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 14:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("checkpoints", "sha256")
