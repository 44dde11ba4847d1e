"""Top-ups from the command line: `paralon stripe` and `paralon crypto`. What
they credit is invoiced through the outbox, dispatched once their commits are done."""
from __future__ import annotations

import dataclasses
import sys
import time

import click

from app.cli.output import emit, engine, handles_errors, json_option
from app import outbox
from app.jobs.celery import send_task
from app.limits import CRYPTO_SCAN_INTERVAL_S_DEFAULT, CRYPTO_SCAN_INTERVAL_S_MAX, CRYPTO_SCAN_INTERVAL_S_MIN
from app.payments.crypto import connect, scan_once
from app.payments.deposits import deposit_address, pending_deposits
from app.payments.stripe import parked_events, process_pending, replay
from app import wiring
from app.settings import Settings


@click.group("stripe")
def stripe_group() -> None:
    """Card top-ups through Stripe."""


@stripe_group.command("process-pending")
@json_option
@handles_errors
def stripe_process_pending(as_json: bool) -> None:
    """Process stored webhook events that were not processed yet, and parked ones
    whose next attempt is due; one that fails is parked again (see `failed`)."""
    db = engine()
    done = process_pending(db, wiring.stripe_settings(Settings.from_env()))
    outbox.dispatch(db, send_task)
    emit(as_json, {"processed": [{"event_id": e, "outcome": o} for e, o in done]},
         "\n".join(f"{e}: {o}" for e, o in done) or "nothing pending")


def _plain(event: dict) -> dict:
    return {k: v.isoformat() if hasattr(v, "isoformat") else v for k, v in event.items()}


@stripe_group.command("failed")
@json_option
@handles_errors
def stripe_failed(as_json: bool) -> None:
    """Parked events: why each failed, its attempts and when the next is due (none: replay it)."""
    parked = [_plain(e) for e in parked_events(engine())]
    emit(as_json, {"failed": parked}, "\n".join(
        f"{e['event_id']} {e['event_type']} attempts={e['attempts']} next={e['next_attempt_at'] or 'replay only'}: {e['last_error']}"
        for e in parked) or "no parked events")


@stripe_group.command("replay")
@click.argument("event_id")
@json_option
@handles_errors
def stripe_replay(event_id: str, as_json: bool) -> None:
    """Process one stored, unprocessed event now. Exit 0 when processed (or waiting
    for its payment), 1 when it failed again and stays parked."""
    db = engine()
    result = _plain(replay(db, wiring.stripe_settings(Settings.from_env()), event_id))
    outbox.dispatch(db, send_task)
    emit(as_json, result, f"{event_id}: {result['status']}: {result['outcome']}")
    if result["status"] == "parked":
        sys.exit(1)


@click.group("crypto")
def crypto_group() -> None:
    """Stablecoin top-ups: deposit addresses and the chain scanner."""


@crypto_group.command("deposit-address")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def crypto_deposit_address(account_id: int, as_json: bool) -> None:
    settings = wiring.crypto_settings(Settings.from_env())
    address = deposit_address(engine(), settings, account_id)
    chain_id = connect(settings).eth.chain_id if settings.rpc_url else None
    emit(as_json, {"account_id": account_id, "address": address, "chain_id": chain_id}, f"{address} (chain {chain_id})")


@crypto_group.command("deposits")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def crypto_deposits(account_id: int, as_json: bool) -> None:
    """Deposits seen on chain and not yet credited, with their confirmations as of the last scan."""
    settings = wiring.crypto_settings(Settings.from_env())
    with engine().connect() as conn:
        found = pending_deposits(conn, account_id, settings.confirmations)
    emit(as_json, {"data": found}, "\n".join(
        f"{d['tx_hash']}:{d['log_index']} {d['amount_nano_usd']} nano-USD, {d['confirmations']}/{d['confirmations_required']} confirmations"
        for d in found) or "no pending deposits")


@crypto_group.command("scan")
@click.option("--once", is_flag=True, help="One bounded scan, then exit (otherwise scan every --interval-s).")
@click.option("--interval-s", default=CRYPTO_SCAN_INTERVAL_S_DEFAULT, show_default=True,
              type=click.FloatRange(CRYPTO_SCAN_INTERVAL_S_MIN, CRYPTO_SCAN_INTERVAL_S_MAX))
@json_option
@handles_errors
def crypto_scan(once: bool, interval_s: float, as_json: bool) -> None:
    """Credit confirmed deposits; notice reorganisations; resume where the last scan stopped."""
    settings = wiring.crypto_settings(Settings.from_env())
    db, w3 = engine(), connect(settings)
    while True:
        report = scan_once(db, w3, settings)
        if report.credited:
            outbox.dispatch(db, send_task)  # the invoices, now that the credits are committed
        report_fields = dataclasses.asdict(report)
        emit(as_json, report_fields, " ".join(f"{k}={v}" for k, v in report_fields.items()))
        if once:
            return
        time.sleep(interval_s)


COMMANDS = (stripe_group, crypto_group)
