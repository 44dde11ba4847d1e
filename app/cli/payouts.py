"""`paralon payouts`: where owners are paid, their payout requests, and the rails' senders."""
from __future__ import annotations

import dataclasses
import time

import click

from app import outbox, wiring
from app.cli.output import emit, engine, handles_errors, json_option
from app.limits import PAYOUT_SEND_INTERVAL_S_DEFAULT, PAYOUT_SEND_INTERVAL_S_MAX, PAYOUT_SEND_INTERVAL_S_MIN
from app.payments import payouts as po
from app.settings import Settings
from ledger.commands import PAYOUT_RAILS
from ledger.errors import InvalidInput
from ledger.money import nano_usd_to_usd_text, usd_to_nano_usd
from ledger.schema import utc_now


@click.group("payouts")
def payouts_group() -> None:
    """Owners' payouts: USDC on chain or Stripe Connect, each paid exactly once."""


def _destination_text(found: po.Destination, changed: bool) -> str:
    when = f"; payouts go to it from {found.usable_from.isoformat()}" if changed else ""
    return f"account {found.owner_account_id} is paid on {found.rail} at {found.destination}{when}"


def _set_destination(owner_id: int, rail: str, destination: str, as_json: bool) -> None:
    with engine().begin() as conn:
        found, changed = po.set_destination(conn, owner_id, rail, destination)
    if changed:
        from app.jobs.celery import send_task  # only now: Celery is slow to import

        outbox.dispatch(engine(), send_task)
    emit(as_json, {"owner_account_id": owner_id, **found.as_dict(utc_now()), "changed": changed}, _destination_text(found, changed))


@payouts_group.group("destination")
def destination_group() -> None:
    """The owner's USDC address. A change takes effect after a 24-hour cooldown and is mailed to the owner's members."""


@destination_group.command("set")
@click.argument("owner_id", type=int)
@click.option("--address", required=True, help="The EVM address USDC payouts go to (0x…).")
@json_option
@handles_errors
def destination_set(owner_id: int, address: str, as_json: bool) -> None:
    _set_destination(owner_id, po.USDC, address, as_json)


@payouts_group.group("stripe-account")
def stripe_account_group() -> None:
    """The owner's Stripe connected account. A change takes effect after a 24-hour cooldown."""


@stripe_account_group.command("set")
@click.argument("owner_id", type=int)
@click.option("--account", "connected", required=True, help="The connected account id (acct_…).")
@json_option
@handles_errors
def stripe_account_set(owner_id: int, connected: str, as_json: bool) -> None:
    _set_destination(owner_id, po.STRIPE, connected, as_json)


@payouts_group.command("request")
@click.argument("owner_id", type=int)
@click.option("--usd", required=True, help="The amount, e.g. 50 or 12.34; rounded down to the rail's unit.")
@click.option("--rail", type=click.Choice(PAYOUT_RAILS), required=True)
@json_option
@handles_errors
def payouts_request(owner_id: int, usd: str, rail: str, as_json: bool) -> None:
    """Set the amount aside from the owner's earnings; the rail's sender pays it."""
    rules = wiring.payout_rules(Settings.from_env())
    payout = po.payout_view(po.request_payout(engine(), owner_id, rail, usd_to_nano_usd(usd), rules))
    emit(as_json, payout, f"payout {payout['id']}: ${payout['amount_usd']} on {rail} to {payout['destination']}, {payout['state']}")


@payouts_group.command("list")
@click.argument("owner_id", type=int)
@json_option
@handles_errors
def payouts_list(owner_id: int, as_json: bool) -> None:
    with engine().connect() as conn:
        found = [po.payout_view(row) for row in po.list_payouts(conn, owner_id)]
    emit(as_json, {"data": found}, "\n".join(
        f"{p['id']}\t{p['rail']}\t{p['state']}\t${nano_usd_to_usd_text(p['amount_nano_usd'])}\t{p['reference'] or ''}"
        for p in found) or f"account {owner_id} has no payouts")


