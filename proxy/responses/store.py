"""Stored responses: the items a follow-up (`previous_response_id`) continues from.

A response is found only by its own account: another account's id is as
unknown as an id never issued."""
from __future__ import annotations

import orjson
from sqlalchemy import Engine, insert, select

from ledger.schema import utc_now
from proxy.schema import stored_responses


def save(engine: Engine, response_id: str, account_id: int, model: str, input_items: list[dict],
         output_items: list[dict]) -> None:
    with engine.begin() as conn:
        conn.execute(insert(stored_responses).values(
            response_id=response_id, account_id=account_id, model=model, input_items=orjson.dumps(input_items).decode(),
            output_items=orjson.dumps(output_items).decode(), created_at=utc_now()))


def conversation(engine: Engine, response_id: str, account_id: int) -> list[dict] | None:
    """The response's input then its output, or None when this account has no such response."""
    with engine.connect() as conn:
        row = conn.execute(select(stored_responses.c.input_items, stored_responses.c.output_items).where(
            stored_responses.c.response_id == response_id, stored_responses.c.account_id == account_id)).first()
    if row is None:
        return None
    return [*orjson.loads(row.input_items), *orjson.loads(row.output_items)]
