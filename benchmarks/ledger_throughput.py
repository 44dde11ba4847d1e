"""Settlements per second through group commit, against pgbench on the same server.

Many concurrent producers each place a hold (committed without waiting for the
flush) and settle it (80/20, durable), as the proxy does, through writers
that batch as the service's do (their defaults in ledger.limits). Each
request has the proxy's own id and keys (`new_request_id`, `hold_key`,
`settlement_key`): how they sort decides where they go in the keys' indexes,
and their length what each row and payload carries. pgbench tpcb-like runs
on the same server before, between and after the ledger's rounds (three by
default), and the ratio is what to read: this machine is shared and absolute
numbers drift. Each round's ratio is to the pgbench windows on either side
of it; a single window moved by a fifth from one to the next here, so the
round with the median ratio is reported, with every round's ratio beside it.
Beside the ratio: the CPU a settlement used in all (the producers' processes
and PostgreSQL's), and the most it may use for the target ratio with every
core busy (`cpu_us_per_settlement_budget_at_target`).

    python benchmarks/ledger_throughput.py --database-url postgresql://postgres@127.0.0.1:5432/postgres --json

With --holds-placed-before N, each producer's first N holds are placed before
the clock starts: what settlements per second would be if placing a hold cost
nothing (the most that holds kept off the database could give). With
--random-request-ids, request ids are random (UUIDv4), as the proxy made them
before they were ordered by time. With --flush-delay-ms MS, each flush
barrier of the ledger's writers sleeps MS on the server first: the ledger as
it runs on a disk whose flush is that much slower (pgbench's is not slowed).

The database in the URL is only used to create (and finally drop) scratch
databases of the benchmark's own.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from app.migrate import migrate  # noqa: E402
from app.runtime import run_on_service_loop, tune_garbage_collector  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger.db import CHAINED, COMMITTED, WRITTEN, make_engine, normalise_url  # noqa: E402
from ledger.hold_commands import settlement_key  # noqa: E402
from ledger.hold_pool import HoldPool  # noqa: E402
from ledger.holds import HOLD_TTL_S_MAX, PlaceHold  # noqa: E402
from ledger.limits import BATCH_SIZE_MAX_DEFAULT, BATCH_WAIT_MS_DEFAULT, MS_PER_S  # noqa: E402
from scratch import ScratchDatabase, funded_accounts, log, postgres_cpu_s_by_pid, random_request_id  # noqa: E402
from ledger.service import Ledger  # noqa: E402
from ledger.storage import postgres as pg_storage  # noqa: E402
from ledger.store import set_postings_in_event_row  # noqa: E402
from ledger.verify import verify  # noqa: E402
from proxy.request_ids import new_request_id  # noqa: E402
from proxy.settlement import hold_key  # noqa: E402

CUSTOMERS = 64
OWNERS = 8
HOLD_NANO_USD = 5_000_000
# Holds placed before the clock starts (--holds-placed-before), per second of
# lead time given to place them.
HOLDS_PLACED_AHEAD_PER_S = 20_000
# The ratio to pgbench the ledger aims at (closed loop): each run says how much
# CPU a settlement may use for it, every core busy, beside what it used.
TARGET_RATIO_TO_PGBENCH = 10
# Open loop: how often the arrivals due are started (each tick starts every one due by then).
ARRIVAL_TICK_S = 0.001
# Open loop: a rate is held when 99% of its requests settle within this many
# milliseconds of arriving (hold and settlement both).
LATENCY_BOUND_MS_DEFAULT = 100.0
# The parts of the append lock's time, by the writer's mark that ends each; the
# commit's part ends after its flush, which travels with it (one query).
LOCK_PARTS = {"rules_and_hash_chain": CHAINED, "rows_written": WRITTEN, "commit": COMMITTED}


def idle_cpu_s() -> float:
    """Idle CPU seconds of the whole machine so far (Linux /proc/stat), summed over cores."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds used so far by one thread of this process (Linux /proc)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


# Bytes on disk of each table of the schema: heap, TOAST and its indexes apart.
_RELATION_BYTES = """
SELECT c.relname, pg_table_size(c.oid), pg_indexes_size(c.oid)
FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'
"""


