"""job_nodes: the node slots of a job that trains on several workers (resources.nnodes)

A new table: the jobs table is left alone (no SQLite batch copy, so migration 0005's triggers
on it stay).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 21:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db.base

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_nodes",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("node", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", app.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.Column("rendezvous", sa.String(length=300), nullable=True),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("report", sa.String(length=300), nullable=True),
        sa.Column("token", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_nodes_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "node", name=op.f("pk_job_nodes")),
    )


def downgrade() -> None:
    op.drop_table("job_nodes")
