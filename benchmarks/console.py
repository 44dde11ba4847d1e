"""How fast the console's pages answer, and how heavy they are, on a big ledger.

On a scratch PostgreSQL database: a log of 1,000,000 events over the last 30
days, of which 100,000 are settled requests (generations) and the rest card
top-ups, for six customers (one holding 80% of both), four owners and sixteen
workers. One process writes the log in batches of up to 8,192 events (at
least four a day), each decided by the ledger's own rules
(`ledger.commands.prepare`, `require_covered`), chained by its own hash, and
written by its storage's own append statement (events, postings, balances,
head) under the append lock and the database's guards; each settlement
captures a hold of its own (the hold counters record it placed and closed).
A batch is stamped with its moment of the 30 days. The read models are then
caught up by their consumer (`invoices.read_models.rebuild`, as `paralon
projections rebuild`), the chain is verified (`ledger verify`), and 30
invoices are issued for the big customer's last top-ups.

`paralon serve` then serves the console, and every page of every role
(`PAGES`) is fetched one request at a time as a signed-in member (a session
made by `app.console.sessions.start_session`), alternating with a baseline:
a bare Litestar route of this file, in a process of its own, that renders the
same template with the context the real page rendered (captured once), and
queries nothing. Per page: latency p50 and p95 as the client sees it,
absolute and as a ratio to the baseline's; the HTML's bytes, and the HTML's
plus those of every stylesheet and script it links; each against its goal.
Then the rows each table gave to sequential scans while the pages were
served (PostgreSQL's own counters).

    python benchmarks/console.py --json                                       # 4 minutes on 2 cores, 8 when busy
    python benchmarks/console.py --events 100000 --generations 10000 --json   # about 1

The database in the URL is only used to create (and finally drop) a scratch
database of the benchmark's own.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import httpx
import uvicorn
from litestar import Litestar, Response, get
from litestar.testing import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import select  # noqa: E402

from app.console.sessions import start_session  # noqa: E402
from app.http.console import web  # noqa: E402
from app.http.console.web import SESSION_COOKIE  # noqa: E402
from app.http.factory import create_app  # noqa: E402
from app.members import CUSTOMER_ADMIN, MEMBER_OWNER, PLATFORM_ADMIN, add_member  # noqa: E402
from app.runtime import event_loop_name, tune_garbage_collector  # noqa: E402
from invoices import read_models  # noqa: E402
from invoices.service import InvoiceSettings, issue_for_top_up  # noqa: E402
from ledger import accounts as acc  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger import events as ev  # noqa: E402
from ledger.db import make_engine, snapshot_connection, storage_of  # noqa: E402
from ledger.holds import settlement_key  # noqa: E402
from ledger.schema import accounts, utc_now  # noqa: E402
from ledger.service import Ledger  # noqa: E402
from ledger.storage.base import AppendedBatch  # noqa: E402
from ledger.verify import verify  # noqa: E402
from proxy import keys as api_keys  # noqa: E402
from proxy import prices  # noqa: E402
from proxy import workers as registry  # noqa: E402
from scratch import ScratchDatabase, log  # noqa: E402
from tests.support.db_roles import drop_app_role  # noqa: E402
from tests.support.harness import ServeProcess, free_port  # noqa: E402


class Page(NamedTuple):
    role: str  # a key of PEOPLE
    suffix: str  # /console/{account}/{suffix}


# Every page measured, by role. A page whose route does not exist (yet) is
# reported as absent, not as a failure.
PAGES = (
    Page("customer", "overview"),
    Page("customer", "activity"),
    Page("customer", "keys"),
    Page("customer", "top-up"),
    Page("customer", "alerts"),
    Page("customer", "documents"),
    Page("customer", "reconciliation"),
    Page("owner", "earnings"),
    Page("owner", "workers"),
    Page("owner", "documents"),
    Page("owner", "reconciliation"),
    Page("admin", "fleet"),
    Page("admin", "models"),
    Page("admin", "accounts"),
    Page("admin", "status"),
)

# Goals of every page: server latency p95, the HTML, the HTML with its stylesheets and scripts.
P95_MS_MAX = 100.0
HTML_BYTES_MAX = 30_000
WITH_ASSETS_BYTES_MAX = 300_000

# Who signs in: the member's address, and their role on the account they belong to.
PEOPLE = {
    "customer": ("admin@big-customer.example", CUSTOMER_ADMIN),
    "owner": ("owner@big-owner.example", MEMBER_OWNER),
    "admin": ("ops@platform.example", PLATFORM_ADMIN),
}

DAYS = 30
CUSTOMERS = 6
BIG_CUSTOMER_SHARE = 0.8  # of the requests and of the top-ups; the others share the rest
WORKERS_PER_OWNER = (6, 4, 3, 3)  # the first owner's worker is the one signed in
MODELS = (  # name, USD per million prompt tokens, per million completion tokens
    ("llama-3.1-8b-instruct", "0.05", "0.10"),
    ("qwen2.5-72b-instruct", "0.40", "0.80"),
    ("mistral-small-24b-instruct", "0.10", "0.30"),
    ("deepseek-r1-distill-qwen-32b", "0.20", "0.60"),
)
KEYS_BIG, KEYS_OTHER = 8, 2
STREAMED_SHARE, CANCELLED_SHARE = 0.7, 0.02  # of the requests: streamed; cut short (the caller left)
UNREACHABLE_WORKER_URL = "http://127.0.0.1:9"  # the discard port: health checks fail at once
GRANT_NANO_USD = 10**15
HOLD_NANO_USD = 5_000_000
TOP_UP_CENTS_MIN, TOP_UP_CENTS_MAX = 500, 10_000
BATCH_EVENTS_MAX = 8192  # per transaction
MOMENTS_PER_DAY = 4  # at least: batches, each stamped with its own time, per day of the log
NEXT_HOLD_IDS = "SELECT nextval(pg_get_serial_sequence('holds', 'id')) FROM generate_series(1, %(n)s)"
INVOICED_TOP_UPS = 30  # of the big customer's, the last ones (a PDF each, about 0.1 s)
WARM_UP_REQUESTS = 5
ERROR_TEXT_CHARS = 300  # of a failing page's answer, in the report
BASELINE_START_S = 120  # importing the app and capturing every page, on a loaded machine
PG_STAT_FLUSH_S = 11  # an idle backend reports its statistics within 10 s (PostgreSQL's PGSTAT_IDLE_INTERVAL)
SEED = "abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon about"  # BIP-39's test vector
ASSET = re.compile(r'<(?:link[^>]*\bhref|script[^>]*\bsrc)="(/[^"]+)"')


# --- The data ------------------------------------------------------------------------


@dataclass
class Books:
    customers: list[int]  # [0] is the big one
    owners: list[int]
    platform: int
    workers: list[tuple[int, int, str]]  # (worker id, owner, model)
    keys: dict[int, list[int]]  # customer -> its API key ids
    prices: dict[str, tuple[int, int]]  # model -> nano-USD per prompt token, per completion token
    big_top_ups: list[int] = field(default_factory=list)  # seqs of the big customer's top-ups


def make_accounts(engine) -> Books:
    with engine.begin() as conn:
        customers = [acc.create_account(conn, cmd.CUSTOMER, "Big Customer GmbH" if i == 0 else f"Customer {i} Ltd",
                                        f"billing{i}@customer.example") for i in range(CUSTOMERS)]
        owners = [acc.create_account(conn, cmd.OWNER, f"GPU Owner {i}", f"payouts{i}@owner.example")
                  for i in range(len(WORKERS_PER_OWNER))]
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == cmd.PLATFORM_REVENUE_ACCOUNT)).scalar_one()
        price_of = {}
        for model, input_usd, output_usd in MODELS:
            price = prices.set_price(conn, model, input_usd, output_usd)
            price_of[model] = (price.input_nano_usd_per_token, price.output_nano_usd_per_token)
        workers = []
        for owner, count in zip(owners, WORKERS_PER_OWNER):
            for _ in range(count):
                model = MODELS[len(workers) % len(MODELS)][0]
                workers.append((registry.add_worker(conn, owner, UNREACHABLE_WORKER_URL, model), owner, model))
        keys = {c: [api_keys.create_key(conn, c, name=f"service {k}")[0] for k in range(KEYS_BIG if i == 0 else KEYS_OTHER)]
                for i, c in enumerate(customers)}
    return Books(customers, owners, platform, workers, keys, price_of)


class BulkBook:
    """What the ledger's rules read (`ledger.commands.BookView`), kept in memory
    while one process writes the whole log: every balance it moves, and the
    hold each settlement captures."""

    def __init__(self, kinds: dict[int, str], system: dict[str, int], balances: dict[int, int]) -> None:
        self.kinds, self.system, self.balances = kinds, system, balances
        self.holds: dict[int, cmd.HoldView] = {}
        self.last_seq = 0

    def kind(self, account_id: int) -> str:
        return self.kinds[account_id]

    def balance(self, account_id: int) -> int:
        return self.balances[account_id]

    def held(self, account_id: int) -> int:
        return 0  # each hold is settled in the batch that places it: none stays open

    def hold(self, hold_id: int) -> cmd.HoldView:
        return self.holds[hold_id]

    def event_postings(self, seq: int) -> tuple[str, list]:
        raise ValueError("the benchmark's log reverses nothing")

    def reversal_of(self, seq: int) -> int | None:
        return None

    def system_account(self, code: str) -> int:
        return self.system[code]


def customer_of(books: Books, rng: random.Random) -> int:
    if rng.random() < BIG_CUSTOMER_SHARE:
        return books.customers[0]
    return rng.choice(books.customers[1:])


def settlement(books: Books, rng: random.Random, hold_id: int, customer: int, k: int, started_at: datetime) -> cmd.SettleRequest:
    """One chat request as the proxy settles it (the proxy's metadata, and the activity's measures)."""
    worker, owner, model = rng.choice(books.workers)
    prompt, completion = rng.randint(200, 4000), rng.randint(20, 1000)
    in_price, out_price = books.prices[model]
    request_id = f"chatcmpl-bench{k:09d}"
    meta = {"model": model, "worker_id": worker, "api_key_id": rng.choice(books.keys[customer]), "prompt_tokens": prompt,
            "completion_tokens": completion, "started_at": started_at.isoformat(), "ttft_ms": rng.randint(40, 900),
            "stream": rng.random() < STREAMED_SHARE, "outcome": "cancelled" if rng.random() < CANCELLED_SHARE else "completed"}
    return cmd.SettleRequest(hold_id, owner, prompt * in_price + completion * out_price, request_id,
                             settlement_key(request_id), meta)


def top_up(customer: int, rng: random.Random, k: int) -> cmd.PurchaseCredits:
    cents = rng.randint(TOP_UP_CENTS_MIN, TOP_UP_CENTS_MAX)
    return cmd.PurchaseCredits(customer, cents * 10**7, "card", f"stripe:session:cs_bench_{k:09d}", "external:stripe",
                               f"top-up:bench:{k}")


def is_settlement(k: int, rest: int, generations: int) -> bool:
    """Settlements spread evenly among the events after the grants."""
    return (k + 1) * generations // rest > k * generations // rest


def load_log(engine, books: Books, events: int, generations: int, start: datetime, end: datetime) -> dict:
    """`events` events in all (a grant per customer, then settlements and
    top-ups mixed evenly), in batches each stamped with its moment of [start, end]."""
    with engine.connect() as conn:
        kinds = dict(conn.execute(select(accounts.c.id, accounts.c.kind)).all())
        system = dict(conn.execute(select(accounts.c.system_code, accounts.c.id).where(accounts.c.system_code.is_not(None))).all())
        balances = storage_of(conn).read_balances(conn, sorted(kinds))
    book = BulkBook(kinds, system, balances)
    rng = random.Random(20261201)
    grants = [cmd.GrantCredits(c, GRANT_NANO_USD, "benchmark credits", f"grant:bench:{c}") for c in books.customers]
    rest = events - len(grants)
    batch = max(1, min(BATCH_EVENTS_MAX, events // (DAYS * MOMENTS_PER_DAY)))
    started = time.perf_counter()
    for first in range(-len(grants), rest, batch):
        ks = range(first, min(first + batch, rest))
        at = start + (end - start) * ((ks[-1] + len(grants)) / events)
        settles = [k >= 0 and is_settlement(k, rest, generations) for k in ks]
        with engine.begin() as conn:
            hold_ids = iter(conn.exec_driver_sql(NEXT_HOLD_IDS, {"n": sum(settles)}).scalars().all())
            commands = []
            for k, settle in zip(ks, settles):
                if k < 0:
                    commands.append(grants[k + len(grants)])
                elif settle:
                    hold_id, customer = next(hold_ids), customer_of(books, rng)
                    book.holds[hold_id] = cmd.HoldView(hold_id, customer, HOLD_NANO_USD, True)
                    commands.append(settlement(books, rng, hold_id, customer, k, at))
                else:
                    commands.append(top_up(customer_of(books, rng), rng, k))
            append_batch_in_bulk(conn, book, commands, at)
            for command, seq in zip(commands, range(book.last_seq - len(commands) + 1, book.last_seq + 1)):
                if isinstance(command, cmd.PurchaseCredits) and command.account_id == books.customers[0]:
                    books.big_top_ups.append(seq)
        if (first // batch) % (DAYS * MOMENTS_PER_DAY // 4) == 0:
            log(f"  {first + len(grants):,} of {events:,} events ...")
    seconds = time.perf_counter() - started
    return {"load_s": round(seconds, 1), "load_events_per_s": round(events / seconds)}


def append_batch_in_bulk(conn, book: BulkBook, commands: list, recorded_at: datetime) -> None:
    """What `ledger.store.append_batch` decides and writes for a batch, without
    the reads a batch of strangers' commands needs: the ledger's own rules
    (`prepare`, `require_covered`), its hash chain, and its storage's write
    of events, postings, balances and head in one statement, under the append
    lock and the database's guards."""
    storage = storage_of(conn)
    head = storage.lock_head_and_read(conn, [], [])
    seq, at_text = head.last_seq, ev.format_time(recorded_at)
    events, event_postings, hashes, touched, placed = [], [], [head.last_hash], set(), defaultdict(int)
    for command in commands:
        event, postings = cmd.prepare(command, book)
        cmd.require_covered(book, event, postings)
        seq += 1
        payload_json = ev.canonical_json(ev.event_payload(event))
        event_type = type(event).__name__
        hashes.append(ev.event_hash(hashes[-1], seq, event_type, command.idempotency_key, at_text, payload_json, postings))
        events.append((event_type, payload_json, command.idempotency_key, cmd.command_digest(command), None))
        event_postings.append(postings)
        for account_id, amount in postings:
            book.balances[account_id] += amount
            touched.add(account_id)
        if isinstance(event, ev.RequestSettled):
            placed[event.customer_account_id] += book.holds.pop(event.hold_id).amount_nano_usd
    storage.add_holds_placed(conn, dict(placed))  # placed, then closed by the settlements below
    storage.write_appended(conn, AppendedBatch(events, event_postings, hashes, {a: book.balances[a] for a in touched}, dict(placed),
                                               {}, seq, recorded_at))
    book.last_seq = seq


