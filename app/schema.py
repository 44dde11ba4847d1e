"""Tables of the edge: management tokens (who may do what through the API)."""
from __future__ import annotations

from sqlalchemy import BigInteger, Column, ForeignKey, LargeBinary, String, Table

from ledger.schema import BigId, UTCDateTime, metadata

# Like API keys: shown once, kept as SHA-256 of 256 random bits.
management_tokens = Table(
    "management_tokens",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("role", String(16), nullable=False),
    Column("token_sha256", LargeBinary(32), nullable=False, unique=True),
    Column("token_prefix", String(16), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime),
)
