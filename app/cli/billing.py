"""The paperwork: `paralon invoices`, `statements` and `projections` (the
read models statements are built from)."""
from __future__ import annotations

import click
from sqlalchemy import select

from app.accounts import INVOICE_KINDS
from app.cli.output import emit, engine, handles_errors, json_option, progress
from app import wiring
from app.documents_zip import documents_zip
from app.settings import Settings
from app.statement_labels import statement_labels
from invoices import exports, read_models
from invoices import statements as st
from invoices.files import DocumentUnavailable
from invoices.mail import send_invoice
from invoices.schema import invoices as invoices_table
from invoices.service import InvoiceSettings, issue_for_top_up, list_invoices
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.money import nano_usd_to_usd_text
from ledger.schema import utc_now
from ledger.verify import count_events


def _invoice_settings() -> InvoiceSettings:
    return wiring.invoice_settings(Settings.from_env())


@click.group("invoices")
def invoices_group() -> None:
    """Invoices for credited top-ups (PDF/A-3b, numbered per series and year)."""


@invoices_group.command("issue")
@click.argument("event_seq", type=int)
@json_option
@handles_errors
def invoices_issue(event_seq: int, as_json: bool) -> None:
    """Issue (or show) the invoice of the top-up recorded as ledger event EVENT_SEQ."""
    invoice = issue_for_top_up(engine(), _invoice_settings(), event_seq)
    emit(as_json, invoice, f"{invoice['number']}: {invoice['pdf_path']}")


@invoices_group.command("zip")
@click.argument("account_id", type=int)
@click.option("--from", "start_text", required=True, help="YYYY-MM or YYYY-MM-DD (UTC), inclusive")
@click.option("--to", "end_text", required=True, help="YYYY-MM or YYYY-MM-DD (UTC), exclusive")
@click.option("--kind", type=click.Choice(INVOICE_KINDS), default=None, help="Only this kind (then no statements).")
@click.option("--output", type=click.Path(dir_okay=False, writable=True), required=True)
@json_option
@handles_errors
def invoices_zip(account_id: int, start_text: str, end_text: str, kind: str | None, output: str, as_json: bool) -> None:
    """The invoices and credit notes of ACCOUNT_ID issued in [from, to) and the stored statements of the months
    inside it, as PDFs with manifest.csv (what GET /v1/invoices.zip sends); nothing is written if any is unavailable."""
    start, end = exports.parse_period_bound(start_text, "--from"), exports.parse_period_bound(end_text, "--to")
    db = engine()
    with db.connect() as conn:
        acc.require_kind(conn, account_id, (cmd.CUSTOMER, cmd.OWNER, cmd.PLATFORM, cmd.EXTERNAL), "")  # exists
    zipped = documents_zip(db, _invoice_settings(), account_id, kind, start, end)
    with click.open_file(output, "wb", atomic=True) as out:
        out.write(zipped.content)
    emit(as_json, {"output": output, "bytes": len(zipped.content), "documents": zipped.manifest},
         f"{len(zipped.manifest)} documents, {len(zipped.content)} bytes: {output}")


@invoices_group.command("email-pending")
@json_option
@handles_errors
def invoices_email_pending(as_json: bool) -> None:
    """Email every issued invoice not emailed yet (PARALON_SMTP_HOST)."""
    db = engine()
    with db.connect() as conn:
        numbers = conn.execute(select(invoices_table.c.number).where(invoices_table.c.emailed_at.is_(None),
                                                                     invoices_table.c.pdf_path.is_not(None))).scalars().all()
    mail, documents = wiring.mail_settings(Settings.from_env()), _invoice_settings()
    outcomes = {number: _email_one(db, mail, number, documents) for number in numbers}
    emit(as_json, {"outcomes": outcomes}, "\n".join(f"{n}: {o}" for n, o in outcomes.items()) or "nothing to send")