@payouts_group.command("retry")
@click.argument("payout_id", type=int)
@json_option
@handles_errors
def payouts_retry(payout_id: int, as_json: bool) -> None:
    """Ask again for a failed payout: a new payout of the same owner, rail and amount, to
    the rail's destination as it is now. A requested Stripe payout is paid now (the same
    transfer as every attempt before). One in flight on chain is its sender's to finish."""
    settings = Settings.from_env()
    with engine().connect() as conn:
        row = po.payout_row(conn, payout_id)
    if row["rail"] == po.STRIPE and row["state"] == po.REQUESTED:  # paid now, under the same idempotency key as before
        from app.payments import payout_stripe

        payout_stripe.retry(engine(), wiring.stripe_settings(settings), payout_id)
        with engine().connect() as conn:
            payout = po.payout_view(po.payout_row(conn, payout_id))
        emit(as_json, payout, f"payout {payout_id}: {payout['state']}")
        return
    payout = po.payout_view(po.retry_failed(engine(), payout_id, wiring.payout_rules(settings)))
    emit(as_json, payout, f"payout {payout['id']} (again for {payout_id}): ${payout['amount_usd']} on {payout['rail']}, {payout['state']}")


@payouts_group.command("send")
@click.option("--rail", type=click.Choice(PAYOUT_RAILS), help="Only this rail (default: every configured rail).")
@click.option("--once", is_flag=True, help="One bounded run, then exit (otherwise a run every --interval-s).")
@click.option("--interval-s", default=PAYOUT_SEND_INTERVAL_S_DEFAULT, show_default=True,
              type=click.FloatRange(PAYOUT_SEND_INTERVAL_S_MIN, PAYOUT_SEND_INTERVAL_S_MAX), help="Seconds between runs.")
@json_option
@handles_errors
def payouts_send(rail: str | None, once: bool, interval_s: float, as_json: bool) -> None:
    """Pay requested payouts. USDC: sign and store, then broadcast; re-broadcast or replace
    what is not mined; settle after N confirmations; safe after any crash (a stored
    transaction is broadcast again, never signed anew). Stripe: one transfer per payout
    under the payout's idempotency key. A rail that is not configured is skipped
    (named with --rail, it is an error)."""
    senders = _senders(Settings.from_env(), rail)
    db = engine()
    while True:
        report = {name: send(db) for name, send in senders.items()}
        emit(as_json, report, "\n".join(f"{name}: " + " ".join(f"{k}={v}" for k, v in r.items()) for name, r in report.items()))
        if once:
            return
        time.sleep(interval_s)


def _senders(settings: Settings, rail: str | None) -> dict:
    """Each configured rail's one run, as a function of the engine returning its report."""
    from app.payments import payout_chain, payout_stripe  # web3 and Stripe load only for this command

    senders, skipped = {}, {}
    chain = wiring.payout_chain_settings(settings)
    if chain.missing():
        skipped[po.USDC] = f"set {', '.join(chain.missing())}"
    else:
        w3 = payout_chain.connect(chain)
        senders[po.USDC] = lambda db: dataclasses.asdict(payout_chain.send_once(db, w3, chain))
    stripe = wiring.stripe_settings(settings)
    if stripe.secret_key:
        senders[po.STRIPE] = lambda db: payout_stripe.send_pending(db, stripe).as_dict()
    else:
        skipped[po.STRIPE] = "set PARALON_STRIPE_SECRET_KEY"
    if rail is not None:
        if rail in skipped:
            raise NotConfigured(f"{rail} payouts are not configured: {skipped[rail]}")
        return {rail: senders[rail]}
    if not senders:
        raise NotConfigured("no payout rail is configured: " + "; ".join(f"{r}: {why}" for r, why in skipped.items()))
    return senders


class NotConfigured(InvalidInput):
    code = "payouts_not_configured"


COMMANDS = (payouts_group,)
