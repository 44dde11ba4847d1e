"""The money core from the command line: `paralon migrate`, `credits`,
`balance`, `ledger` (verify, anchor, replay, export, reverse) and `holds`."""
from __future__ import annotations

import sys
import uuid
from contextlib import contextmanager

import click
from sqlalchemy.exc import ProgrammingError

from app.anchoring.service import read_anchors, write_anchor
from app.cli.output import emit, engine, fail, handles_errors, json_option, owner_engine, progress
from app.db_roles import grant_app_role, service_role
from app.migrate import migrate
from app.payments.payout_checks import payout_problems
from app.settings import Settings
from app.wiring import anchor_settings, payout_chain_settings, stripe_settings
from invoices import exports, reconciliation, statements
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.anchors import check_anchors, latest_matching
from ledger.db import snapshot_connection
from ledger.errors import InvalidInput
from ledger.events import GENESIS_HASH
from ledger.money import nano_usd_to_usd_text, usd_to_nano_usd
from ledger.schema import utc_now
from ledger.service import append_now, sweep_expired_holds
from ledger.store import set_postings_in_event_row
from ledger.verify import count_events, rebuild_balances, verify
from ledger.verify_since import Checkpoint, verify_since


@click.command("migrate")
@json_option
@handles_errors
def migrate_command(as_json: bool) -> None:
    """Create or upgrade the schema as the owner role (PARALON_MIGRATION_DATABASE_URL, else
    PARALON_DATABASE_URL); when the service's URL names another role, grant it the service's rights."""
    database = Settings.from_env().database
    db = owner_engine()
    revision = migrate(db)
    role = service_role(database.url, database.owner_url)
    if role:
        grant_app_role(db, role)
    emit(as_json, {"revision": revision, **({"service_role": role} if role else {})},
         f"database is at revision {revision}" + (f"; role {role} granted the service's rights" if role else ""))


def _append(command: cmd.Command, as_json: bool, what: str) -> None:
    result = append_now(engine(), command)
    emit(
        as_json,
        {"status": result.status, "seq": result.seq, "event_type": result.event_type, "idempotency_key": command.idempotency_key},
        f"{what}: event {result.seq} ({result.status})",
    )


@click.group("credits")
def credits_group() -> None:
    """Operator grants and adjustments (each with a reason)."""


@credits_group.command("grant")
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


@credits_group.command("adjust")
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


@click.command("balance")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def balance_command(account_id: int, as_json: bool) -> None:
    """Credits, holds and what is available (earnings for an owner)."""
    with engine().connect() as conn:
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
    emit(as_json, data, text)


@click.group("ledger")
def ledger_group() -> None:
    """Prove, rebuild and correct the ledger."""


@ledger_group.command("verify")
@click.option("--since-anchor", is_flag=True,
              help="Check the chain only from the newest anchor that matches (cheap after a restore); balances in full.")
@click.option("--chain-from-block", type=click.IntRange(min=0), default=None,
              help="Also scan the chain from this block (bounded) for the anchor wallet's anchors.")
@json_option
@handles_errors
def ledger_verify(since_anchor: bool, chain_from_block: int | None, as_json: bool) -> None:
    """Exit 0 when the chain, every zero sum, every balance and every anchor hold; 1 with a report otherwise."""
    # Anchors first: one written after the snapshot began could name a seq the snapshot cannot see.
    read = read_anchors(anchor_settings(Settings.from_env()), chain_from_block)
    with snapshot_connection(engine()) as conn:  # appends may go on meanwhile
        since = Checkpoint(0, GENESIS_HASH)
        if since_anchor and (start := latest_matching(conn, read.anchors)) is not None:
            since = Checkpoint(start.seq, start.hash)
        with progress(count_events(conn) - since.seq, "verifying") as bar:
            report = verify_since(conn, since, bar.update)[0] if since_anchor else verify(conn, progress=bar.update, processes=None)
        for finding in read.findings + check_anchors(conn, read.anchors) + payout_problems(conn):
            report.add(finding)
        rail_notes, rail_findings = payout_rail_problems(conn)
        for finding in rail_findings:
            report.add(finding)
    data = {"ok": report.ok, "events_checked": report.events_checked, "accounts_checked": report.accounts_checked,
            "problems_total": report.problems_total, "problems": report.problems,
            "anchors_checked": len(read.anchors), "anchor_notes": read.notes, "payout_notes": rail_notes}
    if since_anchor:
        data["since_seq"] = since.seq
    text = f"ok: {report.events_checked} events, {report.accounts_checked} accounts, {len(read.anchors)} anchors" if report.ok else "\n".join(
        [f"FAILED: {report.problems_total} problem(s)"] + report.problems
    )
    emit(as_json, data, "\n".join([text, *read.notes, *rail_notes]))
    sys.exit(0 if report.ok else 1)


