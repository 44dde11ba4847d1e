"""The hold function plans its statements for each call's own arrays.

PL/pgSQL caches each statement's plan for the life of a connection, and after
five calls it may keep a generic plan: one made without the call's arrays and
on the table sizes of that moment. A holder connection that started while the
holds table was nearly empty kept a sequential scan of it for the key lookup
(`idempotency_key = ANY(p_key)`), every row compared with every key of the
batch, until the next ANALYZE of the table replaced the plan. Measured on one
connection placing batches of 50 to 2,000 holds that were not settled: 50 µs
per hold at first, over 500 µs once 25,000 holds were open; with a plan per
call, 25 to 60 µs throughout. Planning the function's few statements per
call costs far less than one such scan; holds are placed a batch per call.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-01
"""
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

PLACE_HOLDS = "paralon_place_holds(bigint[], bigint[], bigint[], text[], int[], bigint[], text[], timestamptz)"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER FUNCTION {PLACE_HOLDS} SET plan_cache_mode = force_custom_plan")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER FUNCTION {PLACE_HOLDS} RESET plan_cache_mode")