def build(engine, events: int, generations: int, invoice_dir: Path) -> tuple[Books, dict]:
    books = make_accounts(engine)
    end = utc_now() - timedelta(minutes=1)
    start = datetime.combine((end - timedelta(days=DAYS - 1)).date(), datetime.min.time(), UTC)  # the pages' 30 days
    log(f"log: {events:,} events, {generations:,} of them settled requests, {start:%Y-%m-%d} to {end:%Y-%m-%d %H:%M} ...")
    stats = load_log(engine, books, events, generations, start, end)
    log(f"  {stats['load_events_per_s']:,} events/s; invoices ...")
    settings = InvoiceSettings(storage_dir=invoice_dir)
    for seq in books.big_top_ups[-INVOICED_TOP_UPS:]:
        issue_for_top_up(engine, settings, seq)
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")  # statistics, as a production database has
        conn.commit()
    log("read models: rebuilt by their consumer ...")
    started = time.perf_counter()
    applied = read_models.rebuild(engine)
    seconds = time.perf_counter() - started
    stats.update(read_models_s=round(seconds, 1), read_models_events_per_s=round(applied / seconds),
                 read_models_lag_events=read_models.lag_events(engine), invoices=min(INVOICED_TOP_UPS, len(books.big_top_ups)))
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")
        conn.commit()
    log(f"  {stats['read_models_events_per_s']:,} events/s; verifying the chain ...")
    started = time.perf_counter()
    with snapshot_connection(engine) as conn:
        report = verify(conn)
    stats.update(verify_s=round(time.perf_counter() - started, 1), verify_ok=report.ok, events_in_log=report.events_checked)
    if not report.ok or stats["read_models_lag_events"]:
        raise SystemExit(f"the log does not verify or the read models lag: {report.problems[:3]}")
    return books, stats


