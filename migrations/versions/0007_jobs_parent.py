"""jobs: parent_job_id and parent_step, the checkpoint a warm-started job (init_from) started from

Not batch mode: on SQLite it would copy jobs and drop its triggers (0005); SQLite adds and drops
these columns in place. No foreign key for the same reason.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 17:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("parent_job_id", sa.String(length=40), nullable=True))
    op.add_column("jobs", sa.Column("parent_step", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_parent_job_id", "jobs", ["parent_job_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_parent_job_id", table_name="jobs")
    op.drop_column("jobs", "parent_step")
    op.drop_column("jobs", "parent_job_id")