def disk_snapshot(conn) -> tuple[int, dict[str, tuple[int, int]]]:
    """The server's WAL position (bytes) and each table's (table, index) bytes."""
    wal_lsn = conn.exec_driver_sql("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").scalar_one()
    return int(wal_lsn), {name: (table, index) for name, table, index in conn.exec_driver_sql(_RELATION_BYTES)}


def bytes_per_settlement(before: tuple, after: tuple, settled: int) -> dict:
    """WAL written and pages grown over the load, per settlement, by table (index apart).

    Growth, not writes: an update that fits its page (HOT) grows nothing but
    still writes WAL, which is why both are shown."""
    per = max(settled, 1)
    by_table = {}
    for name, (table, index) in after[1].items():
        table_before, index_before = before[1].get(name, (0, 0))
        grown = (table - table_before, index - index_before)
        if any(grown):
            by_table[name] = {"table": round(grown[0] / per, 1), "index": round(grown[1] / per, 1)}
    return {
        "wal_bytes_per_settlement": round((after[0] - before[0]) / per, 1),
        "table_bytes_per_settlement": round(sum(t["table"] for t in by_table.values()), 1),
        "index_bytes_per_settlement": round(sum(t["index"] for t in by_table.values()), 1),
        "bytes_per_settlement_by_table": by_table,
    }


# Every other client backend of the scratch database, and what each is doing:
# the holds' writers are those seen calling paralon_place_holds, the appenders
# those seen running an append's statements (the close of holds, the head's
# lock and move, the events' COPY), the flush waiters those seen running the
# flush barrier; an appender inside a batch is not idle.
_BACKENDS = """
SELECT pid, query LIKE '%%paralon_place_holds%%', query ~ 'DELETE FROM holds|ledger_head|COPY ledger_events',
       query LIKE '%%paralon-flush%%', state, wait_event_type, wait_event FROM pg_stat_activity
WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid()
"""
APPENDER_STATES = ("waiting_for_append_lock", "flushing_wal", "executing", "client_in_transaction")


def appender_state(state: str | None, wait_type: str | None, wait_event: str | None) -> str:
    if wait_type == "Lock":
        return "waiting_for_append_lock"  # the head row: the only lock appends wait for
    if wait_event and wait_event.startswith("WAL"):
        return "flushing_wal"
    if state == "active":
        return "executing"
    return "client_in_transaction"  # idle in transaction: its process is deciding, hashing, encoding


class AppenderSampler(threading.Thread):
    """Samples pg_stat_activity every 20 ms during the load: of the time the
    appending backends spend inside a batch, the shares waiting for the append
    lock, flushing the WAL at commit, executing, and waiting on their own
    process (its Python work inside the transaction). Every 5 ms, its queries
    took about 5 µs of the server's CPU per settlement, counted as the ledger's;
    a 10 s load still gives some 500 samples per backend."""

    def __init__(self, url: str, interval_s: float = 0.020) -> None:
        super().__init__(name="appender-sampler", daemon=True)
        self.url, self.interval_s = url, interval_s
        self.counts = dict.fromkeys(APPENDER_STATES, 0)
        self.holder_pids: set[int] = set()
        self.appender_pids: set[int] = set()
        self.stopping = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stopping.wait(self.interval_s):
                for pid, places_holds, appends, waits_for_flush, state, *waits in conn.execute(_BACKENDS):
                    if places_holds:
                        self.holder_pids.add(pid)
                    elif waits_for_flush:  # the appenders' flush waiter: its CPU is theirs; it is never inside a batch
                        self.appender_pids.add(pid)
                    elif appends:
                        self.appender_pids.add(pid)
                        if state != "idle":
                            self.counts[appender_state(state, *waits)] += 1

    def cpu_us_per_settlement_by_role(self, used_s: dict[int, float], settled: int) -> dict[str, float]:
        """PostgreSQL's CPU (seconds by process) split between the holds' writers'
        backends, the appenders' and the rest (WAL writer, checkpointer,
        autovacuum, this sampler, any other client), per settlement."""
        roles = {"holders": set(used_s) & self.holder_pids, "appenders": set(used_s) & (self.appender_pids - self.holder_pids)}
        roles["background"] = set(used_s) - roles["holders"] - roles["appenders"]
        return {role: round(sum(used_s[pid] for pid in pids) / max(settled, 1) * 1e6, 1) for role, pids in roles.items()}

    def shares(self) -> dict[str, float]:
        self.stopping.set()
        self.join()
        total = max(sum(self.counts.values()), 1)
        return {state: round(count / total, 3) for state, count in self.counts.items()}


