"""How statements name an account's API keys and workers: those live in the
proxy's tables, which `invoices` does not import."""
from __future__ import annotations

from sqlalchemy import Connection

from invoices.statements import Labels
from proxy import keys as api_keys
from proxy import workers as registry


def statement_labels(conn: Connection, account_id: int) -> Labels:
    keys = {k["id"]: k["name"] or k["prefix"] for k in api_keys.list_keys(conn, account_id)}
    workers = {w.id: f"{w.id} · {w.url}" for w in registry.list_workers(conn, owner_account_id=account_id)}
    return Labels(keys, workers)
