"""Upgrading to limits reserved in the ledger: each limited key starts from
what the log says it has been charged, not from a lagging read model."""
from __future__ import annotations

import orjson
from alembic import command
from sqlalchemy import text

from app.migrate import alembic_config, migrate
from ledger import spend_limits
from ledger.db import make_engine


def _settlement_row(seq: int, key_id: int, charge: int) -> dict:
    payload = {"charge_nano_usd": charge, "meta": {"api_key_id": key_id, "model": "m"}}
    return {"seq": seq, "payload": orjson.dumps(payload).decode(), "key": f"settle:r{seq}"}


def test_upgrading_starts_each_limit_from_the_keys_settled_charges(empty_database_url):
    engine = make_engine(empty_database_url)
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0009")  # a deployment from before the limits moved into the ledger
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO accounts (id, kind, name, created_at) VALUES (900, 'customer', 'c', CURRENT_TIMESTAMP)")
        for key_id, limit in ((31, 5_000), (32, None), (33, 7_000)):
            conn.execute(text("INSERT INTO api_keys (id, account_id, key_sha256, key_prefix, spend_limit_nano_usd, created_at) "
                              "VALUES (:id, 900, :sha, 'sk-par-x', :limit, CURRENT_TIMESTAMP)"),
                         {"id": key_id, "sha": bytes([key_id]) * 32, "limit": limit})
        # The log is append-only and hash-chained; these rows only need to be read by the upgrade.
        for row in (_settlement_row(1, 31, 1_200), _settlement_row(2, 31, 300), _settlement_row(3, 32, 999)):
            conn.execute(text("INSERT INTO ledger_events (seq, event_type, payload, idempotency_key, content_digest, "
                              "recorded_at, prev_hash, hash) VALUES (:seq, 'RequestSettled', :payload, :key, :b, "
                              "CURRENT_TIMESTAMP, :b, :b)"), {**row, "b": b"\0" * 32})
    migrate(engine)
    with engine.connect() as conn:
        limits = spend_limits.read_limits(conn, [31, 32, 33])
    engine.dispose()
    assert limits == {
        31: {"limit_nano_usd": 5_000, "spent_nano_usd": 1_500, "held_nano_usd": 0, "available_nano_usd": 3_500},
        33: {"limit_nano_usd": 7_000, "spent_nano_usd": 0, "held_nano_usd": 0, "available_nano_usd": 7_000},
    }, "a key without a limit gets none"
