"""An account's activity: every request it made, newest first, for a console
that follows it live (`GET /v1/activity`, `paralon activity`).

Two sources, each read by its own position: `generations`, the settled
requests, kept from the log by the read models (invoices/read_models.py; a
row's position is the last event that changed it: its settlement, the rest
charged after its hold closed, a reversal), and `unbilled_generations`, the
requests that ended with nothing charged, which the proxy writes
(proxy/unbilled.py; a row's position is its id). A cursor holds both
positions, `SEQ.ID`, and a page is the two merged by time:

- no cursor: the newest rows;
- `before=CURSOR`: the rows older than the page the cursor came with;
- `after=CURSOR`: the rows new or changed since (the oldest of them first
  taken, so none is skipped); a row seen before comes again with its new
  figures (a reversal), under the same id.

Each page answers, newest first, with the cursors to ask with next."""
from __future__ import annotations

import heapq
import re
from typing import NamedTuple

from sqlalchemy import Connection, exists, literal, null, select

from app.accounts import NotVisible, scoped_account
from app.limits import ACTIVITY_ROWS_DEFAULT, ACTIVITY_ROWS_MAX
from app.tokens import OWNER, Principal
from invoices.read_models import CANCELLED, COMPLETED, STREAMED
from invoices.schema import generations
from ledger.commands import require_text
from ledger.errors import InvalidInput
from ledger.limits import INT64_MAX, NAME_CHARS_MAX
from proxy.schema import UNBILLED_STATUSES, api_keys, unbilled_generations

FAILED = UNBILLED_STATUSES[0]
SETTLED_STATUSES = (STREAMED, COMPLETED, CANCELLED)
STATUSES = (*SETTLED_STATUSES, FAILED)
SETTLED, UNBILLED = "settled", "unbilled"  # the two sources
_POSITION = r"(0|[1-9][0-9]{0,%d})" % (len(str(INT64_MAX)) - 1)
_CURSOR = re.compile(rf"{_POSITION}\.{_POSITION}")
CURSOR_PATTERN = f"^{_CURSOR.pattern}$"


class Cursor(NamedTuple):
    """Where a page ends in each source: the settled rows' event seq, the unbilled rows' id."""

    seq: int
    unbilled_id: int

    def __str__(self) -> str:
        return f"{self.seq}.{self.unbilled_id}"


class _Row(NamedTuple):
    source: str  # SETTLED or UNBILLED
    position: int  # in its source
    completed_at: object
    row: object


class Filters(NamedTuple):
    model: str | None = None
    api_key_id: int | None = None
    status: str | None = None


def parse_cursor(text: object, name: str) -> Cursor | None:
    if text is None:
        return None
    found = _CURSOR.fullmatch(text) if isinstance(text, str) else None
    if found is None or max(int(found[1]), int(found[2])) > INT64_MAX:
        raise InvalidInput(f"{name} is a cursor from an earlier page, such as 1234.56")
    return Cursor(int(found[1]), int(found[2]))


def activity(conn: Connection, who: Principal, account_id: int | None, *, model: str | None = None,
             api_key_id: int | None = None, status: str | None = None, after: str | None = None,
             before: str | None = None, limit: int = ACTIVITY_ROWS_DEFAULT) -> dict:
    """The activity of an account the principal may read: its own (an admin's: any).
    The customer side's roles read it (the guards say which); an owner never
    does, whatever a guard lets through: it would see its customers' keys."""
    if who.role == OWNER:
        raise NotVisible("no activity for an owner's token")
    return account_activity(conn, scoped_account(who, account_id), model=model, api_key_id=api_key_id, status=status,
                            after=after, before=before, limit=limit)


def account_activity(conn: Connection, account_id: int, *, model: str | None = None, api_key_id: int | None = None,
                     status: str | None = None, after: str | None = None, before: str | None = None,
                     limit: int = ACTIVITY_ROWS_DEFAULT) -> dict:
    """One page of an account's requests, newest first: {"data", "after", "before"}.
    Every filter is checked before anything is read."""
    filters = _filters(model, api_key_id, status)
    if type(limit) is not int or not 1 <= limit <= ACTIVITY_ROWS_MAX:
        raise InvalidInput(f"limit is 1 to {ACTIVITY_ROWS_MAX}")
    newer, older = parse_cursor(after, "after"), parse_cursor(before, "before")
    if newer is not None and older is not None:
        raise InvalidInput("ask for the rows after a cursor or before one, not both")
    if newer is not None:
        return _newer(conn, account_id, filters, newer, limit)
    return _older(conn, account_id, filters, older, limit)


def _filters(model: object, api_key_id: object, status: object) -> Filters:
    if model is not None:
        require_text(model, "model", NAME_CHARS_MAX)
    if api_key_id is not None and (type(api_key_id) is not int or not 1 <= api_key_id <= INT64_MAX):
        raise InvalidInput("key_id is an API key's id")
    if status is not None and status not in STATUSES:
        raise InvalidInput(f"status is one of {', '.join(STATUSES)}")
    return Filters(model, api_key_id, status)


