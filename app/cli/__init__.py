"""`paralon`: the operator's command line. Every command takes --json; money
fields are integers with the unit in the key."""
from __future__ import annotations

import json
import sys
import uuid
from functools import wraps

import click
from sqlalchemy.exc import OperationalError

from app import wiring
from app.settings import Settings
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.db import make_engine
from ledger.errors import InvalidInput, LedgerError
from ledger.money import nano_usd_to_usd_text, usd_to_nano_usd
from ledger.schema import utc_now
from ledger.service import append_now, sweep_expired_holds
from ledger.verify import count_events, rebuild_balances, verify

EXIT_INVALID = 2


def _emit(as_json: bool, data: dict, text: str) -> None:
    click.echo(json.dumps(data, sort_keys=True) if as_json else text)


def _fail(as_json: bool, code: str, message: str) -> None:
    if as_json:
        click.echo(json.dumps({"error": {"code": code, "message": message}}), err=True)
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_INVALID)


def handles_errors(fn):
    """Typed errors become one clear line (or JSON) and exit status 2; nothing was written."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except LedgerError as exc:
            _fail(as_json, exc.code, str(exc))
        except ValueError as exc:
            _fail(as_json, "invalid_input", str(exc))
        except OperationalError as exc:
            _fail(as_json, "database_unreachable", f"cannot use the database: {exc.orig}")

    return wrapper


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def _engine():
    return make_engine(Settings.from_env().database.url)


def _progress(total: int, label: str):
    return click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True)


@click.group()
def main() -> None:
    """Paralon: the money and traffic layer of a GPU inference network."""


@main.command("migrate")
@json_option
@handles_errors
def migrate_cmd(as_json: bool) -> None:
    """Create or upgrade the schema (PARALON_DATABASE_URL)."""
    from app.migrate import migrate

    revision = migrate(_engine())
    _emit(as_json, {"revision": revision}, f"database is at revision {revision}")


@main.group()
def accounts() -> None:
    """Customer and GPU-owner accounts."""


@accounts.command("create")
@click.option("--kind", type=click.Choice([cmd.CUSTOMER, cmd.OWNER]), required=True)
@click.option("--name", required=True)
@click.option("--email", default=None, help="Where invoices and statements go.")
@json_option
@handles_errors
def accounts_create(kind: str, name: str, email: str | None, as_json: bool) -> None:
    with _engine().begin() as conn:
        account_id = acc.create_account(conn, kind, name, email)
    _emit(as_json, {"id": account_id, "kind": kind, "name": name, "email": email}, f"created {kind} account {account_id}")


@main.group()
def tokens() -> None:
    """Management tokens (roles: customer, accountant, owner, admin), shown once, stored hashed."""


@tokens.command("create")
@click.argument("account_id", type=int)
@click.option("--role", type=click.Choice(["customer", "accountant", "owner", "admin"]), required=True,
              help="admin tokens act for the platform account (`paralon accounts platform`).")
@json_option
@handles_errors
def tokens_create(account_id: int, role: str, as_json: bool) -> None:
    from app.tokens import create_token

    with _engine().begin() as conn:
        token_id, token = create_token(conn, account_id, role)
    _emit(as_json, {"id": token_id, "token": token, "account_id": account_id, "role": role},
          f"{role} token {token_id}: {token}\n(shown once: store it now)")


@tokens.command("revoke")
@click.argument("token_id", type=int)
@json_option
@handles_errors
def tokens_revoke(token_id: int, as_json: bool) -> None:
    from app.tokens import revoke_token

    with _engine().begin() as conn:
        revoke_token(conn, token_id)
    _emit(as_json, {"id": token_id, "revoked": True}, f"management token {token_id} revoked")


@accounts.command("platform")
@json_option
@handles_errors
def accounts_platform(as_json: bool) -> None:
    """The platform's own account (what admin tokens act for)."""
    from sqlalchemy import select

    from ledger.schema import accounts as accounts_table

    with _engine().connect() as conn:
        account_id = conn.execute(select(accounts_table.c.id).where(accounts_table.c.system_code == "platform:revenue")).scalar_one()
    _emit(as_json, {"id": account_id}, f"platform account {account_id}")


@main.group()
def stripe() -> None:
    """Card top-ups through Stripe."""


@stripe.command("process-pending")
@json_option
@handles_errors
def stripe_process_pending(as_json: bool) -> None:
    """Process stored webhook events that were not processed yet."""
    from app.payments.stripe import process_pending

    done = process_pending(_engine())
    _emit(as_json, {"processed": [{"event_id": e, "outcome": o} for e, o in done]},
          "\n".join(f"{e}: {o}" for e, o in done) or "nothing pending")


@main.group()
def crypto() -> None:
    """Stablecoin top-ups: deposit addresses and the chain scanner."""


