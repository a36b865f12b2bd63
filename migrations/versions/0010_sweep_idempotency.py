"""sweeps.idempotency_key and sweeps.request_hash: a repeated POST /v1/sweeps with the same
Idempotency-Key answers with the sweep it created

Two nullable columns and a unique index (no constraint: the index needs no SQLite batch copy of
the table, and NULL keys, the sweeps submitted without one, never collide).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23 23:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("sweeps", sa.Column("idempotency_key", sa.String(length=200), nullable=True))
    op.add_column("sweeps", sa.Column("request_hash", sa.String(length=64), nullable=True))
    op.create_index("uq_sweeps_tenant_id_idempotency_key", "sweeps", ["tenant_id", "idempotency_key"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_sweeps_tenant_id_idempotency_key", table_name="sweeps")
    op.drop_column("sweeps", "request_hash")
    op.drop_column("sweeps", "idempotency_key")