def _older(conn: Connection, account_id: int, filters: Filters, bound: Cursor | None, limit: int) -> dict:
    """The newest rows, or those older than `bound`; `after` only for the newest page."""
    settled = _settled(conn, account_id, filters, limit, below=bound.seq if bound else None)
    unbilled = _unbilled(conn, account_id, filters, limit, below=bound.unbilled_id if bound else None)
    page = list(heapq.merge(settled, unbilled, key=_time, reverse=True))[:limit]
    newest = None if bound else Cursor(_newest(settled), _newest(unbilled))
    oldest = Cursor(_older_from(page, settled), _older_from(page, unbilled)) if len(page) == limit else None
    return _answer(conn, account_id, page, newest, oldest)


def _newer(conn: Connection, account_id: int, filters: Filters, bound: Cursor, limit: int) -> dict:
    """The rows new or changed since `bound`, the oldest first taken."""
    settled = _settled(conn, account_id, filters, limit, above=bound.seq)
    unbilled = _unbilled(conn, account_id, filters, limit, above=bound.unbilled_id)
    page = list(heapq.merge(settled, unbilled, key=_time))[:limit]
    newest = Cursor(max(_taken(page, SETTLED), default=bound.seq), max(_taken(page, UNBILLED), default=bound.unbilled_id))
    return _answer(conn, account_id, page, newest, None)


def _time(row: _Row) -> object:
    return row.completed_at


def _taken(page: list[_Row], source: str) -> list[int]:
    return [row.position for row in page if row.source == source]


def _newest(rows: list[_Row]) -> int:
    """Where the rows after the newest page start in one source (read newest first)."""
    return rows[0].position if rows else 0


def _older_from(page: list[_Row], rows: list[_Row]) -> int:
    """Where the next older page starts in one source: below the oldest row the page
    took from it, or below none of what it read there (0: it read nothing)."""
    if not rows:
        return 0
    return min(_taken(page, rows[0].source), default=rows[0].position + 1)


# What both sources answer, column for column.
def _settled(conn: Connection, account_id: int, filters: Filters, limit: int, *, above: int | None = None,
             below: int | None = None) -> list:
    g = generations
    if filters.status == FAILED:
        return []
    query = select(g.c.event_seq.label("position"), g.c.request_id, g.c.completed_at,
                   g.c.model, g.c.api_key_id, g.c.status, g.c.prompt_tokens, g.c.completion_tokens, g.c.cost_nano_usd,
                   g.c.ttft_ms, null().label("reason")).where(g.c.account_id == account_id)
    # A withheld answer whose settlement committed all the same (and was reversed) is told by its unbilled row.
    query = query.where(~exists().where(unbilled_generations.c.request_id == g.c.request_id))
    query = _filtered(query, g, filters)
    return _bounded(conn, SETTLED, query, g.c.event_seq, limit, above, below)


def _unbilled(conn: Connection, account_id: int, filters: Filters, limit: int, *, above: int | None = None,
              below: int | None = None) -> list:
    u = unbilled_generations
    if filters.status in (STREAMED, COMPLETED):
        return []
    query = select(u.c.id.label("position"), u.c.request_id, u.c.completed_at, u.c.model, u.c.api_key_id, u.c.status,
                   literal(0).label("prompt_tokens"), literal(0).label("completion_tokens"), literal(0).label("cost_nano_usd"),
                   u.c.ttft_ms, u.c.reason).where(u.c.account_id == account_id)
    return _bounded(conn, UNBILLED, _filtered(query, u, filters), u.c.id, limit, above, below)


def _filtered(query, table, filters: Filters):
    if filters.model is not None:
        query = query.where(table.c.model == filters.model)
    if filters.api_key_id is not None:
        query = query.where(table.c.api_key_id == filters.api_key_id)
    if filters.status is not None:
        query = query.where(table.c.status == filters.status)
    return query


def _bounded(conn: Connection, source: str, query, position, limit: int, above: int | None,
             below: int | None) -> list[_Row]:
    """Above a position, oldest first; else below one (or from the newest), newest first."""
    if above is not None:
        query = query.where(position > above).order_by(position)
    else:
        query = query.where(position < below) if below is not None else query
        query = query.order_by(position.desc())
    return [_Row(source, row.position, row.completed_at, row) for row in conn.execute(query.limit(limit))]


def _answer(conn: Connection, account_id: int, page: list[_Row], newest: Cursor | None, oldest: Cursor | None) -> dict:
    """The page newest first (by time: a source's own order is by its position)."""
    names = _key_names(conn, account_id, {row.row.api_key_id for row in page})
    rows = sorted(page, key=_time, reverse=True)
    return {"data": [_view(row.row, names) for row in rows], "after": str(newest) if newest else None,
            "before": str(oldest) if oldest else None}


def _key_names(conn: Connection, account_id: int, key_ids: set[int]) -> dict[int, str | None]:
    if not key_ids:
        return {}
    rows = conn.execute(select(api_keys.c.id, api_keys.c.name)
                        .where(api_keys.c.account_id == account_id, api_keys.c.id.in_(sorted(key_ids))))
    return {row.id: row.name for row in rows}


def _view(row, key_names: dict[int, str | None]) -> dict:
    """As the customer sees it: never the worker that answered, nor the owner's share."""
    return {"id": row.request_id, "completed_at": row.completed_at.isoformat(), "model": row.model,
            "api_key_id": row.api_key_id or None, "api_key_name": key_names.get(row.api_key_id), "status": row.status,
            "prompt_tokens": int(row.prompt_tokens), "completion_tokens": int(row.completion_tokens),
            "cost_nano_usd": int(row.cost_nano_usd), "ttft_ms": row.ttft_ms, "reason": row.reason}
