"""uploads: resumable uploads of datasets and models in parts

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 15:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db.base

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("filename", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("expires_at", app.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.Column("result_id", sa.String(length=40), nullable=True),
        sa.Column("created_at", app.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_uploads_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_uploads")),
    )
    with op.batch_alter_table("uploads", schema=None) as batch_op:
        batch_op.create_index("ix_uploads_tenant_id_id", ["tenant_id", "id"], unique=False)
        batch_op.create_index("ix_uploads_status_expires_at", ["status", "expires_at"], unique=False)
    op.create_table(
        "upload_parts",
        sa.Column("upload_id", sa.String(length=40), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=500), nullable=False),
        sa.ForeignKeyConstraint(
            ["upload_id"], ["uploads.id"], name=op.f("fk_upload_parts_upload_id_uploads"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("upload_id", "number", name=op.f("pk_upload_parts")),
    )


def downgrade() -> None:
    op.drop_table("upload_parts")
    with op.batch_alter_table("uploads", schema=None) as batch_op:
        batch_op.drop_index("ix_uploads_status_expires_at")
        batch_op.drop_index("ix_uploads_tenant_id_id")
    op.drop_table("uploads")