def sign_in_everyone(engine, books: Books) -> dict[str, dict]:
    """A member of each role and a live session of theirs: role -> account id and session cookie."""
    account_of = {"customer": books.customers[0], "owner": books.owners[0], "admin": books.platform}
    people = {}
    with engine.begin() as conn:
        for role, (address, member_role) in PEOPLE.items():
            add_member(conn, account_of[role], address, member_role)
            people[role] = {"account_id": account_of[role], "cookie": start_session(conn, address).secret}
    return people


# --- The baseline: the same templates and contexts, no queries -----------------------


def baseline_server(database_url: str, port: int, people_file: str) -> None:
    """Captures the context each page renders (one request through the real app,
    in this process), then serves only those renderings until stopped."""
    people = json.loads(Path(people_file).read_text())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per captured page is noise
    engine = make_engine(database_url)
    ledger = Ledger(engine)
    captured: dict[str, tuple[str, dict]] = {}
    now_capturing = [""]
    real_render = web.render

    def capturing_render(template: str, status: int = 200, cookies=None, **context) -> Response:
        captured[now_capturing[0]] = (template, context)
        return real_render(template, status, cookies, **context)

    web.render = capturing_render
    with TestClient(create_app(ledger, health_interval_s=3600)) as client:
        for page in PAGES:
            person = people[page.role]
            now_capturing[0] = f"{page.role}/{page.suffix}"
            client.cookies.set(SESSION_COOKIE, person["cookie"], path="/console")
            client.get(f"/console/{person['account_id']}/{page.suffix}")
            client.cookies.clear()
    web.render = real_render
    ledger.close()
    engine.dispose()

    @get("/{role:str}/{suffix:str}")
    async def rendered(role: str, suffix: str) -> Response:
        template, context = captured[f"{role}/{suffix}"]
        return web.render(template, **context)

    @get("/ready")
    async def ready() -> str:
        return "ready"

    tune_garbage_collector()
    uvicorn.Server(uvicorn.Config(Litestar([rendered, ready]), host="127.0.0.1", port=port, http="httptools",
                                  loop=event_loop_name(), log_level="warning", access_log=False)).run()


