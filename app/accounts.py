"""What a management token may see and change: its own account's balances,
API keys, workers, invoices, usage and earnings; an admin, any account's.

Whatever belongs to another account is reported exactly as what does not
exist (`NotVisible`), so a token learns nothing about accounts it may not see.
Which roles may call which function is the HTTP guards' business
(app/http/guards.py); these functions decide which rows a principal reaches."""
from __future__ import annotations

from datetime import date, datetime, timedelta

from sqlalchemy import Connection, func, select

from app import low_balance, worker_traffic
from app.limits import (
    ACCOUNTS_PAGE_ROWS_MAX,
    GROUP_BY_DIMENSIONS_MAX,
    RATE_WINDOW_DAYS,
    SUMMARY_WINDOW_DAYS_MAX,
    SUMMARY_WINDOWS_DAYS,
)
from app.tokens import Principal
from invoices.read_models import USAGE_SUMS
from invoices.schema import earnings_daily, usage_daily
from invoices.schema import invoices as invoices_table
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.errors import InvalidInput
from proxy import keys as api_keys
from proxy import workers as registry

INVOICE_KINDS = ("invoice", "credit_note")
USAGE_GROUPS = {"day": "day", "model": "model", "key": "api_key_id"}
EARNINGS_GROUPS = {"day": "day", "worker": "worker_id", "model": "model"}


class NotVisible(InvalidInput):
    """Does not exist, or belongs to an account the principal may not know about."""

    code = "not_found"


def scoped_account(who: Principal, account_id: int | None) -> int:
    """The account a request reads: an admin names any; anyone else may name only their own,
    and another account is not there for them (404), never their own data under its id."""
    if account_id is None:
        return who.account_id
    if account_id != who.account_id and not who.is_admin:
        raise NotVisible(f"no account {account_id}")
    return account_id


def account_view(conn: Connection, who: Principal) -> dict:
    view = acc.read_balance(conn, who.account_id)
    data = {"id": who.account_id, "kind": view.kind, "role": who.role, "balance_nano_usd": view.balance_nano_usd,
            "available_nano_usd": view.available_nano_usd, "held_nano_usd": view.held_nano_usd}
    if view.kind == cmd.OWNER:
        data["earnings_nano_usd"] = view.balance_nano_usd
    return data


def list_accounts(conn: Connection, who: Principal, after_id: int, rows_max: int) -> dict:
    """Every account for an admin; only its own for anyone else."""
    return accounts_page(conn, after_id, rows_max, None if who.is_admin else who.account_id)


def accounts_page(conn: Connection, after_id: int, rows_max: int, account_id: int | None = None) -> dict:
    """Accounts in id order after `after_id` (only `account_id` when given), with their balances;
    `next_after_id` asks for the next page (None: this is the last)."""
    if not 1 <= rows_max <= ACCOUNTS_PAGE_ROWS_MAX:
        raise InvalidInput(f"limit is 1 to {ACCOUNTS_PAGE_ROWS_MAX}")
    books = acc.page_of_books(conn, after_id, rows_max, account_id)
    data = [{"id": view.account_id, "kind": view.kind, "name": name, "email": email, "balance_nano_usd": view.balance_nano_usd,
             "available_nano_usd": view.available_nano_usd, "held_nano_usd": view.held_nano_usd} for name, email, view in books]
    return {"data": data, "next_after_id": data[-1]["id"] if len(data) == rows_max else None}
def low_balance_alert(conn: Connection, who: Principal, account_id: int | None) -> dict:
    return low_balance.alert_view(conn, scoped_account(who, account_id))
def set_low_balance_alert(conn: Connection, who: Principal, account_id: int | None, threshold_usd: object) -> dict:
    """Customers only (the guards see to it), on their own account: another is not there for them."""
    return low_balance.set_alert(conn, scoped_account(who, account_id), threshold_usd)


def list_keys(conn: Connection, who: Principal, account_id: int | None) -> list[dict]:
    return api_keys.list_keys(conn, scoped_account(who, account_id))


def create_key(conn: Connection, who: Principal, name: object, spend_limit_nano_usd: int | None) -> dict:
    key_id, key = api_keys.create_key(conn, who.account_id, name=name, spend_limit_nano_usd=spend_limit_nano_usd)
    return {"id": key_id, "key": key, "spend_limit_nano_usd": spend_limit_nano_usd}


def revoke_key(conn: Connection, who: Principal, key_id: int) -> None:
    owner = api_keys.key_account(conn, key_id)
    if owner is None or (owner != who.account_id and not who.is_admin):
        raise NotVisible(f"no API key {key_id}")
    api_keys.revoke_key(conn, key_id)


