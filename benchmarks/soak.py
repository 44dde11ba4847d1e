"""A long soak under chaos: do the books still match what callers received?

Two `paralon serve` replicas on one PostgreSQL database, a mixed fleet of
simulated workers (time-scaled), and many concurrent callers: agent traffic
(tool-call histories, tool replies, tool definitions, structured output) and
chat traffic (streaming and not, some callers leaving early), on a key with a
spend limit, customers with small balances and one well funded. Every
`--chaos-interval-s`, one replica and one worker are killed with SIGKILL and
restarted on the same port.

The callers keep their own count of what they received: completion tokens
counted from the chunks of every stream (the simulated worker sends one token
per chunk) and the words of every whole answer; the usage the proxy reported
is kept beside it. At the end, once every hold has expired and been swept or
settled, the ledger's settlements are compared with that count, request by
request, grouped by how each request ended.

    python benchmarks/soak.py --json [--minutes 30] [--chaos-interval-s 180]

Prints one JSON line: requests (by outcome), tokens_delivered, tokens_billed,
difference (billed - delivered), where it comes from, and what is left of it
beyond the documented rule (a caller who leaves is billed what was produced),
limit_overshoot_nano_usd (the limited key's spend beyond its limit plus any
customer below zero available), verify_ok (`paralon ledger verify`), and the
kill counts. No timing thresholds: it reports, it does not judge.
Every process it starts is stopped on exit, Ctrl-C and errors included.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import ScratchDatabase, log  # noqa: E402
from sqlalchemy import select  # noqa: E402

from ledger import accounts as acc  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger.money import usd_to_nano_usd  # noqa: E402
from ledger.schema import accounts, ledger_events  # noqa: E402
from ledger.service import append_now  # noqa: E402
from proxy import keys  # noqa: E402
from proxy import workers as registry  # noqa: E402
from tests.support.harness import MODEL, free_port, make_fleet  # noqa: E402

WORKER_PROFILES = ("h200", "rtx-pro-6000", "2x4090", "2x5090")
SMALL_CUSTOMERS = 3
SMALL_CREDITS_USD = "0.004"
RICH_CREDITS_USD = "1000"
KEY_LIMIT_USD = "0.005"
HOLD_TTL_S = 20
USAGE_RECORD_INTERVAL_S = 1.0  # how often `serve` records delivered usage against a running stream's hold
RECENT_WINDOW_S = 2 * USAGE_RECORD_INTERVAL_S
HOLD_SWEEP_INTERVAL_MS = 1000
HEALTH_INTERVAL_MS = 500
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 120.0
PAUSE_BETWEEN_REQUESTS_S = (0.05, 0.5)
MAX_TOKENS_RANGE = (16, 200)
EARLY_LEAVE_SHARE = 0.1
STREAM_SHARE = 0.7
AGENT_SHARE = 0.4
LIMITED_KEY_SHARE = 0.15
SMALL_CUSTOMER_SHARE = 0.15
BALANCE_SAMPLE_INTERVAL_S = 2.0
# After the callers stop: every hold must have expired and been swept by then.
HOLDS_SETTLE_WAIT_S = HOLD_TTL_S + 60
CUT_SHORT = ("cut_off", "error_after_tokens", "caller_left")
DATABASE_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"
SERVE_ARGS = ["-c", "from app.cli import main; main()"]
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the documentation.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}


class Processes:
    """Every child this benchmark starts, each restartable on its own port, all stopped at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: dict[str, tuple[list[str], dict, subprocess.Popen]] = {}

    def start(self, name: str, args: list[str], env: dict, health_url: str) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as output:
            process = subprocess.Popen([sys.executable, *args], env=env, stdout=output, stderr=subprocess.STDOUT)
        self.running[name] = (args, env, process)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited at start; see {self.log_dir / (name + '.log')}")
            try:
                if httpx.get(health_url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not answer {health_url} in time")

    def kill_and_restart(self, name: str, health_url: str) -> None:
        args, env, process = self.running[name]
        process.kill()  # SIGKILL: no finally, no settlement, no release
        process.wait(STOP_TIMEOUT_S)
        self.start(name, args, env, health_url)

    def stop_all(self) -> None:
        for _, _, process in self.running.values():
            if process.poll() is None:
                process.terminate()
        for _, _, process in self.running.values():
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)


