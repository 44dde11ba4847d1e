"""The console's people: members of accounts with a role, sign-in requests
(each emailed link kept only as its SHA-256) and server-side sessions.

A management token may now be a `viewer` (a customer account, read-only).
Every account created with an email before this revision gets that address
as its first member (customer_admin for a customer, owner for an owner), as
`accounts create --email` does from now on.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
EMAIL_CHARS_MAX, ROLE_CHARS_MAX, IP_CHARS_MAX, SHA256_BYTES = 320, 16, 45, 32


ROLES_BEFORE = "role IN ('customer', 'accountant', 'owner', 'admin')"
ROLES_NOW = "role IN ('customer', 'viewer', 'accountant', 'owner', 'admin')"
MEMBER_ROLES = "role IN ('customer_admin', 'customer_viewer', 'accountant', 'owner', 'platform_admin')"


def _token_roles(check: str) -> None:
    with op.batch_alter_table("management_tokens") as batch:
        batch.drop_constraint("ck_management_tokens_role", type_="check")
        batch.create_check_constraint("ck_management_tokens_role", check)


def upgrade() -> None:
    _token_roles(ROLES_NOW)  # a viewer: a customer account, read-only (what a customer_viewer member does)
    op.create_table(
        "members",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("email", sa.String(EMAIL_CHARS_MAX), nullable=False),
        sa.Column("role", sa.String(ROLE_CHARS_MAX), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.UniqueConstraint("account_id", "email", name="uq_members_account_email"),
        sa.CheckConstraint(MEMBER_ROLES, name="ck_members_role"),
    )
    op.create_index("ix_members_email", "members", ["email"])
    op.create_table(
        "sign_in_requests",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("email", sa.String(EMAIL_CHARS_MAX), nullable=False),
        sa.Column("ip_address", sa.String(IP_CHARS_MAX), nullable=False),
        sa.Column("link_sha256", sa.LargeBinary(SHA256_BYTES), unique=True),
        sa.Column("requested_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        sa.Column("used_at", UTCDateTime),
    )
    op.create_index("ix_sign_in_requests_email_time", "sign_in_requests", ["email", "requested_at"])
    op.create_index("ix_sign_in_requests_ip_time", "sign_in_requests", ["ip_address", "requested_at"])
    op.create_table(
        "console_sessions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("session_sha256", sa.LargeBinary(SHA256_BYTES), nullable=False, unique=True),
        sa.Column("email", sa.String(EMAIL_CHARS_MAX), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("last_seen_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
    )
    op.create_index("ix_console_sessions_email", "console_sessions", ["email"])
    op.execute("INSERT INTO members (account_id, email, role, created_at) "
               "SELECT id, lower(email), CASE kind WHEN 'customer' THEN 'customer_admin' ELSE 'owner' END, created_at "
               "FROM accounts WHERE email IS NOT NULL AND kind IN ('customer', 'owner')")


def downgrade() -> None:
    op.drop_table("console_sessions")
    op.drop_table("sign_in_requests")
    op.drop_table("members")
    op.execute("DELETE FROM management_tokens WHERE role = 'viewer'")
    _token_roles(ROLES_BEFORE)
