"""Monthly statements: what happened to an account's balance in a UTC month.

Built from the read models (postings by account, usage and earnings per day),
which one consumer keeps in the same transactions, and checked before anything
is issued: the closing balance is the opening plus every posting of the month,
the usage (or earnings) lines add up to the month's settlement postings, and
for a whole month every account's read-model total equals the ledger's own.

A statement is stored once its month has closed (plus a grace for the clocks
of other replicas); before that it is rendered on demand, marked provisional,
and not kept."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.exc import IntegrityError

from invoices import posting_sums, read_models
from invoices.files import deployment_id, recorded_document, sha256, write_whole
from invoices.limits import (
    CATCH_UP_ROUNDS_MAX,
    CLOSE_GRACE_S,
    ITEMISED_LINES_MAX,
    MONTHS_PER_YEAR,
    STATEMENT_FILE_DIGEST_CHARS,
    STATEMENT_YEAR_MAX,
    STATEMENT_YEAR_MIN,
)
from invoices.render import render_statement_pdf
from invoices.schema import account_postings, earnings_daily, postings_daily, statements, usage_daily
from invoices.service import InvoiceSettings
from ledger.accounts import require_kind
from ledger.commands import CUSTOMER, OWNER
from ledger.errors import InvalidInput, InvariantBroken, LedgerError
from ledger.events import GENESIS_HASH
from ledger.log import consumer_position
from ledger.schema import accounts, ledger_event_postings, ledger_events, utc_now

SETTLED = "RequestSettled"
STATED_KINDS, STATED_RULE = (CUSTOMER, OWNER), "statements are for customers and owners"
SECTION_TITLES = {  # in the order a statement shows them; usage (earnings) comes third
    "CreditsPurchased": "Top-ups", "CreditsGranted": "Credits granted", SETTLED: "", "CreditsRefunded": "Refunds",
    "CreditsFrozen": "Disputes", "BalanceAdjusted": "Adjustments", "PayoutRequested": "Payouts",
    "PayoutFailed": "Payouts returned",
}
SECTION_ORDER = list(SECTION_TITLES)


class StatementNotReady(LedgerError):
    """The read models have not applied every event of the period yet: try again shortly."""

    code = "not_ready"


class NoStatement(InvalidInput):
    """The account had no ledger activity by the end of that month: there is nothing to state."""

    code = "no_statement"


@dataclass(frozen=True)
class Month:
    text: str  # YYYY-MM
    start: datetime
    end: datetime  # exclusive


def parse_month(text: str) -> Month:
    match = re.fullmatch(r"(\d{4})-(0[1-9]|1[0-2])", text or "")
    if match is None or not STATEMENT_YEAR_MIN <= int(match[1]) <= STATEMENT_YEAR_MAX:
        raise InvalidInput(f"a month is YYYY-MM from {STATEMENT_YEAR_MIN} to {STATEMENT_YEAR_MAX}, not {text!r}")
    year, month = int(match[1]), int(match[2])
    return Month(text, datetime(year, month, 1, tzinfo=UTC), datetime(year + month // MONTHS_PER_YEAR, month % MONTHS_PER_YEAR + 1, 1, tzinfo=UTC))


def previous_month(now: datetime) -> Month:
    return parse_month((now.replace(day=1) - timedelta(days=1)).strftime("%Y-%m"))


def is_closed(month: Month, now: datetime) -> bool:
    return now >= month.end + timedelta(seconds=CLOSE_GRACE_S)


@dataclass(frozen=True)
class Labels:
    """How the account's API keys and workers are named (they live outside `invoices`)."""

    api_keys: dict[int, str] = field(default_factory=dict)
    workers: dict[int, str] = field(default_factory=dict)


LabelLookup = Callable[[Connection, int], Labels]