def list_workers(conn: Connection, who: Principal) -> list[dict]:
    """The principal's workers (an admin's: all), with their state, capacity,
    prefix-cache hit rate and share of their model's traffic (app/worker_traffic.py)."""
    return worker_traffic.worker_rows(conn, _visible_workers(conn, who))


def drain_worker(conn: Connection, who: Principal, worker_id: int) -> dict:
    if worker_id not in {w.id for w in _visible_workers(conn, who)}:
        raise NotVisible(f"no worker {worker_id}")
    return registry.drain_worker(conn, worker_id).as_dict()


def resume_worker(conn: Connection, who: Principal, worker_id: int, reason: object) -> dict:
    """Admins only (the guards see to it): an owner may not lift its own worker's suspension."""
    try:
        return registry.resume_worker(conn, worker_id, resumed_by=f"admin {who.actor}", reason=reason).as_dict()
    except registry.UnknownWorker:
        raise NotVisible(f"no worker {worker_id}") from None


def _visible_workers(conn: Connection, who: Principal) -> list[registry.WorkerView]:
    return registry.list_workers(conn, owner_account_id=None if who.is_admin else who.account_id)


def list_invoices(conn: Connection, account_id: int, kind: str | None, start: datetime | None,
                  end: datetime | None) -> list[dict]:
    """Invoices and credit notes issued in [start, end), oldest first."""
    if kind not in (None, *INVOICE_KINDS):
        raise InvalidInput(f"kind is {' or '.join(INVOICE_KINDS)}")
    query = select(invoices_table).where(invoices_table.c.account_id == account_id).order_by(invoices_table.c.issued_at)
    if kind:
        query = query.where(invoices_table.c.kind == kind)
    if start:
        query = query.where(invoices_table.c.issued_at >= start)
    if end:
        query = query.where(invoices_table.c.issued_at < end)
    return [{"number": r.number, "kind": r.kind, "amount_nano_usd": r.amount_nano_usd, "issued_at": r.issued_at.isoformat(),
             "corrects": r.corrects_number, "payment_method": r.payment_method,
             "pdf_sha256": r.pdf_sha256.hex() if r.pdf_sha256 else None} for r in conn.execute(query)]


def visible_invoice(conn: Connection, who: Principal, number: str) -> str:
    """The number of an issued invoice the caller may see; else `NotVisible`."""
    row = conn.execute(select(invoices_table.c.account_id, invoices_table.c.issued_event_seq)
                       .where(invoices_table.c.number == number)).first()
    if row is None or row.issued_event_seq is None or (row.account_id != who.account_id and not who.is_admin):
        raise NotVisible(f"no invoice {number}")
    return number


def _groups(group_by: str, known: dict[str, str]) -> list[str]:
    """`day`, or two dimensions such as `day,model` (a chart's series)."""
    names = group_by.split(",")
    if not 1 <= len(names) <= GROUP_BY_DIMENSIONS_MAX or len(set(names)) != len(names) or not set(names) <= set(known):
        raise InvalidInput(f"group_by is one of {', '.join(known)}, or two of them joined by a comma")
    return names


def usage(conn: Connection, account_id: int, group_by: str, since_day: str | None = None) -> list[dict]:
    """Usage from the read models, summed per day, model or API key (or two of them), from `since_day` (YYYY-MM-DD) on."""
    names = _groups(group_by, USAGE_GROUPS)
    columns = [usage_daily.c[USAGE_GROUPS[name]] for name in names]
    sums = [func.sum(usage_daily.c[name]).label(name) for name in USAGE_SUMS]
    query = select(*columns, *sums).where(usage_daily.c.account_id == account_id).group_by(*columns).order_by(*columns)
    if since_day:
        query = query.where(usage_daily.c.day >= since_day)
    return [{**{name: row[i] for i, name in enumerate(names)}, **{name: int(getattr(row, name)) for name in USAGE_SUMS}}
            for row in conn.execute(query)]


def earnings(conn: Connection, owner_account_id: int, group_by: str, since_day: str | None = None) -> list[dict]:
    """Earnings from the read models, summed per day, worker or model (or two of them), from `since_day` on."""
    names = _groups(group_by, EARNINGS_GROUPS)
    columns = [earnings_daily.c[EARNINGS_GROUPS[name]] for name in names]
    query = (select(*columns, func.sum(earnings_daily.c.requests).label("requests"),
                    func.sum(earnings_daily.c.earnings_nano_usd).label("earnings_nano_usd"))
             .where(earnings_daily.c.owner_account_id == owner_account_id).group_by(*columns).order_by(*columns))
    if since_day:
        query = query.where(earnings_daily.c.day >= since_day)
    return [{**{name: row[i] for i, name in enumerate(names)}, "requests": int(row.requests),
             "earnings_nano_usd": int(row.earnings_nano_usd)} for row in conn.execute(query)]