@crypto.command("deposit-address")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def crypto_deposit_address(account_id: int, as_json: bool) -> None:
    from app.payments.crypto import connect, deposit_address

    settings = wiring.crypto_settings(Settings.from_env())
    address = deposit_address(_engine(), settings, account_id)
    chain_id = connect(settings).eth.chain_id if settings.rpc_url else None
    _emit(as_json, {"account_id": account_id, "address": address, "chain_id": chain_id}, f"{address} (chain {chain_id})")


@crypto.command("scan")
@click.option("--once", is_flag=True, help="One bounded scan, then exit (otherwise scan every --interval-s).")
@click.option("--interval-s", default=15.0, show_default=True, type=click.FloatRange(0.1, 3600))
@json_option
@handles_errors
def crypto_scan(once: bool, interval_s: float, as_json: bool) -> None:
    """Credit confirmed deposits; notice reorganisations; resume where the last scan stopped."""
    import dataclasses
    import time

    from app.payments.crypto import connect, scan_once

    settings = wiring.crypto_settings(Settings.from_env())
    engine, w3 = _engine(), connect(settings)
    while True:
        report = dataclasses.asdict(scan_once(engine, w3, settings))
        _emit(as_json, report, " ".join(f"{k}={v}" for k, v in report.items()))
        if once:
            return
        time.sleep(interval_s)


@main.command("worker", context_settings={"ignore_unknown_options": True})
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker_cmd(celery_args) -> None:
    """A Celery worker (PARALON_CELERY_BROKER_URL); extra arguments go to Celery."""
    from app.jobs.celery import celery

    celery.worker_main(["worker", "--loglevel=INFO", *celery_args])


@main.command("beat", context_settings={"ignore_unknown_options": True})
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def beat_cmd(celery_args) -> None:
    """The scheduler (exactly one per deployment): the deposit scan, and later the monthly statements."""
    from app.jobs.celery import celery

    celery.start(["beat", "--loglevel=INFO", *celery_args])


@main.group()
def invoices() -> None:
    """Invoices for credited top-ups (PDF/A-3b, numbered per series and year)."""


def _invoice_settings():
    return wiring.invoice_settings(Settings.from_env())


@invoices.command("issue")
@click.argument("event_seq", type=int)
@json_option
@handles_errors
def invoices_issue(event_seq: int, as_json: bool) -> None:
    """Issue (or show) the invoice of the top-up recorded as ledger event EVENT_SEQ."""
    from invoices.service import issue_for_top_up

    invoice = issue_for_top_up(_engine(), _invoice_settings(), event_seq)
    _emit(as_json, invoice, f"{invoice['number']}: {invoice['pdf_path']}")


@invoices.command("email-pending")
@json_option
@handles_errors
def invoices_email_pending(as_json: bool) -> None:
    """Email every issued invoice not emailed yet (PARALON_SMTP_HOST)."""
    from sqlalchemy import select

    from invoices.mail import send_invoice
    from invoices.schema import invoices as invoices_table

    engine = _engine()
    with engine.connect() as conn:
        numbers = conn.execute(select(invoices_table.c.number).where(invoices_table.c.emailed_at.is_(None),
                                                                     invoices_table.c.pdf_path.is_not(None))).scalars().all()
    outcomes = {number: send_invoice(engine, wiring.mail_settings(Settings.from_env()), number) for number in numbers}
    _emit(as_json, {"outcomes": outcomes}, "\n".join(f"{n}: {o}" for n, o in outcomes.items()) or "nothing to send")


@invoices.command("list")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def invoices_list(account_id: int, as_json: bool) -> None:
    from invoices.service import list_invoices

    listed = list_invoices(_engine(), account_id)
    _emit(as_json, {"invoices": listed}, "\n".join(f"{i['number']}\t{i['amount_nano_usd']}\t{i['pdf_path']}" for i in listed))


@main.group()
def statements() -> None:
    """Monthly statements (UTC months): customers' balances and usage, owners' earnings."""


def _month(text: str | None):
    from invoices.statements import parse_month, previous_month

    return parse_month(text) if text else previous_month(utc_now())


@statements.command("issue")
@click.option("--month", "month_text", default=None, help="YYYY-MM; default: the month before this one")
@click.option("--account", "account_id", type=int, default=None, help="One account; default: every customer and owner with activity")
@json_option
@handles_errors
def statements_issue(month_text: str | None, account_id: int | None, as_json: bool) -> None:
    """Issue the statements of a closed month not issued yet, after checking the read models against the ledger."""
    from app.statement_labels import statement_labels
    from invoices import statements as st

    engine, month = _engine(), _month(month_text)
    account_ids = [account_id] if account_id is not None else st.missing_statements(engine, month)
    issued = []
    with _progress(len(account_ids), f"statements {month.text}") as bar:
        for one in account_ids:
            issued.append(st.issue(engine, _invoice_settings(), one, month, statement_labels, month_reconciled=account_id is None))
            bar.update(1)
    _emit(as_json, {"month": month.text, "statements": issued}, "\n".join(f"{s['account_id']}\t{s['pdf_path']}" for s in issued) or "no accounts")