def ensure_applied(engine: Engine, end: datetime, rounds_max: int = CATCH_UP_ROUNDS_MAX) -> None:
    """Catch the read models up until no event recorded before `end` is left unapplied."""
    for round_number in range(rounds_max + 1):
        with engine.connect() as conn:
            position = consumer_position(conn, read_models.CONSUMER)
            pending = conn.execute(select(ledger_events.c.seq).where(
                ledger_events.c.seq > position, ledger_events.c.recorded_at < end).limit(1)).first()
        if pending is None:
            return
        if round_number < rounds_max:
            read_models.catch_up(engine)
    raise StatementNotReady("the read models are still catching up with the ledger; try again in a few seconds")


def movements(conn: Connection, account_id: int, start: datetime, end: datetime,
              through_seq: int | None = None) -> tuple[int, dict[str, tuple[int, int]]]:
    """The opening balance at `start`, and the postings of [start, end) per kind: {source type: (count, amount)};
    only those of events up to `through_seq` when it is given (a reconciliation's fixed position)."""
    opening = posting_sums.balance_before(conn, account_id, start, through_seq)
    return opening, posting_sums.sums_by_kind(conn, account_id, start, end, through_seq)


def build(conn: Connection, account_id: int, month: Month, labels: Labels, now: datetime) -> dict:
    """The statement's figures; raises if they do not reconcile."""
    require_kind(conn, account_id, STATED_KINDS, STATED_RULE)
    account = conn.execute(select(accounts.c.kind, accounts.c.name, accounts.c.email).where(accounts.c.id == account_id)).one()
    if month.start > now:
        raise InvalidInput(f"{month.text} has not begun")
    ap = account_postings.c
    in_month = (ap.account_id == account_id, ap.recorded_at >= month.start, ap.recorded_at < month.end)
    opening, sections = movements(conn, account_id, month.start, month.end)
    closing = opening + sum(total for _, total in sections.values())
    settled_nano_usd = sections.get(SETTLED, (0, 0))[1]
    lines = _usage_lines(conn, account_id, month, labels) if account.kind == CUSTOMER else _earnings_lines(conn, account_id, month, labels)
    lines_nano_usd = sum(line["amount_nano_usd"] for line in lines)
    if lines_nano_usd != settled_nano_usd:
        raise InvariantBroken(f"account {account_id} {month.text}: lines add up to {lines_nano_usd}, settlements to {settled_nano_usd}")
    itemised = conn.execute(select(ap.recorded_at, ap.event_seq, ap.source_type, ap.event_type, ap.amount_nano_usd, ap.reference)
                            .where(*in_month, ap.source_type != SETTLED)
                            .order_by(ap.recorded_at, ap.event_seq, ap.leg).limit(ITEMISED_LINES_MAX + 1)).all()
    through = _last_event_before(conn, month.end)
    return {
        "account": {"id": account_id, "kind": account.kind, "name": account.name, "email": account.email},
        "month": month.text, "period_start": month.start.isoformat(), "period_end": month.end.isoformat(),
        "provisional": not is_closed(month, now), "generated_at": now.isoformat(),
        "opening_balance_nano_usd": opening, "closing_balance_nano_usd": closing,
        "sections": [{"source_type": t, "title": _settled_title(account.kind) if t == SETTLED else SECTION_TITLES.get(t, t),
                      "postings": n, "amount_nano_usd": total} for t, (n, total) in sorted(sections.items(), key=_section_order)],
        "lines": lines,
        "itemised": [{"recorded_at": r.recorded_at.isoformat(), "event_seq": r.event_seq, "title": SECTION_TITLES.get(r.source_type, r.source_type),
                      "reversal": r.event_type == "EventReversed", "amount_nano_usd": r.amount_nano_usd, "reference": r.reference}
                     for r in itemised[:ITEMISED_LINES_MAX]],
        "itemised_complete": len(itemised) <= ITEMISED_LINES_MAX,
        "through_seq": through[0], "through_hash": through[1],
    }


def _section_order(item: tuple) -> tuple:
    return (SECTION_ORDER.index(item[0]) if item[0] in SECTION_ORDER else len(SECTION_ORDER), item[0])


def _settled_title(kind: str) -> str:
    return "Usage" if kind == CUSTOMER else "Earnings"


def _days(month: Month) -> tuple:
    return month.start.date().isoformat(), month.end.date().isoformat()


