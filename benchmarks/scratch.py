"""What every benchmark shares: a scratch database of its own (created, then
dropped), and progress lines on stderr (stdout is the JSON)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import create_engine, text  # noqa: E402

from app.migrate import migrate  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger.db import make_engine, normalise_url  # noqa: E402
from ledger.hold_commands import PlaceHold  # noqa: E402

BENCH_CREDITS_NANO_USD = 10**15  # far more than any run spends
BENCH_HOLD_NANO_USD = 5_000_000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def postgres_cpu_s_by_pid() -> dict[int, float] | None:
    """CPU seconds used so far by each local `postgres` process (Linux /proc), or None."""
    used, ticks_per_s = {}, os.sysconf("SC_CLK_TCK")
    try:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)
                if fields[0].endswith("(postgres"):
                    parts = fields[1].split()
                    used[int(pid)] = (int(parts[11]) + int(parts[12])) / ticks_per_s
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        return None
    return used


def postgres_cpu_s() -> float | None:
    """CPU seconds used so far by every local `postgres` process (Linux /proc), or None."""
    used = postgres_cpu_s_by_pid()
    return None if used is None else sum(used.values())


def batch_arguments(description: str, batches: int, batch_size: int = 400) -> argparse.Namespace:
    """The options of a benchmark that writes settlement batches to a scratch
    database (400 settlements a batch by default: the throughput run's mean was about this)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--batches", type=int, default=batches)
    parser.add_argument("--batch-size", type=int, default=batch_size, help="settlements per batch")
    parser.add_argument("--warm-up-batches", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    return parser.parse_args()


def funded_accounts(ledger, customers: int, owners: int) -> tuple[list[int], list[int]]:
    """`customers` customers, each granted the benchmark's credits, and `owners` owners."""
    customer_ids = [ledger.create_account(cmd.CUSTOMER, f"bench customer {i}") for i in range(customers)]
    owner_ids = [ledger.create_account(cmd.OWNER, f"bench owner {i}") for i in range(owners)]
    for customer in customer_ids:
        ledger.append(cmd.GrantCredits(customer, BENCH_CREDITS_NANO_USD, "benchmark credits", f"grant:{customer}"))
    return customer_ids, owner_ids


def bench_settlement(hold_id: int, owner: int, tag: str, i: int) -> cmd.SettleRequest:
    """The `i`th settlement of batch `tag`: a request's charge and metadata, varied as traffic varies them."""
    return _settlement(hold_id, owner, i, f"req:{tag}:{i}", f"s:{tag}:{i}")


def _settlement(hold_id: int, owner: int, i: int, request_id: str, key: str) -> cmd.SettleRequest:
    return cmd.SettleRequest(hold_id, owner, 150 * (900 + i % 97), request_id, key, {"model": "bench", "prompt_tokens": 900 + i % 97})


def short_keys(tag: str, size: int) -> list[tuple[str, str, str]]:
    """Batch `tag`'s own keys for `hold_then_settle`: (the hold's, the request id, the settlement's)."""
    return [(f"h:{tag}:{i}", f"req:{tag}:{i}", f"s:{tag}:{i}") for i in range(size)]


def random_request_id(prefix: str) -> str:
    """A request id as the proxy made them before `new_request_id`: UUIDv4, random."""
    return prefix + uuid.uuid4().hex


def hold_then_settle(ledger, customers: list[int], owners: list[int], keys: list[tuple[str, str, str]]) -> None:
    """One batch of holds, then their settlements, each through its group-commit
    writer, one per (hold's key, request id, settlement's key) of `keys`."""
    holds = [ledger.holder.submit(PlaceHold(customers[i % len(customers)], BENCH_HOLD_NANO_USD, hold_key))
             for i, (hold_key, _, _) in enumerate(keys)]
    settles = [ledger.appender.submit(_settlement(hold.result().hold_id, owners[i % len(owners)], i, request_id, key))
               for i, (hold, (_, request_id, key)) in enumerate(zip(holds, keys, strict=True))]
    for settled in settles:
        settled.result()


def modify_table_nodes(plan: dict) -> list[dict]:
    """The inserts, updates and deletes of an EXPLAIN (FORMAT JSON) plan, at any depth."""
    found, stack = [], [plan["Plan"]]
    while stack:
        node = stack.pop()
        if node.get("Node Type") == "ModifyTable":
            found.append(node)
        stack.extend(node.get("Plans", []))
    return found


def print_result(result: dict, one_line: bool) -> None:
    print(json.dumps(result, sort_keys=True) if one_line else json.dumps(result, indent=2, sort_keys=True))


class ScratchDatabase:
    """A PostgreSQL database on the server of `server_url`, or a SQLite file beside its path."""

    def __init__(self, server_url: str, prefix: str) -> None:
        self.admin_url = normalise_url(server_url)
        self.name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.sqlite = self.admin_url.get_backend_name() == "sqlite"
        database = str(Path(self.admin_url.database).with_name(f"{self.name}.db")) if self.sqlite else self.name
        self.url = self.admin_url.set(database=database)

    def __enter__(self) -> "ScratchDatabase":
        if not self.sqlite:
            with create_engine(self.admin_url, isolation_level="AUTOCOMMIT").connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        return self

    def __exit__(self, *exc) -> None:
        if self.sqlite:
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(self.url.database + suffix).unlink(missing_ok=True)
            return
        with create_engine(self.admin_url, isolation_level="AUTOCOMMIT").connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))

    def engine(self):
        """A migrated engine on the scratch database."""
        engine = make_engine(self.url.render_as_string(hide_password=False), pool_size=4)
        migrate(engine)
        return engine

    def libpq_args(self) -> tuple[list[str], dict]:
        """Connection arguments for PostgreSQL's own tools (pgbench)."""
        url = self.url
        args = ["-h", url.host or "127.0.0.1", "-p", str(url.port or 5432), "-U", url.username or "postgres"]
        return args, dict(os.environ, PGPASSWORD=url.password or "")
