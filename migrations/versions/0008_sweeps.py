"""sweeps: sweeps, their trials and ASHA rung decisions; jobs.sweep_id

Not batch mode on jobs: on SQLite it would copy the table and drop its triggers (0005); SQLite
adds and drops the column in place. No foreign key from jobs for the same reason.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 19:45:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import app.db.base

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("request", JSON, nullable=False),
        sa.Column("metric", sa.String(length=64), nullable=False),
        sa.Column("mode", sa.String(length=8), nullable=False),
        sa.Column("max_concurrent", sa.Integer(), nullable=False),
        sa.Column("asha", JSON, nullable=True),
        sa.Column("finished_at", app.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_at", app.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sweeps_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    op.create_index("ix_sweeps_tenant_id_id", "sweeps", ["tenant_id", "id"], unique=False)
    op.create_index("ix_sweeps_status", "sweeps", ["status"], unique=False)
    op.create_table(
        "sweep_trials",
        sa.Column("sweep_id", sa.String(length=40), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("params", JSON, nullable=False),
        sa.Column("spec", JSON, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=True),
        sa.Column("error", JSON, nullable=True),
        sa.ForeignKeyConstraint(
            ["sweep_id"], ["sweeps.id"], name=op.f("fk_sweep_trials_sweep_id_sweeps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("sweep_id", "number", name=op.f("pk_sweep_trials")),
        sa.UniqueConstraint("job_id", name=op.f("uq_sweep_trials_job_id")),
    )
    op.create_table(
        "sweep_rungs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("sweep_id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("rung", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("go_on", sa.Boolean(), nullable=False),
        sa.Column("created_at", app.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sweep_id"], ["sweeps.id"], name=op.f("fk_sweep_rungs_sweep_id_sweeps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep_rungs")),
        sa.UniqueConstraint("job_id", "rung", name="uq_sweep_rungs_job_id_rung"),
        sa.UniqueConstraint("sweep_id", "rung", "position", name="uq_sweep_rungs_sweep_id_rung_position"),
    )
    op.add_column("jobs", sa.Column("sweep_id", sa.String(length=40), nullable=True))
    op.create_index("ix_jobs_sweep_id", "jobs", ["sweep_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_sweep_id", table_name="jobs")
    op.drop_column("jobs", "sweep_id")
    op.drop_table("sweep_rungs")
    op.drop_table("sweep_trials")
    op.drop_index("ix_sweeps_status", table_name="sweeps")
    op.drop_index("ix_sweeps_tenant_id_id", table_name="sweeps")
    op.drop_table("sweeps")