def start_baseline(database_url: str, people_file: str, env: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--baseline-server", "--database-url", database_url,
                                "--port", str(port), "--people-file", people_file], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + BASELINE_START_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    process.wait()
    raise SystemExit("the baseline server did not start")


# --- Measuring -----------------------------------------------------------------------


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * share) - 1)]


def timed_get(client: httpx.Client, path: str, cookie: str | None = None) -> tuple[float, httpx.Response]:
    headers = {"cookie": f"{SESSION_COOKIE}={cookie}"} if cookie else {}
    started = time.perf_counter()
    response = client.get(path, headers=headers)
    return (time.perf_counter() - started) * 1000, response


def asset_bytes(client: httpx.Client, html: str) -> dict[str, int]:
    return {path: len(client.get(path).content) for path in sorted(set(ASSET.findall(html)))}


def measure_page(real: httpx.Client, baseline: httpx.Client, page: Page, person: dict, requests: int) -> dict:
    path = f"/console/{person['account_id']}/{page.suffix}"
    _, first = timed_get(real, path, person["cookie"])
    if first.status_code == 404:
        return {"role": page.role, "page": page.suffix, "present": False}
    if first.status_code != 200:
        return {"role": page.role, "page": page.suffix, "path": path, "present": True, "status": first.status_code,
                "answer": first.text[:ERROR_TEXT_CHARS]}
    base_path = f"/{page.role}/{page.suffix}"
    for _ in range(WARM_UP_REQUESTS):
        timed_get(real, path, person["cookie"])
        timed_get(baseline, base_path)
    real_ms, base_ms = [], []
    for _ in range(requests):  # alternately, so that the machine's drift hits both alike
        ms, response = timed_get(real, path, person["cookie"])
        if response.status_code != 200:
            raise SystemExit(f"{path} answered {response.status_code}")
        real_ms.append(ms)
        ms, response = timed_get(baseline, base_path)
        if response.status_code != 200:
            raise SystemExit(f"the baseline of {path} answered {response.status_code}")
        base_ms.append(ms)
    assets = asset_bytes(real, first.text)
    html_bytes, base_html_bytes = len(first.content), len(response.content)
    result = {
        "role": page.role, "page": page.suffix, "path": path, "present": True,
        "ms_p50": round(statistics.median(real_ms), 2), "ms_p95": round(percentile(real_ms, 0.95), 2),
        "baseline_ms_p50": round(statistics.median(base_ms), 2), "baseline_ms_p95": round(percentile(base_ms, 0.95), 2),
        "html_bytes": html_bytes, "baseline_html_bytes": base_html_bytes, "assets": assets,
        "with_assets_bytes": html_bytes + sum(assets.values()),
    }
    result["ratio_p50"] = round(result["ms_p50"] / result["baseline_ms_p50"], 2)
    result["ratio_p95"] = round(result["ms_p95"] / result["baseline_ms_p95"], 2)
    result["goals_met"] = {"p95": result["ms_p95"] < P95_MS_MAX, "html": html_bytes < HTML_BYTES_MAX,
                           "with_assets": result["with_assets_bytes"] < WITH_ASSETS_BYTES_MAX}
    return result


