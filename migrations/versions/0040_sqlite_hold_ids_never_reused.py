"""SQLite never gives a deleted hold's id to another hold.

A SQLite table whose key is a plain INTEGER PRIMARY KEY gives the next row
the largest id in the table plus one: when the newest hold is deleted (a
pooled hold swept once it expired, a request's own hold released), the next
hold placed, perhaps another customer's, got its id. A replica still using
the old id (a pool it had not yet found gone, a request whose hold the
sweeper took) then captured from, renewed or released the other customer's
hold. With AUTOINCREMENT, SQLite keeps the largest id ever given and never
gives one twice. PostgreSQL's identity sequence never did. The table is
rebuilt, rows, constraints and index kept; ids given and deleted before
this migration, above the largest left, may be given once more, which only
a process started before it could still hold.

Revision ID: 0040
Revises: 0039
Create Date: 2026-12-05
"""
from alembic import op

revision = "0040"
down_revision = "0039"
branch_labels = None
depends_on = None


def upgrade() -> None:
    _rebuild_holds(autoincrement=True)


def downgrade() -> None:
    _rebuild_holds(autoincrement=False)


def _rebuild_holds(*, autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("holds", recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}):
        pass
