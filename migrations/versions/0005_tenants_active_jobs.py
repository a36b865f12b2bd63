"""tenants: active_jobs, the tenant's queued, running and cancelling jobs, kept by triggers on jobs

The job cap reads this one row where it counted the tenant's active jobs (O(active jobs) per
check). Triggers keep it exact whatever code changes a job: +1 where a job enters the active
statuses (an INSERT, an UPDATE of its status), -1 where it leaves them (an UPDATE, a DELETE, a
tenant's cascade). An UPDATE that keeps a job active (a claim, a cancel request) or inactive
touches no tenant row. Postgres runs one plpgsql function from three triggers, SQLite the same
statements in three triggers of its own.

The active statuses are spelled here, as this revision knows them (a migration never imports
code that may change): tests/service/test_active_jobs.py checks them against
contract.status.ACTIVE. SQLite drops a table's triggers with the table: a later migration whose
batch mode recreates ``jobs`` must create them again.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 16:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = "'queued', 'running', 'cancelling'"
LEAVE = f"UPDATE tenants SET active_jobs = active_jobs - 1 WHERE id = OLD.tenant_id AND OLD.status IN ({ACTIVE})"
ENTER = f"UPDATE tenants SET active_jobs = active_jobs + 1 WHERE id = NEW.tenant_id AND NEW.status IN ({ACTIVE})"
CHANGED = f"(OLD.status IN ({ACTIVE})) <> (NEW.status IN ({ACTIVE})) OR OLD.tenant_id <> NEW.tenant_id"
TRIGGERS = {  # name: (event, when, the statements SQLite runs)
    "jobs_active_insert": ("INSERT", f"NEW.status IN ({ACTIVE})", [ENTER]),
    "jobs_active_update": ("UPDATE OF status, tenant_id", CHANGED, [LEAVE, ENTER]),
    "jobs_active_delete": ("DELETE", f"OLD.status IN ({ACTIVE})", [LEAVE]),
}
FUNCTION = f"""CREATE FUNCTION jobs_active_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN {LEAVE}; END IF;
    IF TG_OP <> 'DELETE' THEN {ENTER}; END IF;
    RETURN NULL;
END $$"""


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("active_jobs", sa.Integer(), server_default="0", nullable=False))
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        op.execute(FUNCTION)
    for name, (event, when, statements) in TRIGGERS.items():
        action = "EXECUTE FUNCTION jobs_active_count()" if postgres else f"BEGIN {'; '.join(statements)}; END"
        op.execute(f"CREATE TRIGGER {name} AFTER {event} ON jobs FOR EACH ROW WHEN ({when}) {action}")
    # After the triggers, in the same transaction: on Postgres CREATE TRIGGER waits for the
    # transactions writing jobs and holds off new ones until this commits, so no change falls
    # between the count and the triggers.
    op.execute(
        "UPDATE tenants SET active_jobs = "
        f"(SELECT count(*) FROM jobs WHERE jobs.tenant_id = tenants.id AND jobs.status IN ({ACTIVE}))"
    )


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for name in TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON jobs" if postgres else f"DROP TRIGGER {name}")
    if postgres:
        op.execute("DROP FUNCTION jobs_active_count()")
    # Not batch mode: on SQLite it would recreate tenants, and dropping the old table (foreign
    # keys on) would cascade to every row that names a tenant. SQLite drops a column in place.
    op.drop_column("tenants", "active_jobs")