def _usage_lines(conn: Connection, account_id: int, month: Month, labels: Labels) -> list[dict]:
    u = usage_daily.c
    first, after = _days(month)
    rows = conn.execute(select(u.model, u.api_key_id, func.sum(u.requests).label("requests"), func.sum(u.prompt_tokens).label("prompt"),
                               func.sum(u.completion_tokens).label("completion"), func.sum(u.cost_nano_usd).label("cost"))
                        .where(u.account_id == account_id, u.day >= first, u.day < after)
                        .group_by(u.model, u.api_key_id).order_by(u.model, u.api_key_id))
    return [{"model": r.model, "api_key_id": r.api_key_id, "api_key": labels.api_keys.get(r.api_key_id, f"key {r.api_key_id}"),
             "requests": int(r.requests), "prompt_tokens": int(r.prompt), "completion_tokens": int(r.completion),
             "amount_nano_usd": -int(r.cost)} for r in rows if r.requests or r.cost]


def _earnings_lines(conn: Connection, owner_id: int, month: Month, labels: Labels) -> list[dict]:
    e = earnings_daily.c
    first, after = _days(month)
    rows = conn.execute(select(e.day, e.worker_id, e.model, e.requests, e.earnings_nano_usd)
                        .where(e.owner_account_id == owner_id, e.day >= first, e.day < after)
                        .order_by(e.day, e.worker_id, e.model))
    return [{"day": r.day, "worker_id": r.worker_id, "worker": labels.workers.get(r.worker_id, f"worker {r.worker_id}"), "model": r.model,
             "requests": r.requests, "amount_nano_usd": r.earnings_nano_usd} for r in rows if r.requests or r.earnings_nano_usd]


def _last_event_before(conn: Connection, end: datetime) -> tuple[int, str]:
    """The last event the read models applied that was recorded before `end`: where the statement stands on the chain."""
    position = consumer_position(conn, read_models.CONSUMER)
    row = conn.execute(select(ledger_events.c.seq, ledger_events.c.hash)
                       .where(ledger_events.c.seq <= position, ledger_events.c.recorded_at < end)
                       .order_by(ledger_events.c.seq.desc()).limit(1)).first()
    return (row.seq, row.hash.hex()) if row else (0, GENESIS_HASH.hex())


def reconcile(engine: Engine, end: datetime, account_id: int | None = None) -> dict[int, tuple[int, int]]:
    """Accounts whose postings before `end` (a month's end) add up differently in
    the ledger and in the read model (its postings, or their sums per day, which
    statements are drawn from): {account: (ledger, read model)}; empty when all agree.
    One pass over the ledger's postings (which have no per-account index) checks every account at once."""
    lp, ap, pd = ledger_event_postings.c, account_postings.c, postings_daily.c
    with engine.connect() as conn:
        ledger_totals = dict(conn.execute(
            select(lp.account_id, func.sum(lp.amount_nano_usd)).join(ledger_events, ledger_events.c.seq == lp.event_seq)
            .where(ledger_events.c.recorded_at < end, *([lp.account_id == account_id] if account_id else []))
            .group_by(lp.account_id)).all())
        model_totals = [dict(conn.execute(query.group_by(table.account_id)).all()) for table, query in (
            (ap, select(ap.account_id, func.sum(ap.amount_nano_usd)).where(
                ap.recorded_at < end, *([ap.account_id == account_id] if account_id else []))),
            (pd, select(pd.account_id, func.sum(pd.amount_nano_usd)).where(
                pd.day < end.astimezone(UTC).date().isoformat(), *([pd.account_id == account_id] if account_id else []))))]
    mismatches = {}
    for totals in model_totals:
        for a in ledger_totals.keys() | totals.keys():
            if a not in mismatches and ledger_totals.get(a, 0) != totals.get(a, 0):
                mismatches[a] = (int(ledger_totals.get(a, 0)), int(totals.get(a, 0)))
    return mismatches


def _require_reconciled(engine: Engine, end: datetime, account_id: int | None = None) -> None:
    mismatches = reconcile(engine, end, account_id)
    if mismatches:
        raise InvariantBroken(f"read models disagree with the ledger before {end.isoformat()} "
                              f"(account: (ledger, read model)): {mismatches}")