@dataclass
class Outcome:
    """One request as its caller saw it."""

    kind: str  # completed, caller_left, error_after_tokens, cut_off, refused_<status>, ...
    request_id: str | None = None
    tokens: int = 0  # counted by the caller
    text_bytes: int = 0
    usage_completion_tokens: int | None = None  # what the proxy said it billed
    # (monotonic time, tokens) at each token of the last RECENT_WINDOW_S: a stream
    # cut by a crash may go unbilled for what arrived after its last usage record.
    recent: deque = field(default_factory=deque)

    def count_token(self) -> None:
        self.tokens += 1
        now = time.monotonic()
        self.recent.append((now, self.tokens))
        while self.recent and now - self.recent[0][0] > RECENT_WINDOW_S:
            self.recent.popleft()

    def tokens_in_last_record_interval(self) -> int:
        """Tokens that arrived within one usage-record interval before the last one."""
        if not self.recent:
            return 0
        last_at = self.recent[-1][0]
        return sum(1 for at, _ in self.recent if last_at - at <= USAGE_RECORD_INTERVAL_S)


def chat_body(rng: random.Random, turn: int) -> dict:
    max_tokens = rng.randint(*MAX_TOKENS_RANGE)
    if rng.random() < AGENT_SHARE:
        arguments = orjson.dumps({"query": f"page {turn}", "filters": ["mats"] * rng.randint(1, 40)}).decode()
        messages = [
            {"role": "system", "content": "You are a documentation agent."},
            {"role": "user", "content": f"Find the page about mats, turn {turn}."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{turn}", "type": "function", "function": {"name": "search_docs", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": "Mats: warm, woollen. " * rng.randint(1, 30)},
            {"role": "user", "content": "Summarise what you found."},
        ]
        body = {"model": MODEL, "messages": messages, "tools": [SEARCH_TOOL], "max_tokens": max_tokens}
        if rng.random() < 0.5:
            body["response_format"] = ANSWER_SCHEMA
        return body
    content = f"Tell me something, turn {turn}. " + "More context. " * rng.randint(0, 60)
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