@statements.command("show")
@click.argument("account_id", type=int)
@click.option("--month", "month_text", default=None, help="YYYY-MM; default: the month before this one")
@json_option
@handles_errors
def statements_show(account_id: int, month_text: str | None, as_json: bool) -> None:
    """The figures of a month's statement (provisional while the month is open)."""
    from app.statement_labels import statement_labels
    from invoices import statements as st

    figures = st.figures(_engine(), _invoice_settings(), account_id, _month(month_text), statement_labels)
    lines = [f"{figures['month']} account {account_id}{' (provisional)' if figures['provisional'] else ''}",
             f"opening {nano_usd_to_usd_text(figures['opening_balance_nano_usd'])} USD",
             *(f"{s['title']}: {nano_usd_to_usd_text(s['amount_nano_usd'])} USD ({s['postings']} postings)" for s in figures["sections"]),
             f"closing {nano_usd_to_usd_text(figures['closing_balance_nano_usd'])} USD"]
    _emit(as_json, figures, "\n".join(lines))


@statements.command("list")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def statements_list(account_id: int, as_json: bool) -> None:
    from invoices.statements import list_statements

    with _engine().connect() as conn:
        listed = list_statements(conn, account_id)
    _emit(as_json, {"statements": listed}, "\n".join(f"{s['month']}\t{s['closing_balance_nano_usd']}\t{s['pdf_path']}" for s in listed))


@main.group()
def projections() -> None:
    """Read models of the log: usage and earnings per day."""


@projections.command("rebuild")
@json_option
@handles_errors
def projections_rebuild(as_json: bool) -> None:
    """Rebuild the read models from the first event, with a progress bar."""
    from invoices import read_models

    engine = _engine()
    with engine.connect() as conn:
        total = count_events(conn)
    with _progress(total, "rebuilding") as bar:
        applied = read_models.rebuild(engine, progress=bar.update)
    _emit(as_json, {"events_applied": applied, "lag_events": read_models.lag_events(engine)}, f"applied {applied} events")


@projections.command("lag")
@json_option
@handles_errors
def projections_lag(as_json: bool) -> None:
    """Events the read models have not applied yet."""
    from invoices import read_models

    lag = read_models.lag_events(_engine())
    _emit(as_json, {"consumer": read_models.CONSUMER, "lag_events": lag}, f"{read_models.CONSUMER}: {lag} events behind")


@main.group()
def credits() -> None:
    """Operator grants and adjustments (each with a reason)."""


def _append(command: cmd.Command, as_json: bool, what: str) -> None:
    result = append_now(_engine(), command)
    _emit(
        as_json,
        {"status": result.status, "seq": result.seq, "event_type": result.event_type, "idempotency_key": command.idempotency_key},
        f"{what}: event {result.seq} ({result.status})",
    )


@credits.command("grant")
@click.argument("account_id", type=int)
@click.option("--usd", required=True, help="Amount in USD, e.g. 12.50")
@click.option("--reason", required=True)
@click.option("--idempotency-key", default=None, help="Retry-safe key; the same key with another amount is refused.")
@json_option
@handles_errors
def credits_grant(account_id: int, usd: str, reason: str, idempotency_key: str | None, as_json: bool) -> None:
    amount = usd_to_nano_usd(usd)
    key = idempotency_key or f"grant:{uuid.uuid4()}"
    _append(cmd.GrantCredits(account_id, amount, reason, key), as_json, f"granted {usd} USD to account {account_id}")


@credits.command("adjust")
@click.argument("account_id", type=int)
@click.option("--usd", required=True, help="Signed amount in USD, e.g. -1.25")
@click.option("--reason", required=True)
@click.option("--idempotency-key", default=None)
@json_option
@handles_errors
def credits_adjust(account_id: int, usd: str, reason: str, idempotency_key: str | None, as_json: bool) -> None:
    delta = usd_to_nano_usd(usd)
    key = idempotency_key or f"adjust:{uuid.uuid4()}"
    _append(cmd.AdjustBalance(account_id, delta, reason, key), as_json, f"adjusted account {account_id} by {usd} USD")