def accounts_with_activity(engine: Engine, month: Month, account_id: int | None = None) -> list[int]:
    """Customers and owners with any posting before the month's end: those who get a statement."""
    active = select(account_postings.c.account_id).where(
        account_postings.c.account_id == accounts.c.id, account_postings.c.recorded_at < month.end).exists()
    query = select(accounts.c.id).where(accounts.c.kind.in_(STATED_KINDS), active).order_by(accounts.c.id)
    if account_id is not None:
        query = query.where(accounts.c.id == account_id)
    with engine.connect() as conn:
        return list(conn.execute(query).scalars())


def missing_statements(engine: Engine, month: Month, now: datetime | None = None) -> list[int]:
    """Before a month's statements: the month has closed and the read models hold
    all of it. Returns who should have one and has not; when that is anyone, every
    account's read-model total is first checked against the ledger's own."""
    if not is_closed(month, now or utc_now()):
        raise InvalidInput(f"{month.text} has not closed yet")
    ensure_applied(engine, month.end)
    with engine.connect() as conn:
        stored = set(conn.execute(select(statements.c.account_id).where(statements.c.month == month.text)).scalars())
    missing = [a for a in accounts_with_activity(engine, month) if a not in stored]
    if missing:
        _require_reconciled(engine, month.end)
    return missing


@contextmanager
def _snapshot(engine: Engine) -> Iterator[Connection]:
    """One consistent view for all of a statement's queries, while the consumer keeps writing."""
    conn = engine.connect()
    if conn.dialect.name == "postgresql":
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
    try:
        with conn.begin():  # SQLite: a read transaction sees one snapshot too
            yield conn
    finally:
        conn.close()


def issue(engine: Engine, settings: InvoiceSettings, account_id: int, month: Month, labels_for: LabelLookup,
          now: datetime | None = None, *, month_reconciled: bool = False, rounds_max: int = CATCH_UP_ROUNDS_MAX) -> dict:
    """The stored statement of a closed month (made now, or as it was). Unless
    `missing_statements` has checked the whole month already, this account is checked against the ledger first."""
    now = now or utc_now()
    if not is_closed(month, now):
        raise InvalidInput(f"{month.text} has not closed yet: its statement is provisional and is not stored")
    with engine.connect() as conn:
        require_kind(conn, account_id, STATED_KINDS, STATED_RULE)
    existing = _stored(engine, account_id, month)
    if existing is not None:
        return existing
    ensure_applied(engine, month.end, rounds_max)
    if not accounts_with_activity(engine, month, account_id):
        raise NoStatement(f"account {account_id} had no ledger activity before {month.end.date()}")
    if not month_reconciled:
        _require_reconciled(engine, month.end, account_id)
    with _snapshot(engine) as conn:
        figures = build(conn, account_id, month, labels_for(conn, account_id), now)
    _require_chained(engine, account_id, month, figures["opening_balance_nano_usd"])
    pdf = render_statement_pdf(figures)
    digest = sha256(pdf)
    with engine.connect() as conn:
        path = statement_path(settings, deployment_id(conn), account_id, month, digest)
    write_whole(path, pdf)
    row = {"account_id": account_id, "month": month.text, "kind": figures["account"]["kind"],
           "opening_balance_nano_usd": figures["opening_balance_nano_usd"], "closing_balance_nano_usd": figures["closing_balance_nano_usd"],
           "through_seq": figures["through_seq"], "issued_at": now, "pdf_path": str(path), "pdf_sha256": digest}
    try:
        with engine.begin() as conn:
            conn.execute(statements.insert().values(**row))
    except IntegrityError:  # issued meanwhile by another worker: theirs stands, this file goes (unless it is theirs too)
        stored = _stored(engine, account_id, month)
        if stored["pdf_path"] != str(path):
            path.unlink(missing_ok=True)
        return stored
    return _view(row)