def payout_rail_problems(conn) -> tuple[list[str], list[str]]:
    """The payouts' references on every configured rail (app/payments/payout_references.py); nothing when none is."""
    settings = Settings.from_env()
    chain, stripe = payout_chain_settings(settings), stripe_settings(settings)
    if chain.missing() and not stripe.secret_key:
        return [], []
    from app.payments.payout_references import rail_problems  # web3 and Stripe load only when a rail is configured

    return rail_problems(conn, chain, stripe)


@ledger_group.command("anchor")
@json_option
@handles_errors
def ledger_anchor(as_json: bool) -> None:
    """Write the chain's head outside the database now: a line in PARALON_ANCHOR_FILE, and a
    transaction on PARALON_CHAIN_RPC_URL when PARALON_ANCHOR_WALLET_KEY is set (exit 1 if that failed)."""
    written = write_anchor(engine(), anchor_settings(Settings.from_env()))
    where = f"{written['file']}" + (f" and chain {written['chain_id']} tx {written['tx_hash']}" if written["tx_hash"] else "")
    text = f"anchored seq {written['seq']} hash {written['hash']} in {where}"
    emit(as_json, written, text if not written["chain_error"] else f"{text}; NOT on the chain: {written['chain_error']}")
    sys.exit(1 if written["chain_error"] else 0)


INSUFFICIENT_PRIVILEGE = "42501"  # PostgreSQL's SQLSTATE: e.g. not the owner of the table


@contextmanager
def _as_the_owner(as_json: bool, what: str):
    """The database's refusal of the service's role, as one line (exit 2)."""
    try:
        yield
    except ProgrammingError as exc:
        if getattr(exc.orig, "sqlstate", None) != INSUFFICIENT_PRIVILEGE:
            raise
        fail(as_json, "not_the_owner", f"{what}: run it as the owner role (PARALON_MIGRATION_DATABASE_URL)")


@ledger_group.command("replay")
@json_option
@handles_errors
def ledger_replay(as_json: bool) -> None:
    """Rebuild the read models (balances) from the first event, as the owner role (PARALON_MIGRATION_DATABASE_URL)."""
    db = owner_engine()
    with db.connect() as conn:
        total = count_events(conn)
    with _as_the_owner(as_json, "replay rewrites balances past their guard"):
        with db.begin() as conn, progress(total, "replaying") as bar:
            accounts_rebuilt = rebuild_balances(conn, progress=bar.update)
    emit(as_json, {"events_replayed": total, "accounts_rebuilt": accounts_rebuilt},
         f"replayed {total} events into {accounts_rebuilt} account balances")


@ledger_group.command("postings-in-event-row")
@click.argument("state", type=click.Choice(["on", "off"]))
@json_option
@handles_errors
def ledger_postings_in_event_row(state: str, as_json: bool) -> None:
    """Where appends put postings from now on, as the owner role (PARALON_MIGRATION_DATABASE_URL):
    in each event's own row (on: fewer bytes and less time under the append lock; PostgreSQL) or as
    ledger_postings rows (off). Turn it on only once every replica runs a release with migration 0031,
    which reads postings from both."""
    on = state == "on"
    with _as_the_owner(as_json, "the service's role may not move postings"), owner_engine().begin() as conn:
        was_on = set_postings_in_event_row(conn, on)
    emit(as_json, {"postings_in_event_row": on, "was": was_on},
         f"appends put postings {'in their event row' if on else 'in ledger_postings rows'}"
         + (" (already so)" if was_on == on else ""))