def measure(serve_url: str, baseline_url: str, people: dict, requests: int) -> list[dict]:
    results = []
    with httpx.Client(base_url=serve_url, timeout=30) as real, httpx.Client(base_url=baseline_url, timeout=30) as baseline:
        for page in PAGES:
            result = measure_page(real, baseline, page, people[page.role], requests)
            if "status" in result:
                log(f"  {page.role:8} {page.suffix:14} answered {result['status']}: {result['answer']}")
            elif result["present"]:
                log(f"  {page.role:8} {page.suffix:14} p50 {result['ms_p50']:6.1f} ms p95 {result['ms_p95']:6.1f} ms "
                    f"(baseline {result['baseline_ms_p50']:.1f}/{result['baseline_ms_p95']:.1f}), "
                    f"{result['html_bytes']:,} B, {result['with_assets_bytes']:,} B with assets")
            else:
                log(f"  {page.role:8} {page.suffix:14} absent")
            results.append(result)
    return results


def serve_env(invoice_dir: Path) -> dict[str, str]:
    """What the real server and the baseline both run with: card and stablecoin top-ups configured."""
    return {"PARALON_HEALTH_INTERVAL_MS": "2000", "PARALON_KEY_CACHE_TTL_MS": "1000", "PARALON_CRYPTO_SEED": SEED,
            "PARALON_STRIPE_SECRET_KEY": "sk_test_benchmark", "PARALON_INVOICE_DIR": str(invoice_dir)}