def cpu_used_between(started: dict[int, float] | None, ended: dict[int, float] | None) -> dict[int, float] | None:
    """CPU seconds each process used between two readings (one started since counts from 0)."""
    if started is None or ended is None:
        return None
    return {pid: used - started.get(pid, 0.0) for pid, used in ended.items()}


def pgbench_tps(server_url: str, seconds: int) -> float:
    if shutil.which("pgbench") is None:
        raise SystemExit("pgbench is not installed (Debian: postgresql-contrib or postgresql-client)")
    with ScratchDatabase(server_url, "paralon_pgbench") as scratch:
        args, env = scratch.libpq_args()
        subprocess.run(["pgbench", "-i", "-q", "-s", "8", *args, scratch.name], env=env, check=True, capture_output=True)
        out = subprocess.run(
            ["pgbench", "-b", "tpcb-like", "-c", "8", "-j", "2", "-T", str(seconds), *args, scratch.name],
            env=env, check=True, capture_output=True, text=True,
        ).stdout
    match = re.search(r"tps = ([0-9.]+)", out)
    if not match:
        raise RuntimeError(f"cannot read pgbench output:\n{out}")
    return float(match.group(1))


def charge_and_meta(n: int) -> tuple[int, dict]:
    """The `n`th request's charge and metadata, varied as traffic varies them."""
    return 150 * (900 + n % 97) + 600 * (100 + n % 53), {"model": "bench", "prompt_tokens": 900 + n % 97}


def settlement(hold_id: int, owner: int, request_id: str, n: int) -> cmd.SettleRequest:
    """The `n`th request's settlement."""
    charge, meta = charge_and_meta(n)
    return cmd.SettleRequest(hold_id, owner, charge, request_id, settlement_key(request_id), meta)


async def pooled_producer(pool: HoldPool, customer: int, owner: int, deadline: float, latencies_ms: list[float], new_id) -> int:
    """`producer`, each request reserved from its replica's pooled hold and captured from it (not finally)."""
    done = 0
    while time.time() < deadline:
        request_id = new_id("chatcmpl-")
        reservation = await pool.reserve(customer, HOLD_NANO_USD)
        if reservation is None:  # not SystemExit: a pool's worker would die of it and leave the run waiting for ever
            raise RuntimeError("a customer's credits do not cover a whole pool: fund them more")
        charge, meta = charge_and_meta(done)
        started = time.perf_counter()
        await pool.settle(reservation, owner, charge, request_id, settlement_key(request_id), meta)
        latencies_ms.append((time.perf_counter() - started) * 1000)
        done += 1
    return done


async def producer(ledger: Ledger, customer: int, owner: int, deadline: float, latencies_ms: list[float],
                   placed_ahead: list, new_id) -> int:
    done = 0
    while time.time() < deadline:
        request_id = new_id("chatcmpl-")
        hold = placed_ahead.pop() if placed_ahead else await ledger.place_hold_async(
            PlaceHold(customer, HOLD_NANO_USD, hold_key(request_id)))
        started = time.perf_counter()
        await ledger.append_async(settlement(hold.hold_id, owner, request_id, done))
        latencies_ms.append((time.perf_counter() - started) * 1000)
        done += 1
    return done


async def arriving_request(ledger: Ledger, customer: int, owner: int, arrives_at: float, n: int,
                           latencies_ms: list[float], hold_latencies_ms: list[float], new_id) -> None:
    """One request of open-loop traffic: its hold, then its settlement; each
    latency counted from when it was due to arrive, so that a late start (the
    event loop behind) counts against the ledger, not for it."""
    request_id = new_id("chatcmpl-")
    hold = await ledger.place_hold_async(PlaceHold(customer, HOLD_NANO_USD, hold_key(request_id)))
    hold_latencies_ms.append((time.time() - arrives_at) * 1000)
    await ledger.append_async(settlement(hold.hold_id, owner, request_id, n))
    latencies_ms.append((time.time() - arrives_at) * 1000)