async def stream_once(client: httpx.AsyncClient, url: str, body: dict, headers: dict, leave_after: int | None) -> Outcome:
    outcome = Outcome("cut_off")
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(f"refused_{response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome.kind = "completed"
                    break
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    outcome.kind = "error_after_tokens" if outcome.tokens else "error_before_tokens"
                    break
                outcome.request_id = chunk.get("id") or outcome.request_id
                if chunk.get("usage"):
                    outcome.usage_completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        outcome.count_token()
                        outcome.text_bytes += len(text.encode())
                if leave_after is not None and outcome.tokens >= leave_after:
                    outcome.kind = "caller_left"
                    break
    except httpx.ConnectError:
        return Outcome("replica_down")
    except httpx.HTTPError:
        outcome.kind = "cut_off" if outcome.tokens else "failed_before_tokens"
    return outcome


async def ask_once(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Outcome:
    try:
        response = await client.post(url, json=body, headers=headers)
    except httpx.ConnectError:
        return Outcome("replica_down")
    except httpx.HTTPError:
        return Outcome("failed_before_tokens")  # the whole answer never arrived: nothing was received
    if response.status_code != 200:
        return Outcome(f"refused_{response.status_code}" if response.status_code < 500 else f"failed_{response.status_code}")
    answer = response.json()
    text = answer["choices"][0]["message"].get("content") or ""
    # The simulated worker's tokens are space-led words.
    return Outcome("completed", answer["id"], len(text.split()), len(text.encode()), answer["usage"]["completion_tokens"])


def pick_group(draw: float) -> str:
    if draw < LIMITED_KEY_SHARE:
        return "limited"
    return "small" if draw < LIMITED_KEY_SHARE + SMALL_CUSTOMER_SHARE else "rich"


async def caller_loop(index: int, keys_by_group: dict[str, list[str]], replica_urls: list[str], deadline: float,
                      outcomes: list[Outcome]) -> None:
    rng = random.Random(index)
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        for turn in itertools.count():
            if time.monotonic() >= deadline:
                return
            key = rng.choice(keys_by_group[pick_group(rng.random())])
            url = replica_urls[(index + turn) % len(replica_urls)] + "/v1/chat/completions"
            headers = {"authorization": f"Bearer {key}"}
            body = chat_body(rng, turn)
            if rng.random() < STREAM_SHARE:
                leave_after = rng.randint(1, body["max_tokens"]) if rng.random() < EARLY_LEAVE_SHARE else None
                outcome = await stream_once(client, url, body, headers, leave_after)
            else:
                outcome = await ask_once(client, url, body, headers)
            outcomes.append(outcome)
            await asyncio.sleep(rng.uniform(*PAUSE_BETWEEN_REQUESTS_S))


async def chaos_loop(processes: Processes, replicas: list[tuple[str, str]], workers: list[tuple[str, str]],
                     interval_s: float, deadline: float, kills: Counter) -> None:
    rng = random.Random(7)
    while time.monotonic() + interval_s < deadline:
        await asyncio.sleep(interval_s)
        name, health = replicas[kills["replica"] % len(replicas)]
        log(f"chaos: kill -9 {name}")
        await asyncio.to_thread(processes.kill_and_restart, name, health)
        kills["replica"] += 1
        name, health = rng.choice(workers)
        log(f"chaos: kill -9 {name}")
        await asyncio.to_thread(processes.kill_and_restart, name, health)
        kills["worker"] += 1


async def balance_watch(engine, customer_ids: list[int], deadline: float, lowest: dict[int, int]) -> None:
    """The lowest available balance seen per customer (credits minus holds)."""
    def sample() -> None:
        with engine.connect() as conn:
            for account_id in customer_ids:
                available = acc.read_balance(conn, account_id).available_nano_usd
                lowest[account_id] = min(lowest.get(account_id, available), available)

    while time.monotonic() < deadline:
        await asyncio.to_thread(sample)
        await asyncio.sleep(BALANCE_SAMPLE_INTERVAL_S)


async def run_traffic(args, processes, replicas, workers, keys_by_group, customer_ids, engine) -> tuple[list[Outcome], Counter, dict]:
    deadline = time.monotonic() + args.minutes * 60
    outcomes: list[Outcome] = []
    kills: Counter = Counter()
    lowest: dict[int, int] = {}
    replica_urls = [health.rsplit("/health", 1)[0] for _, health in replicas]
    tasks = [caller_loop(i, keys_by_group, replica_urls, deadline, outcomes) for i in range(args.clients)]
    tasks.append(chaos_loop(processes, replicas, workers, args.chaos_interval_s, deadline, kills))
    tasks.append(balance_watch(engine, customer_ids, deadline, lowest))
    await asyncio.gather(*tasks)
    return outcomes, kills, lowest


def add_customer(engine, name: str, credits_usd: str, spend_limit_usd: str | None = None) -> tuple[int, int, str]:
    with engine.begin() as conn:
        customer = acc.create_account(conn, cmd.CUSTOMER, name, None)
        limit = usd_to_nano_usd(spend_limit_usd) if spend_limit_usd else None
        key_id, key = keys.create_key(conn, customer, spend_limit_nano_usd=limit)
    append_now(engine, cmd.GrantCredits(customer, usd_to_nano_usd(credits_usd), "soak credits", f"grant:{customer}"))
    return customer, key_id, key


def wait_for_holds(engine, customer_ids: list[int]) -> int:
    """Held nano-USD left once every hold has had time to expire and be swept."""
    deadline = time.monotonic() + HOLDS_SETTLE_WAIT_S
    while True:
        with engine.connect() as conn:
            held = sum(acc.read_balance(conn, c).held_nano_usd for c in customer_ids)
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(1.0)


def ledger_verify(database_url: str) -> bool:
    result = subprocess.run([sys.executable, *SERVE_ARGS, "ledger", "verify", "--json"], capture_output=True, text=True,
                            env={**os.environ, "PARALON_DATABASE_URL": database_url}, timeout=600)
    try:
        return bool(json.loads(result.stdout.strip().splitlines()[-1])["ok"]) and result.returncode == 0
    except (ValueError, IndexError, KeyError):
        log(f"ledger verify said: {result.stdout[-500:]} {result.stderr[-500:]}")
        return False


def settlements(engine) -> list[dict]:
    with engine.connect() as conn:
        rows = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "RequestSettled"))
        return [orjson.loads(r.payload) for r in rows]