@main.command("balance")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def balance_cmd(account_id: int, as_json: bool) -> None:
    """Credits, holds and what is available (earnings for an owner)."""
    with _engine().connect() as conn:
        view = acc.read_balance(conn, account_id)
    data = {
        "account_id": account_id,
        "kind": view.kind,
        "balance_nano_usd": view.balance_nano_usd,
        "available_nano_usd": view.available_nano_usd,
        "held_nano_usd": view.held_nano_usd,
        "last_event_seq": view.last_event_seq,
    }
    if view.kind == cmd.OWNER:
        data["earnings_nano_usd"] = view.balance_nano_usd
    text = "\n".join(f"{k}: {v}" for k, v in data.items())
    _emit(as_json, data, text)


@main.group()
def ledger() -> None:
    """Prove, rebuild and correct the ledger."""


@ledger.command("verify")
@json_option
@handles_errors
def ledger_verify(as_json: bool) -> None:
    """Exit 0 when the chain, every zero sum and every balance hold; 1 with a report otherwise."""
    with _engine().connect() as conn:
        total = count_events(conn)
        with _progress(total, "verifying") as bar:
            report = verify(conn, progress=bar.update)
    data = {"ok": report.ok, "events_checked": report.events_checked, "accounts_checked": report.accounts_checked,
            "problems_total": report.problems_total, "problems": report.problems}
    text = f"ok: {report.events_checked} events, {report.accounts_checked} accounts" if report.ok else "\n".join(
        [f"FAILED: {report.problems_total} problem(s)"] + report.problems
    )
    _emit(as_json, data, text)
    sys.exit(0 if report.ok else 1)


@ledger.command("replay")
@json_option
@handles_errors
def ledger_replay(as_json: bool) -> None:
    """Rebuild the read models (balances) from the first event."""
    engine = _engine()
    with engine.connect() as conn:
        total = count_events(conn)
    with engine.begin() as conn, _progress(total, "replaying") as bar:
        accounts_rebuilt = rebuild_balances(conn, progress=bar.update)
    _emit(as_json, {"events_replayed": total, "accounts_rebuilt": accounts_rebuilt},
          f"replayed {total} events into {accounts_rebuilt} account balances")


@ledger.command("export")
@click.argument("account_id", type=int)
@click.option("--from", "start_text", required=True, help="YYYY-MM or YYYY-MM-DD (UTC), inclusive")
@click.option("--to", "end_text", required=True, help="YYYY-MM or YYYY-MM-DD (UTC), exclusive")
@click.option("--output", type=click.Path(dir_okay=False, writable=True), default="-", show_default=True)
@handles_errors
def ledger_export(account_id: int, start_text: str, end_text: str, output: str) -> None:
    """Every posting of ACCOUNT_ID in [from, to) as CSV, with the running balance (what GET /v1/exports/ledger.csv sends)."""
    from invoices import exports

    start, end = exports.parse_period_bound(start_text, "--from"), exports.parse_period_bound(end_text, "--to")
    if end <= start:
        raise InvalidInput("--to must be after --from")
    engine = _engine()
    with engine.connect() as conn:
        acc.require_kind(conn, account_id, (cmd.CUSTOMER, cmd.OWNER, cmd.PLATFORM, cmd.EXTERNAL), "")  # exists
    end = min(end, utc_now())
    totals = exports.prepare(engine, account_id, start, end)
    with click.open_file(output, "wb") as out, _progress(totals.postings, "exporting") as bar:
        for chunk in exports.csv_chunks(engine, account_id, start, end, totals):
            out.write(chunk)
            bar.update(chunk.count(b"\n"))
    click.echo(f"{totals.postings} postings; opening {nano_usd_to_usd_text(totals.opening_balance_nano_usd)} USD, "
               f"closing {nano_usd_to_usd_text(totals.closing_balance_nano_usd)} USD", err=True)


@ledger.command("reverse")
@click.argument("seq", type=int)
@click.option("--reason", required=True)
@json_option
@handles_errors
def ledger_reverse(seq: int, reason: str, as_json: bool) -> None:
    """Undo an event with a new event that negates its postings."""
    _append(cmd.ReverseEvent(seq, reason, f"reverse:{seq}"), as_json, f"reversed event {seq}")


@main.group()
def holds() -> None:
    """Reservations placed by the proxy."""


@holds.command("expire")
@json_option
@handles_errors
def holds_expire(as_json: bool) -> None:
    """Close holds past their expiry (what the sweeper does): released when
    nothing was delivered, settled at the recorded usage when something was."""
    swept = sweep_expired_holds(_engine())
    _emit(as_json, {"expired": swept.released, "settled": swept.settled},
          f"released {swept.released} expired hold(s), settled {swept.settled} at their recorded usage")


@main.command("demo")
@handles_errors
def demo_cmd() -> None:
    """A short scripted tour of the ledger on the configured database."""
    from app.cli.demo import run_demo

    settings = Settings.from_env()
    run_demo(make_engine(settings.database.url), settings)


from app.cli.proxy import register as _register_proxy_commands  # noqa: E402

_register_proxy_commands(main, _emit, handles_errors, json_option)