async def open_loop(ledger: Ledger, roles: list[tuple[int, int]], rate_per_s: float, start_at: float, seconds: float,
                    latencies_ms: list[float], hold_latencies_ms: list[float], new_id) -> int:
    """Requests arrive evenly at `rate_per_s` whether or not the earlier ones
    are done, as callers send them to the proxy: no closed loop whose first
    batches decide the rest. Started each tick for every arrival due by then;
    returns how many arrived (every one is awaited)."""
    due_total, started = int(rate_per_s * seconds), 0
    tasks = []
    while started < due_total:
        due = min(due_total, int((time.time() - start_at) * rate_per_s) + 1)
        for n in range(started, due):
            customer, owner = roles[n % len(roles)]
            tasks.append(asyncio.ensure_future(arriving_request(
                ledger, customer, owner, start_at + n / rate_per_s, n, latencies_ms, hold_latencies_ms, new_id)))
        started = max(started, due)
        await asyncio.sleep(ARRIVAL_TICK_S)
    await asyncio.gather(*tasks)
    return started


async def _process_load(url: str, producers: int, customers: list[int], owners: list[int],
                        start_at: float, seconds: float, batch_size_max: int, batch_wait_ms: float,
                        flush_after_commit: bool, holds_ahead: int, random_ids: bool, rate_per_s: float | None,
                        flush_delay_ms: float, pooled_holds: bool) -> dict:
    if flush_delay_ms:  # a slower disk's flush: each of this process's flush barriers sleeps on the server first
        pg_storage._FLUSH_BARRIER = f"SELECT pg_sleep({flush_delay_ms / MS_PER_S});\n{pg_storage._FLUSH_BARRIER}"
    engine = make_engine(url, pool_size=4)
    ledger = Ledger(engine, batch_size_max=batch_size_max, batch_wait_ms=batch_wait_ms, flush_after_commit=flush_after_commit)
    pool = HoldPool(ledger) if pooled_holds else None
    latencies_ms: list[float] = []
    new_id = random_request_id if random_ids else new_request_id
    # Producer i's customer and owner.
    roles = [(customers[i % len(customers)], owners[i % len(owners)]) for i in range(producers)]
    placed_ahead = [place_ahead(ledger, customer, holds_ahead, new_id) for customer, _ in roles]
    if holds_ahead and time.time() > start_at:
        # Not SystemExit: a pool's worker would die of it and leave the run waiting for ever.
        raise RuntimeError("the holds placed before the clock took longer than their lead time: give fewer")
    await asyncio.sleep(max(0.0, start_at - time.time()))
    threads = {"event_loop": threading.get_native_id(), "appender": ledger.appender.native_thread_id,
               "holder": ledger.holder.native_thread_id, "flush_waiter": ledger.appender.flush_thread_id}
    threads = {name: tid for name, tid in threads.items() if tid is not None}  # none where the writer does not wait for the flush after its commit
    thread_cpu_started = {name: thread_cpu_s(tid) for name, tid in threads.items()}
    cpu_started, lock_held_started_s = time.process_time(), ledger.appender.append_lock_held_s
    hold_batches_started = ledger.holder.batches_committed
    lock_parts_started_s = dict(ledger.appender.append_lock_parts_s)
    per_second: list[int] = []
    sampler = asyncio.create_task(_sample_per_second(ledger, per_second))
    hold_latencies_ms: list[float] = []
    if pool is not None:
        counts = await asyncio.gather(*(pooled_producer(pool, customer, owner, start_at + seconds, latencies_ms, new_id)
                                        for customer, owner in roles))
    elif rate_per_s is None:
        counts = await asyncio.gather(*(
            producer(ledger, customer, owner, start_at + seconds, latencies_ms, ahead, new_id)
            for (customer, owner), ahead in zip(roles, placed_ahead)
        ))
    else:
        counts = [await open_loop(ledger, roles, rate_per_s, start_at, seconds, latencies_ms, hold_latencies_ms, new_id)]
    cpu_s = time.process_time() - cpu_started
    unused_ahead = sum(len(holds) for holds in placed_ahead)
    lock_held_s = ledger.appender.append_lock_held_s - lock_held_started_s
    lock_parts_s = {part: held_s - lock_parts_started_s.get(part, 0.0) for part, held_s in ledger.appender.append_lock_parts_s.items()}
    thread_cpu_used = {name: thread_cpu_s(tid) - thread_cpu_started[name] for name, tid in threads.items()}
    sampler.cancel()
    batches, hold_batches = ledger.appender.batches_committed, ledger.holder.batches_committed - hold_batches_started
    if pool is not None:
        await pool.close()
    ledger.close()
    engine.dispose()
    return {"settlements": sum(counts), "latencies_ms": latencies_ms, "hold_latencies_ms": hold_latencies_ms, "cpu_s": cpu_s, "thread_cpu_s": thread_cpu_used,
            "lock_held_s": lock_held_s, "lock_parts_s": lock_parts_s,
            "batches": batches, "hold_batches": hold_batches, "per_second": per_second,
            "holds_placed_in_window": pool.pools_placed if pool is not None else sum(counts) - (holds_ahead * producers - unused_ahead)}


