"""Invoices per second per worker process, and read-model catch-up in events per second.

Invoices: one process issues invoices for top-ups one after another (number
assigned, PDF/A-3b rendered by WeasyPrint, file written, SHA-256 recorded in an
`InvoiceIssued` event), against WeasyPrint rendering a one-page HTML document in
the same process. Catch-up: a rebuild of the usage and earnings read models from
the first event of a log of settlements, against reading the same log in pages
without applying anything. Each baseline runs before and after, and the ratios
are what to read: this machine is shared and absolute numbers drift.

    python benchmarks/invoices.py --database-url postgresql://postgres@127.0.0.1:5432/postgres --json

The database in the URL is only used to create (and finally drop) two scratch
databases of the benchmark's own; with sqlite:///path/bench.db the scratch
databases are files beside that path, removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import func, select  # noqa: E402
from weasyprint import HTML  # noqa: E402

from app.runtime import tune_garbage_collector  # noqa: E402
from invoices import read_models  # noqa: E402
from invoices.schema import earnings_daily  # noqa: E402
from invoices.service import InvoiceSettings, issue_for_top_up  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger.accounts import create_account, read_balance  # noqa: E402
from ledger.db import normalise_url  # noqa: E402
from ledger.holds import PlaceHold  # noqa: E402
from ledger.log import read_events  # noqa: E402
from scratch import ScratchDatabase, log  # noqa: E402
from ledger.service import Ledger, append_now  # noqa: E402

WARM_UP = 2
SIMPLE_HTML = "<h1>Paralon</h1><p>A heading and a short paragraph on one page, nothing else.</p>"
MODELS = ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "mistral-7b-instruct", "phi-3-mini")
OWNERS, WORKERS, API_KEYS = 4, 8, 8
HOLD_NANO_USD = 5_000_000
SETTLE_BATCH = 1000
LOG_PAGE_SIZE = 2000


def timed_ms(work, count: int) -> list[float]:
    out = []
    for i in range(count):
        started = time.perf_counter()
        work(i)
        out.append((time.perf_counter() - started) * 1000)
    return out


def per_s(latencies_ms: list[float]) -> float:
    return len(latencies_ms) / (sum(latencies_ms) / 1000)


def p99(latencies_ms: list[float]) -> float:
    ordered = sorted(latencies_ms)
    return ordered[max(int(len(ordered) * 0.99) - 1, 0)]


def simple_pdf_per_s(count: int) -> float:
    return per_s(timed_ms(lambda _: HTML(string=SIMPLE_HTML).write_pdf(), count))


def top_ups(engine, count: int) -> list[int]:
    with engine.begin() as conn:
        customer = create_account(conn, cmd.CUSTOMER, "Bench Customer Ltd", "billing@customer.example")
    return [append_now(engine, cmd.PurchaseCredits(customer, (10 + i % 90) * 10**9 + 1_230_000, "card",
                                                   f"stripe:session:cs_bench_{i}", "external:stripe", f"top-up:{i}")).seq
            for i in range(count)]


def run_invoices(scratch: ScratchDatabase, count: int) -> dict:
    engine = scratch.engine()
    seqs = top_ups(engine, WARM_UP + count)
    with tempfile.TemporaryDirectory(prefix="paralon-bench-invoices-") as storage_dir:
        settings = InvoiceSettings(storage_dir=Path(storage_dir))
        for seq in seqs[:WARM_UP]:
            issue_for_top_up(engine, settings, seq)
            HTML(string=SIMPLE_HTML).write_pdf()
        simple_before = simple_pdf_per_s(count)
        issued: list[dict] = []
        invoice_ms = timed_ms(lambda i: issued.append(issue_for_top_up(engine, settings, seqs[WARM_UP + i])), count)
        simple_after = simple_pdf_per_s(count)
    engine.dispose()
    if not all(invoice["pdf_sha256"] for invoice in issued):
        raise RuntimeError("an invoice was issued without a recorded PDF")
    invoices_per_s, simple = per_s(invoice_ms), (simple_before + simple_after) / 2
    return {
        "invoices": count,
        "worker_processes": 1,
        "invoices_per_s": round(invoices_per_s, 2),
        "invoice_ms_p50": round(statistics.median(invoice_ms), 1),
        "invoice_ms_p99": round(p99(invoice_ms), 1),
        "simple_pdf_per_s_before": round(simple_before, 2),
        "simple_pdf_per_s_after": round(simple_after, 2),
        "simple_pdf_per_s": round(simple, 2),
        "ratio_to_simple_pdf": round(invoices_per_s / simple, 3),
    }


def settle_many(ledger: Ledger, customer: int, owners: list[int], count: int) -> None:
    """Settlements through group commit in batches: workers belong to owners, models and keys vary."""
    for start in range(0, count, SETTLE_BATCH):
        ks = range(start, min(start + SETTLE_BATCH, count))
        holds = [ledger.holder.submit(PlaceHold(customer, HOLD_NANO_USD, f"h:{k}")) for k in ks]
        settles = []
        for k, hold in zip(ks, holds):
            worker, prompt_tokens, completion_tokens = k % WORKERS, 200 + k % 997, 20 + k % 389
            meta = {"model": MODELS[(k // WORKERS) % len(MODELS)], "worker_id": 1 + worker, "api_key_id": 1 + (k // 3) % API_KEYS,
                    "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
            settles.append(ledger.appender.submit(cmd.SettleRequest(
                hold.result().hold_id, owners[worker % len(owners)], 150 * prompt_tokens + 600 * completion_tokens,
                f"req:{k}", f"settle:{k}", meta)))
        for settle in settles:
            settle.result()


def log_read_per_s(engine) -> tuple[int, float]:
    started, events, position = time.perf_counter(), 0, 0
    with engine.connect() as conn:
        while page := read_events(conn, position, LOG_PAGE_SIZE, with_postings=True):
            events, position = events + len(page), page[-1].seq
    return events, events / (time.perf_counter() - started)


def reconciles(engine, owners: list[int]) -> tuple[bool, int, int]:
    with engine.connect() as conn:
        earned = conn.execute(select(func.coalesce(func.sum(earnings_daily.c.earnings_nano_usd), 0))).scalar_one()
        balances = sum(read_balance(conn, owner).balance_nano_usd for owner in owners)
    return int(earned) == balances, int(earned), balances


def run_catch_up(scratch: ScratchDatabase, settlements: int) -> dict:
    engine = scratch.engine()
    ledger = Ledger(engine)
    customer = ledger.create_account(cmd.CUSTOMER, "bench customer")
    owners = [ledger.create_account(cmd.OWNER, f"bench owner {i}") for i in range(OWNERS)]
    ledger.append(cmd.GrantCredits(customer, 10**15, "benchmark credits", "grant:bench"))
    started = time.perf_counter()
    settle_many(ledger, customer, owners, settlements)
    log(f"  {settlements} settlements in {time.perf_counter() - started:.1f} s; reading and rebuilding ...")
    ledger.close()
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")  # statistics, as a production database has
        conn.commit()
    events, read_before = log_read_per_s(engine)
    started = time.perf_counter()
    applied = read_models.rebuild(engine)
    catch_up_per_s = applied / (time.perf_counter() - started)
    _, read_after = log_read_per_s(engine)
    lag = read_models.lag_events(engine)
    matches, earned, balances = reconciles(engine, owners)
    engine.dispose()
    read = (read_before + read_after) / 2
    return {
        "events": events,
        "events_applied": applied,
        "catch_up_events_per_s": round(catch_up_per_s, 1),
        "log_read_events_per_s_before": round(read_before, 1),
        "log_read_events_per_s_after": round(read_after, 1),
        "log_read_events_per_s": round(read, 1),
        "ratio_to_log_read": round(catch_up_per_s / read, 3),
        "lag_events": lag,
        "owner_earnings_nano_usd": earned,
        "owner_balances_nano_usd": balances,
        "reconciles": lag == 0 and applied == events and matches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--invoices", type=int, default=40, help="invoices issued (and simple PDFs rendered) per measurement")
    parser.add_argument("--events", type=int, default=20_000, help="settlements in the log the read models catch up on")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    if args.invoices < 1 or args.events < 1:
        parser.error("--invoices and --events must be at least 1")
    tune_garbage_collector()  # as every long-running Paralon process does

    log(f"invoices: {args.invoices} in one process ...")
    with ScratchDatabase(args.database_url, "paralon_bench_invoices") as scratch:
        result = run_invoices(scratch, args.invoices)
    log(f"  {result['invoices_per_s']:.1f} invoices/s, {result['simple_pdf_per_s']:.1f} simple PDFs/s; catch-up ...")
    with ScratchDatabase(args.database_url, "paralon_bench_read_models") as scratch:
        result.update(run_catch_up(scratch, args.events))
    log(f"  {result['catch_up_events_per_s']:.0f} events/s caught up, {result['log_read_events_per_s']:.0f} events/s read")
    result["database"] = normalise_url(args.database_url).get_backend_name()
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in sorted(result.items()):
            print(f"{k}: {v}")
    if not result["reconciles"]:
        raise SystemExit("read models do not reconcile with the ledger")


if __name__ == "__main__":
    main()