def event_count(engine, event_type: str) -> int:
    with engine.connect() as conn:
        return len(conn.execute(select(ledger_events.c.seq).where(ledger_events.c.event_type == event_type)).all())


def report(outcomes: list[Outcome], settled: list[dict], limited_key_id: int, limit_nano_usd: int,
           lowest: dict[int, int], final_available: dict[int, int]) -> dict:
    billed_by_request = {s["request_id"]: s["meta"]["completion_tokens"] for s in settled}
    by_outcome: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "delivered": 0, "billed": 0})
    seen: set[str] = set()
    for outcome in outcomes:
        entry = by_outcome[outcome.kind]
        entry["requests"] += 1
        entry["delivered"] += outcome.tokens
        if outcome.request_id:
            seen.add(outcome.request_id)
            entry["billed"] += billed_by_request.get(outcome.request_id, 0)
    for entry in by_outcome.values():
        entry["difference"] = entry["billed"] - entry["delivered"]
    unseen = sum(tokens for request_id, tokens in billed_by_request.items() if request_id not in seen)
    delivered = sum(o.tokens for o in outcomes)
    billed = sum(billed_by_request.values())
    limited_spent = sum(s["charge_nano_usd"] for s in settled if s["meta"].get("api_key_id") == limited_key_id)
    usage_mismatch = sum(1 for o in outcomes if o.kind == "completed" and o.usage_completion_tokens != o.tokens)
    key_overshoot = max(0, limited_spent - limit_nano_usd)
    below_zero = -sum(min(0, v) for v in final_available.values())
    # The documented rules (README, "What is billed, whatever happens"): a caller who leaves is billed what the
    # worker produced, which can be a little more than it read; a stream cut by a crash is billed at the usage last
    # recorded against its hold, so what arrived within one record interval before the cut may go unbilled.
    documented = by_outcome["caller_left"]["difference"] if "caller_left" in by_outcome else 0
    for outcome in outcomes:
        if outcome.kind == "cut_off" and outcome.request_id:
            unbilled = outcome.tokens - billed_by_request.get(outcome.request_id, 0)
            documented -= max(0, min(unbilled, outcome.tokens_in_last_record_interval()))
    return {
        "requests": dict(sorted(Counter(o.kind for o in outcomes).items())),
        "requests_total": len(outcomes),
        "tokens_delivered": delivered,
        "tokens_billed": billed,
        "difference": billed - delivered,
        "difference_by_outcome": {kind: entry for kind, entry in sorted(by_outcome.items()) if entry["difference"]},
        "difference_beyond_the_documented_rule": billed - delivered - documented,
        "tokens_billed_for_requests_no_caller_saw": unseen,
        "completed_with_usage_unlike_the_callers_count": usage_mismatch,
        "bytes_delivered_cut_short": sum(o.text_bytes for o in outcomes if o.kind in CUT_SHORT),
        "limit_overshoot_nano_usd": key_overshoot + below_zero,
        "limited_key": {"limit_nano_usd": limit_nano_usd, "spent_nano_usd": limited_spent, "overshoot_nano_usd": key_overshoot},
        "customers_below_zero_nano_usd": below_zero,
        "lowest_available_seen_nano_usd": min(lowest.values()) if lowest else None,
    }


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", DATABASE_URL_DEFAULT))
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--chaos-interval-s", type=float, default=180.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--time-scale", type=float, default=2.0, help="simulated workers run this much faster than the cards")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # SIGTERM and SIGINT (even where a shell started it ignoring SIGINT) stop
    # the run through the finally blocks below, which stop every child.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)

    log_dir = Path(tempfile.mkdtemp(prefix="paralon-soak-"))
    processes = Processes(log_dir)
    with ScratchDatabase(args.database_url, "paralon_soak") as scratch:
        url = scratch.url.render_as_string(hide_password=False)
        try:
            result = soak(args, url, processes)
        except KeyboardInterrupt:
            log("interrupted: every process started here is stopped, the scratch database dropped")
            raise SystemExit(130) from None
        finally:
            processes.stop_all()
    result["logs"] = str(log_dir)
    print(json.dumps(result, sort_keys=True) if args.json else "\n".join(f"{k}: {v}" for k, v in sorted(result.items())))