async def _sample_per_second(ledger: Ledger, out: list[int]) -> None:
    """Appends committed in each second: a falling series means the run is not steady."""
    last = ledger.appender.commands_committed
    while True:
        await asyncio.sleep(1.0)
        now = ledger.appender.commands_committed
        out.append(now - last)
        last = now


def place_ahead(ledger: Ledger, customer: int, count: int, new_id) -> list:
    """`count` holds for one producer, placed before the clock starts; popped from the end."""
    futures = [ledger.holder.submit(PlaceHold(customer, HOLD_NANO_USD, hold_key(new_id("chatcmpl-")), ttl_s=HOLD_TTL_S_MAX))
               for _ in range(count)]
    return [future.result() for future in futures]


def process_load(args: tuple) -> dict:
    tune_garbage_collector()  # as every long-running Paralon process does
    return run_on_service_loop(_process_load(*args))  # the replicas' event loop


def warm_up(ledger: Ledger, customers: list[int], owners: list[int], rounds: int = 4, batch: int = 1000) -> None:
    """Some traffic, then ANALYZE: a production database has statistics, and a
    fresh one planned from empty tables would measure the planner, not the ledger."""
    for r in range(rounds):
        holds = [ledger.holder.submit(PlaceHold(customers[i % len(customers)], HOLD_NANO_USD, f"warm:{r}:{i}")) for i in range(batch)]
        settles = [ledger.appender.submit(cmd.SettleRequest(h.result().hold_id, owners[i % len(owners)], 1000, f"warm:{r}:{i}", f"warm:{r}:{i}"))
                   for i, h in enumerate(holds)]
        for s in settles:
            s.result()
    with ledger.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")
        conn.commit()


