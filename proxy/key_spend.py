"""Spend limits per API key.

What a key has spent is a read model of the log (`api_key_spend`, kept by a
consumer with its position in the same transaction). A request is admitted
against limit - spent - what this process holds or has settled since that
position, and its hold is capped at what remains. Across several proxy
replicas the bound is loose by the others' requests in flight: the customer's
own balance, enforced by the ledger, is the hard limit."""
from __future__ import annotations

from collections import defaultdict

import orjson
from sqlalchemy import Connection, Engine, select, update

from ledger import log
from ledger.log import StoredEvent, consumer_position
from proxy.schema import api_key_spend, api_keys

CONSUMER = "proxy.api_key_spend"
PAGES_PER_CATCH_UP_MAX = 50


def apply_settlements(conn: Connection, events: list[StoredEvent]) -> None:
    spent: dict[int, int] = defaultdict(int)
    for event in events:
        if event.event_type == "RequestSettled":
            payload = orjson.loads(event.payload_json)
            key_id = payload["meta"].get("api_key_id")
            if isinstance(key_id, int):
                spent[key_id] += payload["charge_nano_usd"]
    for key_id, amount in sorted(spent.items()):
        updated = conn.execute(
            update(api_key_spend).where(api_key_spend.c.key_id == key_id)
            .values(spent_nano_usd=api_key_spend.c.spent_nano_usd + amount)
        ).rowcount
        if not updated:
            conn.execute(api_key_spend.insert().values(key_id=key_id, spent_nano_usd=amount))


def catch_up(engine: Engine) -> int:
    """Apply what the log has beyond the consumer's position; returns events read."""
    return log.catch_up(engine, CONSUMER, apply_settlements, pages_max=PAGES_PER_CATCH_UP_MAX, with_postings=False)


def load_spent(conn: Connection) -> tuple[int, dict[int, int]]:
    """(consumer position, spent by key) for the keys that have a limit. The
    position is read first: a page applied in between is then counted twice
    for a moment (the limit errs strict), never missed."""
    position = consumer_position(conn, CONSUMER)
    rows = conn.execute(
        select(api_key_spend.c.key_id, api_key_spend.c.spent_nano_usd)
        .join(api_keys, api_keys.c.id == api_key_spend.c.key_id)
        .where(api_keys.c.spend_limit_nano_usd.is_not(None))
    )
    return position, dict(rows.all())


class KeyBudgets:
    """This process's part of each limited key's spending not yet in the read model."""

    def __init__(self) -> None:
        self.position = 0
        self.spent: dict[int, int] = {}
        self.held: dict[int, int] = defaultdict(int)
        self.settled: dict[int, list[tuple[int, int]]] = defaultdict(list)  # (seq, charge) past the position

    def refresh(self, position: int, spent: dict[int, int]) -> None:
        self.position, self.spent = position, spent
        for key_id in list(self.settled):
            self.settled[key_id] = [(seq, c) for seq, c in self.settled[key_id] if seq > position]

    def remaining(self, key_id: int, limit_nano_usd: int) -> int:
        recent = sum(c for seq, c in self.settled.get(key_id, ()) if seq > self.position)
        return limit_nano_usd - self.spent.get(key_id, 0) - self.held[key_id] - recent

    def settle(self, key_id: int, seq: int, charge_nano_usd: int) -> None:
        self.settled[key_id].append((seq, charge_nano_usd))