def _email_one(db, mail, number: str, documents: InvoiceSettings) -> str:
    try:
        return send_invoice(db, mail, number, documents)
    except DocumentUnavailable as exc:  # one bad file does not hold up the others' mail
        return f"failed: {exc}"


@invoices_group.command("list")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def invoices_list(account_id: int, as_json: bool) -> None:
    listed = list_invoices(engine(), account_id)
    emit(as_json, {"invoices": listed}, "\n".join(f"{i['number']}\t{i['amount_nano_usd']}\t{i['pdf_path']}" for i in listed))


@click.group("statements")
def statements_group() -> None:
    """Monthly statements (UTC months): customers' balances and usage, owners' earnings."""


def _month(text: str | None) -> st.Month:
    return st.parse_month(text) if text else st.previous_month(utc_now())


@statements_group.command("issue")
@click.option("--month", "month_text", default=None, help="YYYY-MM; default: the month before this one")
@click.option("--account", "account_id", type=int, default=None, help="One account; default: every customer and owner with activity")
@json_option
@handles_errors
def statements_issue(month_text: str | None, account_id: int | None, as_json: bool) -> None:
    """Issue the statements of a closed month not issued yet, after checking the read models against the ledger."""
    db, month = engine(), _month(month_text)
    account_ids = [account_id] if account_id is not None else st.missing_statements(db, month)
    issued = []
    with progress(len(account_ids), f"statements {month.text}") as bar:
        for one in account_ids:
            issued.append(st.issue(db, _invoice_settings(), one, month, statement_labels, month_reconciled=account_id is None))
            bar.update(1)
    emit(as_json, {"month": month.text, "statements": issued}, "\n".join(f"{s['account_id']}\t{s['pdf_path']}" for s in issued) or "no accounts")


@statements_group.command("show")
@click.argument("account_id", type=int)
@click.option("--month", "month_text", default=None, help="YYYY-MM; default: the month before this one")
@json_option
@handles_errors
def statements_show(account_id: int, month_text: str | None, as_json: bool) -> None:
    """The figures of a month's statement (provisional while the month is open)."""
    figures = st.figures(engine(), _invoice_settings(), account_id, _month(month_text), statement_labels)
    lines = [f"{figures['month']} account {account_id}{' (provisional)' if figures['provisional'] else ''}",
             f"opening {nano_usd_to_usd_text(figures['opening_balance_nano_usd'])} USD",
             *(f"{s['title']}: {nano_usd_to_usd_text(s['amount_nano_usd'])} USD ({s['postings']} postings)" for s in figures["sections"]),
             f"closing {nano_usd_to_usd_text(figures['closing_balance_nano_usd'])} USD"]
    emit(as_json, figures, "\n".join(lines))


@statements_group.command("list")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def statements_list(account_id: int, as_json: bool) -> None:
    with engine().connect() as conn:
        listed = st.list_statements(conn, account_id)
    emit(as_json, {"statements": listed}, "\n".join(f"{s['month']}\t{s['closing_balance_nano_usd']}\t{s['pdf_path']}" for s in listed))


@click.group("projections")
def projections_group() -> None:
    """Read models of the log: usage and earnings per day."""


@projections_group.command("rebuild")
@json_option
@handles_errors
def projections_rebuild(as_json: bool) -> None:
    """Rebuild the read models from the first event, with a progress bar."""
    db = engine()
    with db.connect() as conn:
        total = count_events(conn)
    with progress(total, "rebuilding") as bar:
        applied = read_models.rebuild(db, progress=bar.update)
    emit(as_json, {"events_applied": applied, "lag_events": read_models.lag_events(db)}, f"applied {applied} events")


@projections_group.command("lag")
@json_option
@handles_errors
def projections_lag(as_json: bool) -> None:
    """Events the read models have not applied yet."""
    lag = read_models.lag_events(engine())
    emit(as_json, {"consumer": read_models.CONSUMER, "lag_events": lag}, f"{read_models.CONSUMER}: {lag} events behind")


COMMANDS = (invoices_group, statements_group, projections_group)