def run_load(url: str, processes: int, producers: int, seconds: float, batch_size_max: int, batch_wait_ms: float,
             balance_guard: bool = True, postings_guard: bool = True, flush_wait: bool = True,
             postings_in_event_row: bool = False, flush_after_commit: bool = True, holds_ahead: int = 0,
             random_ids: bool = False, rate_per_s: float | None = None, flush_delay_ms: float = 0.0,
             pooled_holds: bool = False) -> dict:
    """Producers spread over `processes` processes, as proxy replicas would be;
    with `rate_per_s`, requests arriving at that rate in all instead."""
    engine = make_engine(url, pool_size=4)
    migrate(engine)
    if not flush_wait:  # what waiting for the WAL flush at each commit costs: every session of the database skips it
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{engine.url.database}" SET synchronous_commit = off')
    if not balance_guard:  # what the guard of migrations 0013 and 0030 costs: measure without it
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER account_balances_guard ON account_balances")
    if not postings_guard:  # and the postings guard of migration 0016
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER ledger_postings_guard ON ledger_postings")
    if postings_in_event_row:  # migration 0031's layout, as `paralon ledger postings-in-event-row on` sets it
        with engine.begin() as conn:
            set_postings_in_event_row(conn, True)
    ledger = Ledger(engine)
    customers, owners = funded_accounts(ledger, CUSTOMERS, OWNERS)
    warm_up(ledger, customers, owners)
    ledger.close()
    # Every process starts producing at the same moment.
    start_at = time.time() + 3.0 + holds_ahead * producers / HOLDS_PLACED_AHEAD_PER_S
    libpq_url = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    jobs = [(url, producers // processes, customers, owners, start_at, seconds, batch_size_max, batch_wait_ms, flush_after_commit,
             holds_ahead, random_ids, None if rate_per_s is None else rate_per_s / processes, flush_delay_ms, pooled_holds)] * processes
    with multiprocessing.get_context("spawn").Pool(processes) as pool, engine.connect() as watcher:
        pending = pool.map_async(process_load, jobs)
        time.sleep(max(0.0, start_at - time.time()))
        disk_started = disk_snapshot(watcher)
        watcher.rollback()
        postgres_cpu_started, idle_started = postgres_cpu_s_by_pid(), idle_cpu_s()
        sampler = AppenderSampler(libpq_url)
        sampler.start()
        time.sleep(max(0.0, start_at + seconds - time.time()))
        postgres_cpu_used = postgres_cpu_s_by_pid()  # before the producers disconnect and their backends exit
        appender_time_shares = sampler.shares()
        machine_idle_share = (idle_cpu_s() - idle_started) / (seconds * (os.cpu_count() or 1))
        parts = pending.get()
        disk_used = disk_snapshot(watcher)  # after the last settlement: each one counted is in it
        watcher.rollback()
    postgres_cpu_s = cpu_used_between(postgres_cpu_started, postgres_cpu_used)
    with engine.connect() as conn:
        report = verify(conn)
    engine.dispose()
    latencies_ms = sorted(x for part in parts for x in part["latencies_ms"])
    hold_latencies_ms = sorted(x for part in parts for x in part["hold_latencies_ms"])
    settled = sum(part["settlements"] for part in parts)
    placed_in_window = sum(part["holds_placed_in_window"] for part in parts)
    return {
        "settlements": settled,
        "settlements_per_s": round(settled / seconds, 1),
        # From the settlement's submission (closed loop), or from the request's arrival (open loop).
        "settle_latency_ms_p50": round(statistics.median(latencies_ms), 2),
        "settle_latency_ms_p99": round(percentile(latencies_ms, 0.99), 2),
        # Open loop only: requests offered per second, and their holds' latency from arrival.
        **({} if rate_per_s is None else {
            "arrivals_per_s": rate_per_s,
            "hold_latency_ms_p50": round(statistics.median(hold_latencies_ms), 2),
            "hold_latency_ms_p99": round(percentile(hold_latencies_ms, 0.99), 2),
        }),
        "settle_batch_size_mean": round(settled / max(sum(part["batches"] for part in parts), 1), 1),
        # Holds placed in the window (one per settlement, unless placed before
        # the clock or pooled) per batch, each batch one call of the hold function.
        "hold_batch_size_mean": round(placed_in_window / max(sum(part["hold_batches"] for part in parts), 1), 1),
        # Non-zero with --holds-placed-before: producers ran out of the holds placed ahead.
        "holds_placed_in_window": placed_in_window,
        "producer_cpu_us_per_settlement": round(sum(part["cpu_s"] for part in parts) / max(settled, 1) * 1e6, 1),
        # The same CPU by thread: the callers' event loop, the durable writer,
        # the holds' writer, the durable writer's flush waiter.
        "producer_cpu_us_per_settlement_by_thread": {
            name: round(sum(part["thread_cpu_s"][name] for part in parts) / max(settled, 1) * 1e6, 1)
            for name in parts[0]["thread_cpu_s"]
        },
        # The append lock is held by one process at a time: a share near 1 means
        # the lock, not the cores, is what limits settlements per second.
        "append_lock_held_share": round(sum(part["lock_held_s"] for part in parts) / seconds, 3),
        "append_lock_held_us_per_settlement": round(sum(part["lock_held_s"] for part in parts) / max(settled, 1) * 1e6, 1),
        # What the lock was held for: the rules that read balances and the hash
        # chain (Python), the rows' COPYs and the statement after them, the commit.
        "append_lock_held_us_per_settlement_by_part": {
            name: round(sum(part["lock_parts_s"].get(moment, 0.0) for part in parts) / max(settled, 1) * 1e6, 1)
            for name, moment in LOCK_PARTS.items()
        },
        "postgres_cpu_us_per_settlement": (
            round(sum(postgres_cpu_s.values()) / max(settled, 1) * 1e6, 1) if postgres_cpu_s is not None else None
        ),
        "postgres_cpu_us_per_settlement_by_role": (
            sampler.cpu_us_per_settlement_by_role(postgres_cpu_s, settled) if postgres_cpu_s is not None else None
        ),
        # The ledger's whole cost, to hold against the budget the target leaves (main).
        "cpu_us_per_settlement_in_all": (
            round((sum(part["cpu_s"] for part in parts) + sum(postgres_cpu_s.values())) / max(settled, 1) * 1e6, 1)
            if postgres_cpu_s is not None else None
        ),
        **bytes_per_settlement(disk_started, disk_used, settled),
        "machine_idle_share": round(machine_idle_share, 3),
        "appender_backend_time_shares": appender_time_shares,
        "settlements_by_second": [sum(seconds_) for seconds_ in zip(*(part["per_second"] for part in parts))],
        "verify_ok": report.ok,
    }