@ledger_group.command("export")
@click.argument("account_id", type=int)
@click.option("--from", "start_text", required=True, help="YYYY-MM or YYYY-MM-DD (UTC), inclusive")
@click.option("--to", "end_text", required=True, help="YYYY-MM or YYYY-MM-DD (UTC), exclusive")
@click.option("--output", type=click.Path(dir_okay=False, writable=True), default="-", show_default=True)
@handles_errors
def ledger_export(account_id: int, start_text: str, end_text: str, output: str) -> None:
    """Every posting of ACCOUNT_ID in [from, to) as CSV, with the running balance (what GET /v1/exports/ledger.csv sends)."""
    start, end = exports.parse_period_bound(start_text, "--from"), exports.parse_period_bound(end_text, "--to")
    if end <= start:
        raise InvalidInput("--to must be after --from")
    db = engine()
    with db.connect() as conn:
        acc.require_kind(conn, account_id, (cmd.CUSTOMER, cmd.OWNER, cmd.PLATFORM, cmd.EXTERNAL), "")  # exists
    end = min(end, utc_now())
    totals = exports.prepare(db, account_id, start, end)
    with click.open_file(output, "wb") as out, progress(totals.postings, "exporting") as bar:
        for chunk in exports.csv_chunks(db, account_id, start, end, totals):
            out.write(chunk)
            bar.update(chunk.count(b"\n"))
    click.echo(f"{totals.postings} postings; opening {nano_usd_to_usd_text(totals.opening_balance_nano_usd)} USD, "
               f"closing {nano_usd_to_usd_text(totals.closing_balance_nano_usd)} USD", err=True)


@ledger_group.command("reconcile")
@click.argument("account_id", type=int)
@click.option("--from", "first_text", required=True, help="YYYY-MM (UTC): the first month")
@click.option("--to", "after_text", required=True, help="YYYY-MM (UTC): the month after the last")
@json_option
@handles_errors
def ledger_reconcile(account_id: int, first_text: str, after_text: str, as_json: bool) -> None:
    """Opening balance + top-ups, grants, usage (earnings), refunds, disputes, adjustments = closing balance of
    ACCOUNT_ID over the months [from, to), as the statements and the export state them; exit 1 when it does not balance."""
    figures = reconciliation.reconcile(engine(), account_id, statements.parse_month(first_text), statements.parse_month(after_text))
    amounts = [f"{name.removesuffix('_nano_usd')}: {nano_usd_to_usd_text(value)} USD" for name, value in figures.items()
               if name.endswith("_nano_usd")]
    verdict = "balanced" if figures["balanced"] else "NOT BALANCED\n" + "\n".join(figures["problems"])
    emit(as_json, figures, "\n".join([f"account {account_id} {figures['from']} to {figures['to']}, through event "
                                       f"{figures['through_seq']}{' (provisional)' if figures['provisional'] else ''}",
                                       *amounts, verdict]))
    sys.exit(0 if figures["balanced"] else 1)


@ledger_group.command("reverse")
@click.argument("seq", type=int)
@click.option("--reason", required=True)
@json_option
@handles_errors
def ledger_reverse(seq: int, reason: str, as_json: bool) -> None:
    """Undo an event with a new event that negates its postings."""
    _append(cmd.ReverseEvent(seq, reason, f"reverse:{seq}"), as_json, f"reversed event {seq}")


@click.group("holds")
def holds_group() -> None:
    """Reservations placed by the proxy."""


@holds_group.command("expire")
@json_option
@handles_errors
def holds_expire(as_json: bool) -> None:
    """Close holds past their expiry (what the sweeper does): released when
    nothing was delivered, settled at the recorded usage when something was."""
    swept = sweep_expired_holds(engine())
    emit(as_json, {"expired": swept.released, "settled": swept.settled},
         f"released {swept.released} expired hold(s), settled {swept.settled} at their recorded usage")


COMMANDS = (migrate_command, credits_group, balance_command, ledger_group, holds_group)