def soak(args, url: str, processes: Processes) -> dict:
    worker_ports = [free_port() for _ in WORKER_PROFILES]
    workers = []
    for profile, port in zip(WORKER_PROFILES, worker_ports):
        name = f"worker-{profile}-{port}"
        env = {**os.environ, "PARALON_SIM_TIME_SCALE": str(args.time_scale)}
        health = f"http://127.0.0.1:{port}/health"
        processes.start(name, [*SERVE_ARGS, "sim-worker", "--port", str(port), "--profile", profile, "--model", MODEL],
                        env, health)
        workers.append((name, health))
    fleet = make_fleet(url, [f"http://127.0.0.1:{p}" for p in worker_ports], credits_usd=RICH_CREDITS_USD)
    engine = fleet.engine
    _, limited_key_id, limited_key = add_customer(engine, "limited key customer", RICH_CREDITS_USD, KEY_LIMIT_USD)
    small = [add_customer(engine, f"small customer {i}", SMALL_CREDITS_USD) for i in range(SMALL_CUSTOMERS)]
    with engine.connect() as conn:
        customer_ids = list(conn.execute(select(accounts.c.id).where(accounts.c.kind == cmd.CUSTOMER)).scalars())
    keys_by_group = {"rich": [fleet.key], "limited": [limited_key], "small": [key for _, _, key in small]}

    serve_env = {**os.environ, "PARALON_DATABASE_URL": url, "PARALON_HOLD_TTL_S": str(HOLD_TTL_S),
                 "PARALON_HOLD_SWEEP_INTERVAL_MS": str(HOLD_SWEEP_INTERVAL_MS),
                 "PARALON_HEALTH_INTERVAL_MS": str(HEALTH_INTERVAL_MS), "PARALON_GROUP_COMMIT_WAIT_MS": "1"}
    replicas = []
    for _ in range(2):
        port = free_port()
        name, health = f"serve-{port}", f"http://127.0.0.1:{port}/health"
        processes.start(name, [*SERVE_ARGS, "serve", "--port", str(port)], serve_env, health)
        replicas.append((name, health))

    log(f"soak: {args.minutes} min, {args.clients} callers, chaos every {args.chaos_interval_s} s; logs in {processes.log_dir}")
    outcomes, kills, lowest = asyncio.run(run_traffic(args, processes, replicas, workers, keys_by_group, customer_ids, engine))
    log(f"callers stopped after {len(outcomes)} requests; waiting for holds to expire and be swept ...")
    held_left = wait_for_holds(engine, customer_ids)
    with engine.connect() as conn:
        final_available = {c: acc.read_balance(conn, c).available_nano_usd for c in customer_ids}
        suspended = sum(1 for w in registry.list_workers(conn) if w.state == "suspended")
    result = report(outcomes, settlements(engine), limited_key_id, usd_to_nano_usd(KEY_LIMIT_USD), lowest, final_available)
    result.update({
        "holds_left_nano_usd": held_left,
        "verify_ok": ledger_verify(url),
        "kills": {"replica": kills["replica"], "worker": kills["worker"]},
        "usage_discrepancies": event_count(engine, "UsageDiscrepancyRecorded"),
        "workers_suspended": suspended,
        "minutes": args.minutes,
        "chaos_interval_s": args.chaos_interval_s,
        "clients": args.clients,
        "time_scale": args.time_scale,
        "hold_ttl_s": HOLD_TTL_S,
    })
    engine.dispose()
    return result


if __name__ == "__main__":
    main()
