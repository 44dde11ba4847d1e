"""A scripted tour: a customer buys nothing yet but is granted credits, a GPU
owner's worker serves 100 requests, each settled 80/20 the moment it ends."""
from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import click
from sqlalchemy import Engine

from app.migrate import migrate
from app import wiring
from app.settings import Settings
from app.runtime import tune_garbage_collector
from ledger import commands as cmd
from ledger.db import snapshot_connection
from ledger.holds import PlaceHold
from ledger.money import nano_usd_to_usd_text, split_charge, usd_to_nano_usd
from ledger.verify import verify

REQUESTS = 100
IN_PRICE_NANO_USD_PER_TOKEN = 150  # $0.15 per million tokens
OUT_PRICE_NANO_USD_PER_TOKEN = 600  # $0.60 per million tokens


def run_demo(engine: Engine, settings: Settings) -> None:
    migrate(engine)
    tune_garbage_collector()
    ledger = wiring.open_ledger(settings, engine)
    run = uuid.uuid4().hex[:8]
    customer = ledger.create_account(cmd.CUSTOMER, f"Demo customer {run}", "customer@example.com")
    owner = ledger.create_account(cmd.OWNER, f"Demo GPU owner {run}")
    ledger.append(cmd.GrantCredits(customer, usd_to_nano_usd("10.00"), "demo credits", f"demo:{run}:grant"))
    click.echo(f"customer {customer} granted $10.00; owner {owner} owns the worker")

    def one_request(i: int) -> int:
        hold = ledger.place_hold(PlaceHold(customer, 2_000_000, f"demo:{run}:hold:{i}"))
        prompt_tokens, completion_tokens = 900 + i, 200 + 3 * i
        charge = prompt_tokens * IN_PRICE_NANO_USD_PER_TOKEN + completion_tokens * OUT_PRICE_NANO_USD_PER_TOKEN
        ledger.append(cmd.SettleRequest(hold.hold_id, owner, charge, f"req-{run}-{i}", f"demo:{run}:settle:{i}",
                                        {"model": "demo-27b", "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}))
        return charge

    with ThreadPoolExecutor(max_workers=16) as pool:
        charges = list(pool.map(one_request, range(REQUESTS)))
    ledger.close()
    total = sum(charges)
    owner_total = sum(split_charge(c)[0] for c in charges)
    c_view, o_view = ledger.balance(customer), ledger.balance(owner)
    click.echo(f"{REQUESTS} requests settled through group commit "
               f"({ledger.appender.batches_committed} batches for {ledger.appender.commands_committed} appends)")
    click.echo(f"  charged in total      ${nano_usd_to_usd_text(total)}")
    click.echo(f"  customer available    ${nano_usd_to_usd_text(c_view.available_nano_usd)} (held {c_view.held_nano_usd})")
    click.echo(f"  owner earnings (80%)  ${nano_usd_to_usd_text(o_view.balance_nano_usd)} = sum of charge*80//100: {o_view.balance_nano_usd == owner_total}")
    with snapshot_connection(engine) as conn:
        report = verify(conn)
    click.echo(f"ledger verify: {'ok' if report.ok else report.problems} ({report.events_checked} events, hash chain intact)")