def run(scratch: ScratchDatabase, events: int, generations: int, requests: int, work_dir: Path) -> dict:
    engine = scratch.engine()
    invoice_dir = work_dir / "invoices"
    books, stats = build(engine, events, generations, invoice_dir)
    people = sign_in_everyone(engine, books)
    engine.dispose()
    people_file = work_dir / "people.json"
    people_file.write_text(json.dumps(people))
    url = scratch.url.render_as_string(hide_password=False)
    env = serve_env(invoice_dir)
    log("serving the console, and the baseline ...")
    serve = ServeProcess(url, **env).start()
    baseline, counters = None, make_engine(url, pool_size=1)
    try:
        baseline, baseline_url = start_baseline(url, str(people_file), {**os.environ, **env})
        scanned_before, load_before = rows_scanned(counters), os.getloadavg()[0]
        log(f"{requests} requests per page, alternating with the baseline ...")
        pages = measure(serve.url, baseline_url, people, requests)
        load_after = os.getloadavg()[0]
        time.sleep(PG_STAT_FLUSH_S)
        scanned = {table: rows - scanned_before.get(table, 0) for table, rows in rows_scanned(counters).items()}
    finally:
        counters.dispose()
        if baseline is not None:
            baseline.terminate()
            baseline.wait(15)
        serve.stop()
    return {**stats, "pages": pages, "rows_read_by_sequential_scans": {t: n for t, n in sorted(scanned.items()) if n},
            "load_average_1m_before_and_after": [round(load_before, 2), round(load_after, 2)], "cpus": os.cpu_count()}


