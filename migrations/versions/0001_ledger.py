"""The ledger: accounts, append-only events and postings, holds, consumer positions.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

from datetime import UTC, datetime

from ledger.schema import BigId, KeyText, UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

APPEND_ONLY_TABLES = ("ledger_events", "ledger_postings")
GENESIS_HASH = bytes(32)
# The platform's own account and the counter-accounts operators' entries post against.
SYSTEM_ACCOUNTS = (
    ("platform:revenue", "platform", "Platform revenue"),
    ("external:grants", "external", "Credits granted by operators"),
    ("external:adjustments", "external", "Operator adjustments"),
)


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("email", sa.String(320)),
        sa.Column("system_code", sa.String(64), unique=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.CheckConstraint("kind IN ('customer', 'owner', 'platform', 'external')", name="ck_accounts_kind"),
    )
    op.create_table(
        "account_balances",
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("balance_nano_usd", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("last_event_seq", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("holds_closed_nano_usd", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    )
    op.create_table(
        "ledger_head",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("last_hash", sa.LargeBinary(32), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_ledger_head_single_row"),
    )
    op.create_table(
        "ledger_events",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("event_type", sa.String(64), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("idempotency_key", KeyText, nullable=False, unique=True),
        sa.Column("content_digest", sa.LargeBinary(32), nullable=False),
        sa.Column("reverses_seq", sa.BigInteger),
        sa.Column("recorded_at", UTCDateTime, nullable=False),
        sa.Column("prev_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("hash", sa.LargeBinary(32), nullable=False),
    )
    reversal = sa.text("reverses_seq IS NOT NULL")
    op.create_index("ux_ledger_events_reverses_seq", "ledger_events", ["reverses_seq"], unique=True,
                    postgresql_where=reversal, sqlite_where=reversal)
    op.create_table(
        "ledger_postings",
        sa.Column("event_seq", sa.BigInteger, primary_key=True),
        sa.Column("leg", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("account_id", sa.BigInteger, nullable=False),
        sa.Column("amount_nano_usd", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "holds",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.BigInteger, nullable=False),
        sa.Column("amount_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("idempotency_key", KeyText, nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        sa.CheckConstraint("amount_nano_usd > 0", name="ck_holds_amount_positive"),
    )
    op.create_index("ix_holds_expiry", "holds", ["expires_at"])
    op.create_table(
        "customer_holds",
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("holds_placed_nano_usd", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    )
    op.create_table(
        "consumer_positions",
        sa.Column("consumer", sa.String(100), primary_key=True),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
    )
    _refuse_changes()
    bind = op.get_bind()
    bind.execute(sa.text("INSERT INTO ledger_head (id, last_seq, last_hash) VALUES (1, 0, :genesis)"), {"genesis": GENESIS_HASH})
    accounts = sa.table("accounts", sa.column("id"), sa.column("kind"), sa.column("name"), sa.column("system_code"), sa.column("created_at", UTCDateTime))
    balances = sa.table("account_balances", sa.column("account_id"))
    for code, kind, name in SYSTEM_ACCOUNTS:
        account_id = bind.execute(
            accounts.insert().values(kind=kind, name=name, system_code=code, created_at=datetime.now(UTC)).returning(accounts.c.id)
        ).scalar_one()
        bind.execute(balances.insert().values(account_id=account_id))


def _refuse_changes() -> None:
    """The log is append-only: the database itself refuses edits."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            """
            CREATE FUNCTION paralon_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP
                    USING ERRCODE = 'restrict_violation';
            END $$
            """
        )
        for table in APPEND_ONLY_TABLES:
            op.execute(f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} FOR EACH ROW EXECUTE FUNCTION paralon_refuse_change()")
            op.execute(f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} FOR EACH STATEMENT EXECUTE FUNCTION paralon_refuse_change()")
        return
    for table in APPEND_ONLY_TABLES:
        for operation in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {table}_no_{operation.lower()} BEFORE {operation} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: {operation} refused'); END"
            )


def downgrade() -> None:
    raise RuntimeError("the ledger is append-only: its schema is never downgraded")