def usage_summary(conn: Connection, account_id: int, today: date) -> dict:
    """Spend today and over the last 7 and 30 days (today included), and how many days the
    available credits last at the last 7 days' rate (None while nothing was spent)."""
    rows = usage(conn, account_id, "day", _day_text(today, SUMMARY_WINDOW_DAYS_MAX))
    return _spend_summary(rows, acc.read_balance(conn, account_id).available_nano_usd, today)


def _spend_summary(rows: list[dict], available: int, today: date) -> dict:
    totals = _window_totals(rows, "cost_nano_usd", today)
    spent_rate = totals[RATE_WINDOW_DAYS]
    days_left = None if spent_rate <= 0 else max(0, available) * RATE_WINDOW_DAYS // spent_rate
    return {**{f"spend_{n}d_nano_usd": totals[n] for n in SUMMARY_WINDOWS_DAYS},
            "spend_nano_usd_per_day": spent_rate // RATE_WINDOW_DAYS, "available_nano_usd": available, "days_left": days_left}


def earnings_summary(conn: Connection, owner_account_id: int, today: date) -> dict:
    """Earnings today and over the last 7 and 30 days (today included)."""
    rows = earnings(conn, owner_account_id, "day", _day_text(today, SUMMARY_WINDOW_DAYS_MAX))
    return _earnings_totals(rows, today)


def _earnings_totals(rows: list[dict], today: date) -> dict:
    totals = _window_totals(rows, "earnings_nano_usd", today)
    return {f"earnings_{n}d_nano_usd": totals[n] for n in SUMMARY_WINDOWS_DAYS}


def usage_overview(conn: Connection, who: Principal, today: date) -> dict:
    """What a customer's overview shows, from one read of the window's usage by day and
    model: the balance (`account_view`), the spend summary (`usage_summary`), and the
    window's usage by day and model and by model (`usage`), equal to what each gives."""
    by_day_model = usage(conn, who.account_id, "day,model", _day_text(today, SUMMARY_WINDOW_DAYS_MAX))
    balance = account_view(conn, who)
    return {"balance": balance, "summary": _spend_summary(by_day_model, balance["available_nano_usd"], today),
            "by_day_model": by_day_model, "by_model": _summed_by(by_day_model, "model", USAGE_SUMS)}


def earnings_overview(conn: Connection, owner_account_id: int, today: date) -> dict:
    """What an owner's earnings page shows, from one read of the window's earnings by day,
    worker and model: the summary (`earnings_summary`) and the window's earnings by day and
    worker and by day and model (`earnings`), equal to what each gives."""
    names, sums = ("day", "worker", "model"), ("requests", "earnings_nano_usd")
    columns = [earnings_daily.c[EARNINGS_GROUPS[name]] for name in names]
    query = (select(*columns, *[func.sum(earnings_daily.c[name]).label(name) for name in sums])
             .where(earnings_daily.c.owner_account_id == owner_account_id,
                    earnings_daily.c.day >= _day_text(today, SUMMARY_WINDOW_DAYS_MAX)).group_by(*columns))
    rows = [{**dict(zip(names, row)), **{name: int(getattr(row, name)) for name in sums}} for row in conn.execute(query)]
    return {"summary": _earnings_totals(rows, today), "by_day_worker": _summed_by(rows, ("day", "worker"), sums),
            "by_day_model": _summed_by(rows, ("day", "model"), sums)}


def _summed_by(rows: list[dict], names: str | tuple[str, ...], sums: tuple[str, ...]) -> list[dict]:
    """Rows summed per value of `names`, ordered by them (as `usage` and `earnings` order theirs)."""
    names = (names,) if isinstance(names, str) else names
    totals: dict[tuple, list[int]] = {}
    for row in rows:
        total = totals.setdefault(tuple(row[name] for name in names), [0] * len(sums))
        for i, name in enumerate(sums):
            total[i] += row[name]
    return [{**dict(zip(names, key)), **dict(zip(sums, totals[key]))} for key in sorted(totals)]


def _day_text(today: date, days_back: int) -> str:
    """The first day of a window of `days_back` days that ends today."""
    return (today - timedelta(days=days_back - 1)).isoformat()


def _window_totals(rows: list[dict], column: str, today: date) -> dict[int, int]:
    return {n: sum(row[column] for row in rows if row["day"] >= _day_text(today, n)) for n in SUMMARY_WINDOWS_DAYS}