def rows_scanned(engine) -> dict[str, int]:
    """Rows each table has given to sequential scans so far (PostgreSQL's statistics)."""
    with engine.connect() as conn:
        return dict(conn.exec_driver_sql("SELECT relname, coalesce(seq_tup_read, 0) FROM pg_stat_user_tables").all())


def summary(result: dict) -> dict:
    pages = result.pop("pages")
    result["pages"] = [p for p in pages if p["present"] and "status" not in p]
    result["pages_absent"] = [f"{p['role']}/{p['page']}" for p in pages if not p["present"]]
    result["pages_failing"] = {f"{p['role']}/{p['page']}": {"status": p["status"], "answer": p["answer"]} for p in pages if "status" in p}
    result["goals"] = {"p95_ms_max": P95_MS_MAX, "html_bytes_max": HTML_BYTES_MAX, "with_assets_bytes_max": WITH_ASSETS_BYTES_MAX}
    result["pages_missing_a_goal"] = [f"{p['role']}/{p['page']}" for p in result["pages"] if not all(p["goals_met"].values())]
    result["all_goals_met"] = not result["pages_missing_a_goal"] and not result["pages_failing"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--events", type=int, default=1_000_000, help="ledger events in all")
    parser.add_argument("--generations", type=int, default=100_000, help="settled requests among them")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per page (and as many to the baseline)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--people-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        baseline_server(args.database_url, args.port, args.people_file)
        return
    if not 0 < args.generations < args.events - CUSTOMERS or args.requests < 1:
        parser.error("need 0 < --generations < --events - 6 and --requests >= 1")
    tune_garbage_collector()  # as every long-running Paralon process does
    started = time.perf_counter()
    try:
        with ScratchDatabase(args.database_url, "paralon_bench_console") as scratch, \
                tempfile.TemporaryDirectory(prefix="paralon-bench-console-") as work_dir:
            if scratch.sqlite:
                raise SystemExit("the console benchmark runs on PostgreSQL: give a postgresql:// URL")
            result = run(scratch, args.events, args.generations, args.requests, Path(work_dir))
    finally:
        drop_app_role()
    result.update(events=args.events, generations=args.generations, requests_per_page=args.requests,
                  run_s=round(time.perf_counter() - started, 1), database="postgresql")
    result = summary(result)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(json.dumps(result, sort_keys=True, indent=2))


if __name__ == "__main__":
    main()