def held(round_result: dict, latency_bound_ms: float) -> bool:
    """An open-loop round whose requests (arrival to settled) stayed within the bound at p99."""
    return round_result["settle_latency_ms_p99"] <= latency_bound_ms


def percentile(ordered: list[float], share: float) -> float:
    return ordered[max(int(len(ordered) * share) - 1, 0)]


def flush_after_commit(args: argparse.Namespace) -> bool:
    """Whether the writer waits for its flush after the commit; never without
    the flush wait, which that wait would otherwise still make."""
    return not (args.flush_under_lock or args.without_flush_wait)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--producers", type=int, default=1024, help="concurrent producers in all")
    parser.add_argument("--processes", type=int, default=2, help="processes the producers are spread over")
    parser.add_argument("--batch-size-max", type=int, default=BATCH_SIZE_MAX_DEFAULT)
    parser.add_argument("--batch-wait-ms", type=float, default=BATCH_WAIT_MS_DEFAULT,
                        help="the settlements' writer's wait for more (default: the service's; 2 before 2026-12-04)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="ledger loads, each between two pgbench windows; the round with the median ratio is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--without-balance-guard", action="store_true", help="drop migration 0013's balance guard first")
    parser.add_argument("--without-postings-guard", action="store_true", help="drop migration 0016's postings guard first")
    parser.add_argument("--without-flush-wait", action="store_true",
                        help="commit without waiting for the WAL flush (not durable: a measurement of what the wait costs)")
    parser.add_argument("--postings-in-event-row", action="store_true",
                        help="appends put postings in their event's row (migration 0031), not in ledger_postings")
    parser.add_argument("--holds-placed-before", type=int, default=0, metavar="N",
                        help="place each producer's first N holds before the clock starts (what free holds would give)")
    parser.add_argument("--flush-under-lock", action="store_true",
                        help="the durable writer waits for each batch's flush before it frees the append lock (as before)")
    parser.add_argument("--flush-delay-ms", type=float, default=0.0, metavar="MS",
                        help="each flush barrier of the ledger's writers sleeps this long on the server first: "
                             "a slower disk's flush (pgbench's commits are not slowed)")
    parser.add_argument("--pooled-holds", action="store_true",
                        help="each process's requests reserve from pooled holds (ledger.hold_pool) and capture from them "
                             "not finally: no hold row per request")
    parser.add_argument("--random-request-ids", action="store_true", help="request ids as the proxy made them before: UUIDv4")
    parser.add_argument("--arrivals-per-s", type=float, nargs="+", metavar="RATE",
                        help="open loop: requests arrive at each RATE in turn (one round each, instead of --rounds "
                             "of closed-loop producers) until one is not held; the highest held is reported")
    parser.add_argument("--latency-bound-ms", type=float, default=LATENCY_BOUND_MS_DEFAULT,
                        help="open loop: a rate is held when its p99, arrival to settled, is within this")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if args.holds_placed_before < 0:
        raise SystemExit("--holds-placed-before must be 0 or more")
    if args.pooled_holds and (args.holds_placed_before or args.arrivals_per_s):
        raise SystemExit("--pooled-holds runs closed-loop producers, with no holds placed before the clock")
    if args.arrivals_per_s and (args.holds_placed_before or min(args.arrivals_per_s) <= 0 or args.latency_bound_ms <= 0):
        raise SystemExit("--arrivals-per-s takes rates above 0, a --latency-bound-ms above 0, and no --holds-placed-before")
    if normalise_url(args.database_url).get_backend_name() != "postgresql":
        raise SystemExit("the benchmark compares against pgbench: give a postgresql:// URL")

    # pgbench before, between and after the rounds: each round's ratio is to
    # the pgbench windows on either side of it, and the median round is reported.
    log("pgbench ...")
    tps = [pgbench_tps(args.database_url, int(args.seconds))]
    rates = args.arrivals_per_s or [None] * args.rounds
    rounds = []
    for r, rate in enumerate(rates):
        offered = "closed loop" if rate is None else f"{rate:.0f} arrivals/s"
        log(f"  {tps[-1]:.0f} tps; ledger load, round {r + 1} of {len(rates)} ({offered}) ...")
        with ScratchDatabase(args.database_url, "paralon_bench") as scratch:
            rounds.append(run_load(scratch.url.render_as_string(hide_password=False), args.processes, args.producers,
                                   args.seconds, args.batch_size_max, args.batch_wait_ms, not args.without_balance_guard,
                                   not args.without_postings_guard, not args.without_flush_wait, args.postings_in_event_row,
                                   flush_after_commit(args), args.holds_placed_before, args.random_request_ids, rate,
                                   args.flush_delay_ms, args.pooled_holds))
        log(f"  {rounds[-1]['settlements_per_s']:.0f} settlements/s, p99 {rounds[-1]['settle_latency_ms_p99']:.0f} ms; pgbench ...")
        tps.append(pgbench_tps(args.database_url, int(args.seconds)))
        if rate is not None and not held(rounds[-1], args.latency_bound_ms):
            break
    ratios = [round(part["settlements_per_s"] / ((tps[i] + tps[i + 1]) / 2), 2) for i, part in enumerate(rounds)]
    if args.arrivals_per_s:
        held_rounds = [i for i, part in enumerate(rounds) if held(part, args.latency_bound_ms)]
        if not held_rounds:
            tried = ", ".join(f"{part['arrivals_per_s']:.0f}/s: {part['settle_latency_ms_p99']:.0f} ms" for part in rounds)
            raise SystemExit(f"no rate was held within {args.latency_bound_ms} ms at p99 ({tried}): offer less")
        reported = max(held_rounds, key=lambda i: rounds[i]["arrivals_per_s"])  # the highest rate held
    else:
        reported = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    result = rounds[reported]
    result.update(
        pgbench_tps_before=round(tps[reported], 1),
        pgbench_tps_after=round(tps[reported + 1], 1),
        ratio_to_pgbench_tps=ratios[reported],
        ratio_to_pgbench_tps_by_round=ratios,
        cpu_us_per_settlement_budget_at_target=round(
            (os.cpu_count() or 1) * 1e6 / (TARGET_RATIO_TO_PGBENCH * (tps[reported] + tps[reported + 1]) / 2), 1),
        target_ratio_to_pgbench=TARGET_RATIO_TO_PGBENCH,
        settlements_per_s_by_round=[part["settlements_per_s"] for part in rounds],
        pgbench_tps_by_window=[round(t, 1) for t in tps],
        reported_round=reported + 1,  # the median ratio (closed loop), or the highest rate held (open loop)
        **({} if not args.arrivals_per_s else {
            "latency_bound_ms": args.latency_bound_ms,
            "rounds_held": [held(part, args.latency_bound_ms) for part in rounds],
        }),
        producers=args.producers,
        processes=args.processes,
        seconds=args.seconds,
        balance_guard=not args.without_balance_guard,
        postings_guard=not args.without_postings_guard,
        flush_wait=not args.without_flush_wait,
        postings_in_event_row=args.postings_in_event_row,
        flush_after_commit=flush_after_commit(args),
        holds_placed_before=args.holds_placed_before,
        pooled_holds=args.pooled_holds,
        random_request_ids=args.random_request_ids,
        flush_delay_ms=args.flush_delay_ms,
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in sorted(result.items()):
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
