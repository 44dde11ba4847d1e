"""What a worker serves: chat and completions, or embeddings.

A worker registered before this revision serves chat. Requests of one kind are
never routed to workers of the other (proxy/workers.py, `for_task`).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

TASK_CHECK = "task IN ('chat', 'embedding')"


def upgrade() -> None:
    # A column constraint, added in place on SQLite too (no copy of the table).
    op.add_column("workers", sa.Column("task", sa.String(16), sa.CheckConstraint(TASK_CHECK, name="ck_workers_task"),
                                       nullable=False, server_default=sa.text("'chat'")))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_constraint("ck_workers_task", type_="check")
        batch.drop_column("task")