def statement_path(settings: InvoiceSettings, deployment: str, account_id: int, month: Month, digest: bytes) -> Path:
    """A name per deployment and rendering: two workers issuing at once each write their own file, and the row names the winner's."""
    return (settings.storage_dir / deployment / "statements" / month.text
            / f"statement-{account_id}-{month.text}-{digest.hex()[:STATEMENT_FILE_DIGEST_CHARS]}.pdf")


def _require_chained(engine: Engine, account_id: int, month: Month, opening_nano_usd: int) -> None:
    """A month opens where the stored month before it closed; anything else means an
    event was recorded into a month after its statement (a clock stepped back)."""
    previous = _stored(engine, account_id, previous_month(month.start))
    if previous is not None and previous["closing_balance_nano_usd"] != opening_nano_usd:
        raise InvariantBroken(f"account {account_id}: {month.text} opens at {opening_nano_usd} but "
                              f"{previous['month']} was stated closing at {previous['closing_balance_nano_usd']}")


def _stored(engine: Engine, account_id: int, month: Month) -> dict | None:
    with engine.connect() as conn:
        row = conn.execute(select(statements).where(statements.c.account_id == account_id, statements.c.month == month.text)).first()
    return None if row is None else _view(row._mapping)


def _view(row: Mapping) -> dict:
    view = {str(name): row[name] for name in statements.c.keys()}  # plain str: orjson refuses subclasses as keys
    return {**view, "issued_at": view["issued_at"].isoformat(), "pdf_sha256": view["pdf_sha256"].hex()}


def document(engine: Engine, settings: InvoiceSettings, account_id: int, month: Month, labels_for: LabelLookup,
             now: datetime | None = None, rounds_max: int = CATCH_UP_ROUNDS_MAX) -> tuple[bytes, bool]:
    """(PDF, provisional): the stored statement of a closed month, or one rendered now for the open month."""
    now = now or utc_now()
    if is_closed(month, now):
        issue(engine, settings, account_id, month, labels_for, now, rounds_max=rounds_max)
        return stored_pdf(engine, settings, account_id, month, labels_for), False
    return render_statement_pdf(figures(engine, settings, account_id, month, labels_for, now, rounds_max)), True


def stored_pdf(engine: Engine, settings: InvoiceSettings, account_id: int, month: Month, labels_for: LabelLookup) -> bytes:
    """A stored statement's PDF, only with the SHA-256 recorded when it was issued:
    read, or rendered again as of its issue time, else `DocumentUnavailable`."""
    with engine.connect() as conn:
        row = conn.execute(select(statements).where(statements.c.account_id == account_id, statements.c.month == month.text)).one()
        deployment = deployment_id(conn)

    def render() -> bytes:
        with _snapshot(engine) as conn:
            return render_statement_pdf(build(conn, account_id, month, labels_for(conn, account_id), row.issued_at))

    content, stored_at = recorded_document(Path(row.pdf_path), row.pdf_sha256, render,
                                           statement_path(settings, deployment, account_id, month, row.pdf_sha256),
                                           f"statement {month.text} of account {account_id}")
    if str(stored_at) != row.pdf_path:
        with engine.begin() as conn:
            conn.execute(update(statements).where(statements.c.account_id == account_id, statements.c.month == month.text)
                         .values(pdf_path=str(stored_at)))
    return content


def figures(engine: Engine, settings: InvoiceSettings, account_id: int, month: Month, labels_for: LabelLookup,
            now: datetime | None = None, rounds_max: int = CATCH_UP_ROUNDS_MAX) -> dict:
    """The statement's figures, for any month that has begun; a closed month's
    statement is issued first, so what is shown has been checked against the ledger."""
    now = now or utc_now()
    if is_closed(month, now):
        issue(engine, settings, account_id, month, labels_for, now, rounds_max=rounds_max)
    else:
        ensure_applied(engine, now, rounds_max)
    with _snapshot(engine) as conn:
        return build(conn, account_id, month, labels_for(conn, account_id), now)


def list_statements(conn: Connection, account_id: int) -> list[dict]:
    rows = conn.execute(select(statements).where(statements.c.account_id == account_id).order_by(statements.c.month))
    return [_view(r._mapping) for r in rows]
