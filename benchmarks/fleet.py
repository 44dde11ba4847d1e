"""Routing across a mixed fleet: the affinity router against two baselines,
random and round robin, on the same workload in the same run.

A simulated fleet (by default one h200, one rtx-pro-6000, two 2x4090 and two
2x5090, each `python -m proxy.sim.cli` in a process of its own) is registered
on one scratch PostgreSQL database, and two `paralon serve` replicas route to
it; clients alternate between the two replicas request by request. First each
worker's capacity is measured alone (driven directly, no proxy). Then, for
each policy in turn (PARALON_ROUTING_POLICY = affinity, random, round_robin),
on fresh replicas, three phases, each on workers started afresh (empty
caches) at a speed of its own (PARALON_SIM_TIME_SCALE):

1. follow-ups (time scale 0.5): conversations whose first turn carries a
   long prefix unique to the conversation (system prompt and first question),
   then follow-up turns that append the answer and a short question, a few
   conversations at a time; time to the first streamed content of the
   follow-ups, and the workers' own prefix-cache hit rate
   (`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`).
2. saturation (time scale 0.1, so that two cores relay the fleet's tokens
   without becoming the bottleneck): closed-loop streaming callers, more than
   the fleet's summed max_num_seqs, started over 10 s; the workers' generated
   tokens per second over a window after a warm-up, against the sum of their
   capacities alone (goodput), and each worker's share of those tokens
   against its share of that capacity. Before the long prompts, whose
   holders the router keeps some room on for a while.
3. long prompts (time scale 20, for their prefill): ~8k, 40k, 90k and 180k
   tokens, one request at a time, not streamed; each request's status and the
   worker whose `vllm:prompt_tokens_total` moved.

What the replicas measured of the workers' capacity is cleared at each
change of speed, as for new workers. `paralon_route_spills_total` is read
from both replicas after each phase.

    python benchmarks/fleet.py --json            # about 8 minutes
    python benchmarks/fleet.py --quick --json    # a smoke run of about 3

Prints one JSON line:
- policies.<policy>.followups: ttft_ms_p50, ttft_ms_p90, followups_measured,
  errors, prefix_cache_hit_rate, cpu, seconds
- policies.<policy>.saturation: fleet_tok_s, goodput, worker_tok_s,
  traffic_share_pct, capacity_share_pct, share_gap_pp_max, callers, errors,
  window_s, proxy_capacity_tok_s (what the replicas measured), cpu
- policies.<policy>.long_prompts.<tokens>: statuses, workers (requests each
  worker counted), reached_holder (every request answered 200 by a worker
  whose context holds it)
- policies.<policy>.spills: requests sent past their affinity choice in each
  phase, and by reason (both replicas summed; none for the baselines)
- cpu (of a phase's window): machine_busy_pct, and <group>_core_pct for this
  process (client), the replicas and the workers, in percent of one core
- ratios: follow-ups' ttft p50 and p90 of random and of round_robin over affinity
- targets: each target of the affinity router, met or not (None: not measured)
- capacity_alone_tok_s, context_tokens: per worker
- settings, elapsed_s
The targets are reported, never turned into an exit code.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import ssl
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select, update

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import ScratchDatabase, log  # noqa: E402
from proxy.limits import SIM_PROMPT_BYTES_PER_TOKEN, SIM_PROMPT_TOKENS_PER_MESSAGE  # noqa: E402
from proxy.routing import AFFINITY, POLICIES, RANDOM, ROUND_ROBIN  # noqa: E402
from proxy.schema import workers as workers_table  # noqa: E402
from proxy.sim.profiles import SimProfile, get_profile  # noqa: E402
from tests.support.db_roles import drop_app_role  # noqa: E402
from tests.support.harness import MODEL, ServeProcess, free_port, make_fleet  # noqa: E402

DATABASE_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"
SCRATCH_PREFIX = "paralon_fleet"
FLEET_DEFAULT = "h200=1,rtx-pro-6000=1,2x4090=2,2x5090=2"
REPLICAS = 2
CREDITS_USD = "100000"

# The replicas: health probes (which are also the capacity scrapes) twice a
# second, a capacity measured every 5 s so that the router learns the fleet
# within a saturation warm-up, keys cached as in production.
HEALTH_INTERVAL_MS = 500
CAPACITY_PERIOD_MS = 5000
KEY_CACHE_TTL_MS = 1000
DIRECTORY_REFRESH_S = 1.0  # proxy/limits.py DIRECTORY_REFRESH_INTERVAL_S
HEALTH_ROUNDS_AFTER_RESTART = 3  # probes each replica makes of a restarted fleet before traffic resumes

SIM_START_TIMEOUT_S = 30.0
PROCESS_STOP_TIMEOUT_S = 10.0
ROUTABLE_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.1
REQUEST_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0
CLIENT_CONNECTIONS_MAX = 64  # of a shared client; a saturating caller has a client of its own
ERROR_PAUSE_S = 0.5  # a caller whose request failed waits this long before the next
OUTPUT_LINES_KEPT = 50  # of each replica's output, for the message when it dies

# Follow-ups: the same conversations under every policy (seeded).
WORKLOAD_SEED = 20_240_601
SYSTEM_PROMPT_BYTES = 4_000
FIRST_QUESTION_BYTES = 3_000
FOLLOWUP_QUESTION_BYTES = 200
FOLLOWUP_MAX_TOKENS = 24
FILLER_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
                "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform")

# Long prompts: what the simulated worker counts as exactly this many tokens.
LONG_PROMPT_TOKENS = (8_000, 40_000, 90_000, 180_000)
LONG_PROMPT_MAX_TOKENS = 8

# Saturation: closed-loop callers, as a multiple of max_num_seqs (summed over
# the fleet through the proxy, of the one worker alone).
FLEET_CALLERS_PER_SEQ = 1.25
ALONE_CALLERS_PER_SEQ = 1.5
# Short answers: at time scale 0.1 one still takes about 12 s at a full batch,
# and the fleet reaches its steady state within a few of them.
SATURATION_MAX_TOKENS = 16  # give or take SATURATION_MAX_TOKENS_SPREAD
SATURATION_MAX_TOKENS_SPREAD = 4
# Callers start spread over this long: load that grows, as a fleet's does, so
# that the router sees queues form before every caller has sent its first request.
FLEET_RAMP_S = 10.0
ALONE_RAMP_S = 1.0

# The affinity router's targets.
FOLLOWUP_P50_RATIO_MIN = 10.0  # random's p50 time to first token over affinity's
FOLLOWUP_P90_RATIO_MIN = 5.0
GOODPUT_MIN = 0.97
SHARE_GAP_PP_MAX = 5.0

# Metric sample names, as prometheus_client's parser names counter samples.
GENERATED = "vllm:generation_tokens_total"
PROMPTED = "vllm:prompt_tokens_total"
CACHE_HITS = "vllm:prefix_cache_hits_total"
CACHE_QUERIES = "vllm:prefix_cache_queries_total"
SPILLS = "paralon_route_spills_total"
PROXY_CAPACITY = "paralon_worker_capacity_tokens_per_s"

QUICK = {  # the default fleet, fewer requests, shorter windows
    "conversations": 24, "followups": 2, "concurrency": 8, "long_prompt_repeats": 1,
    "alone_warmup_s": 2.0, "alone_window_s": 3.0, "saturation_warmup_s": 12.0, "saturation_window_s": 6.0,
}


# --- Processes ----------------------------------------------------------------

def stop_group(process: subprocess.Popen | None) -> None:
    """Stops a child started in a session of its own, and whatever it started."""
    if process is None or process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(PROCESS_STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class Sim:
    label: str  # profile#n
    profile: SimProfile
    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, time_scale: float) -> None:
        env = {**os.environ, "PARALON_SIM_TIME_SCALE": str(time_scale)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "proxy.sim.cli", "--profile", self.profile.name, "--port", str(self.port),
             "--model", MODEL, "--max-model-len", str(self.profile.max_model_len_tokens)],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + SIM_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"simulated worker {self.label} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_INTERVAL_S)
        raise RuntimeError(f"simulated worker {self.label} did not answer in time")


class SimFleet:
    """The simulated workers, each on a port of its own that survives restarts."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.sims = [Sim(f"{name}#{n + 1}", get_profile(name), free_port())
                     for name, count in counts.items() for n in range(count)]
        self.time_scale: float | None = None

    def start(self, time_scale: float) -> None:
        for sim in self.sims:
            sim.start(time_scale)
        for sim in self.sims:
            sim.wait_healthy()
        self.time_scale = time_scale

    def stop(self) -> None:
        for sim in self.sims:
            stop_group(sim.process)

    def restart(self, time_scale: float) -> None:
        self.stop()
        self.start(time_scale)


def keep_output(replica: ServeProcess) -> deque:
    """Reads a replica's output as it comes (a full pipe would stall it), keeping the last lines."""
    lines: deque = deque(maxlen=OUTPUT_LINES_KEPT)
    threading.Thread(target=lines.extend, args=(replica.process.stdout,), daemon=True).start()
    return lines


def start_replicas(database_url: str, policy: str, replicas: list[ServeProcess]) -> None:
    """Starts REPLICAS `paralon serve` processes at once, appending each to
    `replicas` before it starts so that the caller stops every one."""
    for index in range(REPLICAS):
        replicas.append(ServeProcess(
            database_url, PARALON_ROUTING_POLICY=policy, PARALON_REPLICA_ID=f"fleet-{policy}-{index + 1}",
            PARALON_HEALTH_INTERVAL_MS=str(HEALTH_INTERVAL_MS), PARALON_CAPACITY_PERIOD_MS=str(CAPACITY_PERIOD_MS),
            PARALON_KEY_CACHE_TTL_MS=str(KEY_CACHE_TTL_MS)))
    with ThreadPoolExecutor(REPLICAS) as pool:
        list(pool.map(ServeProcess.start, replicas))
    for replica in replicas:
        keep_output(replica)


def stop_replicas(replicas: list[ServeProcess]) -> None:
    for replica in replicas:
        stop_group(replica.process)


# --- The fleet's registration ---------------------------------------------------

def reset_workers(engine) -> None:
    """The workers restarted at another speed: what the replicas measured of
    them no longer holds, so it is cleared as for new workers (which the
    router probes), as is the room kept on them for long prompts (a phase
    before may have sent some); each is unhealthy until a replica probes it."""
    with engine.begin() as conn:
        conn.execute(update(workers_table).values(throughput_tokens_per_s=None, capacity_saturated=False,
                                                  capacity_requests=None, capacity_measured_at=None,
                                                  long_prompts_until=None, healthy=False))


def wait_routable(engine, worker_count: int) -> None:
    """Until every worker is healthy again after a restart, and every replica
    has probed it a few times and reread the fleet."""
    deadline = time.monotonic() + ROUTABLE_TIMEOUT_S
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            healthy = conn.execute(select(workers_table.c.id).where(workers_table.c.healthy)).all()
        if len(healthy) == worker_count:
            time.sleep(HEALTH_ROUNDS_AFTER_RESTART * HEALTH_INTERVAL_MS / 1000 + DIRECTORY_REFRESH_S)
            return
        time.sleep(POLL_INTERVAL_S)
    raise RuntimeError("the restarted workers were not seen healthy in time")


def restart_fleet(sims: SimFleet, engine, time_scale: float) -> None:
    log(f"  workers restarted at time scale {time_scale}")
    sims.restart(time_scale)
    reset_workers(engine)


# --- Metrics --------------------------------------------------------------------

def sample_sums(text: str, label: str | None = None) -> dict:
    """Each sample name's value summed over its label sets; with `label`,
    keyed by (name, that label's value) instead."""
    sums: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name if label is None else (sample.name, sample.labels.get(label, ""))
            sums[key] = sums.get(key, 0.0) + sample.value
    return sums


async def scrape_workers(client: httpx.AsyncClient, sims: list[Sim]) -> dict[str, dict[str, float]]:
    texts = await asyncio.gather(*(client.get(sim.url + "/metrics") for sim in sims))
    return {sim.label: sample_sums(response.text) for sim, response in zip(sims, texts)}


def deltas(before: dict, after: dict, name: str) -> dict[str, float]:
    return {label: after[label].get(name, 0.0) - before[label].get(name, 0.0) for label in after}


def read_spills(replicas: list[ServeProcess]) -> Counter:
    """Spills counted by every replica so far, by reason; none when the metric is absent."""
    spills: Counter = Counter()
    for replica in replicas:
        by_reason = sample_sums(httpx.get(replica.url + "/metrics", timeout=10).text, label="reason")
        for (name, reason), value in by_reason.items():
            if name == SPILLS:
                spills[reason or "unlabelled"] += int(value)
    return spills


def proxy_capacity(replica: ServeProcess, label_of_worker_id: dict[str, str]) -> dict[str, float]:
    """The capacity the replicas agreed on, per worker (absent until measured)."""
    by_worker = sample_sums(httpx.get(replica.url + "/metrics", timeout=10).text, label="worker_id")
    return {label_of_worker_id.get(worker_id, worker_id): round(value, 1)
            for (name, worker_id), value in by_worker.items() if name == PROXY_CAPACITY}


CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class CpuMeter:
    """From start to `read`: the whole machine's busy share (/proc/stat), and
    the CPU of each group of processes as a share of one core."""

    def __init__(self, groups: dict[str, list[int]] | None = None) -> None:
        self.groups = {"client": [os.getpid()], **(groups or {})}
        self.started_s = time.monotonic()
        self.machine = self._machine()
        self.spent_s = self._groups()

    @staticmethod
    def _machine() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle and iowait

    def _groups(self) -> dict[str, float]:
        return {name: sum(process_cpu_s(pid) for pid in pids) for name, pids in self.groups.items()}

    def read(self) -> dict[str, float]:
        total, idle = self._machine()
        ticks = total - self.machine[0]
        seconds = time.monotonic() - self.started_s
        out = {"machine_busy_pct": round(100 * (1 - (idle - self.machine[1]) / ticks), 1) if ticks else 0.0}
        for name, spent_s in self._groups().items():
            out[f"{name}_core_pct"] = round(100 * (spent_s - self.spent_s[name]) / seconds, 1) if seconds else 0.0
        return out


# --- Requests -------------------------------------------------------------------

_SSL_CONTEXT = ssl.create_default_context()  # built once: every client would otherwise build its own


def http_client(connections: int = CLIENT_CONNECTIONS_MAX) -> httpx.AsyncClient:
    """A client for a few connections. httpx's pool does work quadratic in its
    connections at every request, so hundreds of streams sharing one client
    make the client, not the fleet, the bottleneck."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S), limits=limits,
                             verify=_SSL_CONTEXT)


def json_headers(key: str | None) -> dict:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    return headers


@dataclass
class Answer:
    status: int
    ttft_s: float | None = None
    text: str = ""


def sse_content(line: str) -> str:
    """The content a server-sent event line carries, '' for any other line."""
    if not line.startswith("data:"):
        return ""
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return ""
    chunk = orjson.loads(data)
    return "".join((choice.get("delta") or {}).get("content") or "" for choice in chunk.get("choices") or [])


async def stream_chat(client: httpx.AsyncClient, url: str, headers: dict, body: dict) -> Answer:
    """One streamed chat completion: its status, the time to its first content, its text."""
    started = time.perf_counter()
    ttft_s, parts = None, []
    async with client.stream("POST", url, headers=headers, content=orjson.dumps(body)) as response:
        if response.status_code != 200:
            await response.aread()
            return Answer(response.status_code)
        async for line in response.aiter_lines():
            content = sse_content(line)
            if content and ttft_s is None:
                ttft_s = time.perf_counter() - started
            parts.append(content)
    return Answer(200, ttft_s, "".join(parts))


def filler(rng: random.Random, size_bytes: int) -> str:
    words = []
    length = 0
    while length < size_bytes:
        word = rng.choice(FILLER_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size_bytes]


def opening_messages(conversation: int) -> tuple[random.Random, list[dict]]:
    """A conversation's system prompt and first question, unique from their
    first byte (so no two conversations share a cached block)."""
    rng = random.Random(WORKLOAD_SEED * 1_000_003 + conversation)
    system = f"conversation {conversation} system prompt: " + filler(rng, SYSTEM_PROMPT_BYTES)
    question = f"conversation {conversation} first question: " + filler(rng, FIRST_QUESTION_BYTES)
    return rng, [{"role": "system", "content": system}, {"role": "user", "content": question}]


def long_prompt_messages(tokens: int, salt: str) -> list[dict]:
    """One user message the simulated worker counts as exactly `tokens` tokens."""
    content_bytes = (tokens - SIM_PROMPT_TOKENS_PER_MESSAGE) * SIM_PROMPT_BYTES_PER_TOKEN
    head = f"{salt} long document follows: "
    return [{"role": "user", "content": head + "x" * (content_bytes - len(head))}]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


# --- Phase 1: follow-ups ------------------------------------------------------------

async def conversation(client: httpx.AsyncClient, urls: list[str], headers: dict, index: int, followups: int,
                       ttfts_s: list[float], errors: Counter) -> None:
    rng, messages = opening_messages(index)
    for turn in range(1 + followups):
        body = {"model": MODEL, "messages": messages, "max_tokens": FOLLOWUP_MAX_TOKENS, "stream": True}
        answer = await stream_chat(client, urls[(index + turn) % len(urls)], headers, body)
        if answer.status != 200:
            errors[str(answer.status)] += 1
            return
        if turn and answer.ttft_s is not None:
            ttfts_s.append(answer.ttft_s)
        question = f"conversation {index} follow-up {turn + 1}: " + filler(rng, FOLLOWUP_QUESTION_BYTES)
        messages = [*messages, {"role": "assistant", "content": answer.text}, {"role": "user", "content": question}]


async def followups_phase(args, urls: list[str], key: str, sims: SimFleet) -> dict:
    ttfts_s: list[float] = []
    errors: Counter = Counter()
    gate = asyncio.Semaphore(args.concurrency)
    headers = json_headers(key)

    async with http_client() as client:
        async def bounded(index: int) -> None:
            async with gate:
                await conversation(client, urls, headers, index, args.followups, ttfts_s, errors)

        before, cpu, started = await scrape_workers(client, sims.sims), CpuMeter(), time.monotonic()
        await asyncio.gather(*(bounded(i) for i in range(args.conversations)))
        seconds, busy = time.monotonic() - started, cpu.read()
        after = await scrape_workers(client, sims.sims)
    queries = sum(deltas(before, after, CACHE_QUERIES).values())
    hits = sum(deltas(before, after, CACHE_HITS).values())
    return {
        "ttft_ms_p50": round(statistics.median(ttfts_s) * 1000, 1) if ttfts_s else None,
        "ttft_ms_p90": round(percentile(ttfts_s, 0.9) * 1000, 1) if ttfts_s else None,
        "followups_measured": len(ttfts_s),
        "errors": dict(errors),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "cpu": busy,
        "seconds": round(seconds, 1),
    }


# --- Phase 2: long prompts ------------------------------------------------------------

async def send_long_prompt(client: httpx.AsyncClient, url: str, key: str, sims: SimFleet, tokens: int,
                           salt: str) -> tuple[int, list[str]]:
    """One long prompt, alone in the fleet: its status (0 when no answer came)
    and the workers whose prompt counter moved while it ran."""
    body = {"model": MODEL, "messages": long_prompt_messages(tokens, salt), "max_tokens": LONG_PROMPT_MAX_TOKENS}
    before = await scrape_workers(client, sims.sims)
    try:
        status = (await client.post(url, headers=json_headers(key), content=orjson.dumps(body))).status_code
    except httpx.HTTPError as exc:
        log(f"  {tokens} tokens: {type(exc).__name__}")
        status = 0
    moved = deltas(before, await scrape_workers(client, sims.sims), PROMPTED)
    return status, [label for label, prompt_tokens in moved.items() if prompt_tokens > 0]


async def long_prompts_phase(args, urls: list[str], key: str, sims: SimFleet) -> dict:
    """Each size `long_prompt_repeats` times, one request at a time."""
    context = {sim.label: sim.profile.max_model_len_tokens for sim in sims.sims}
    results, sent = {}, 0
    async with http_client() as client:
        for tokens in LONG_PROMPT_TOKENS:
            statuses, reached, holder_every_time = Counter(), Counter(), True
            for repeat in range(args.long_prompt_repeats):
                status, landed = await send_long_prompt(client, urls[sent % len(urls)], key, sims, tokens,
                                                        f"size {tokens} request {repeat}")
                sent += 1
                statuses[str(status)] += 1
                reached.update(landed)
                holds = bool(landed) and all(context[label] >= tokens + LONG_PROMPT_MAX_TOKENS for label in landed)
                holder_every_time = holder_every_time and status == 200 and holds
            results[str(tokens)] = {"statuses": dict(statuses), "workers": dict(sorted(reached.items())),
                                    "reached_holder": holder_every_time}
    return results


# --- Phase 3: saturation --------------------------------------------------------------

def saturation_body(index: int, turn: int) -> bytes:
    spread = SATURATION_MAX_TOKENS_SPREAD
    max_tokens = SATURATION_MAX_TOKENS - spread + (index * 7) % (2 * spread + 1)  # callers out of lockstep
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"caller {index} request {turn}"}],
                         "max_tokens": max_tokens, "stream": True})


async def saturating_caller(urls: list[str], headers: dict, start_s: float, index: int, errors: Counter) -> None:
    """Streams one request after another until cancelled, on a client of its
    own; the tokens are counted by the workers, so the stream is only drained."""
    await asyncio.sleep(start_s)
    async with http_client(len(urls)) as client:
        await _call_until_cancelled(client, urls, headers, index, errors)


async def _call_until_cancelled(client: httpx.AsyncClient, urls: list[str], headers: dict, index: int,
                                errors: Counter) -> None:
    for turn in range(sys.maxsize):
        try:
            async with client.stream("POST", urls[(index + turn) % len(urls)], headers=headers,
                                     content=saturation_body(index, turn)) as response:
                async for _ in response.aiter_raw():
                    pass
                if response.status_code != 200:
                    errors[str(response.status_code)] += 1
                    await asyncio.sleep(ERROR_PAUSE_S)
        except httpx.HTTPError as exc:
            errors[type(exc).__name__] += 1
            await asyncio.sleep(ERROR_PAUSE_S)


async def saturate(urls: list[str], headers: dict, callers: int, ramp_s: float, warmup_s: float, window_s: float,
                   scrape: Callable[[httpx.AsyncClient], Awaitable[dict]], pids: dict[str, list[int]]) -> dict:
    """Closed-loop callers, started over `ramp_s`; the scrapes that open and
    close the window after the warm-up (ramp included), its length in
    seconds, the errors, the machine's busy share and load."""
    errors: Counter = Counter()
    async with http_client() as client:
        tasks = [asyncio.create_task(saturating_caller(urls, headers, ramp_s * i / callers, i, errors))
                 for i in range(callers)]
        try:
            await asyncio.sleep(warmup_s)
            before, started, cpu = await scrape(client), time.monotonic(), CpuMeter(pids)
            await asyncio.sleep(window_s)
            after, seconds, busy = await scrape(client), time.monotonic() - started, cpu.read()
        finally:
            for task in tasks:
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, Exception) and not isinstance(o, asyncio.CancelledError)]
    if failures:
        raise failures[0]
    return {"before": before, "after": after, "seconds": seconds, "errors": dict(errors),
            "cpu": {**busy, "load_avg_1m": round(os.getloadavg()[0], 2)}}


def capacity_alone(args, sims: SimFleet) -> dict[str, float]:
    """Each worker driven directly, on its own, past its max_num_seqs: its generated tokens per second."""
    capacities = {}
    for sim in sims.sims:
        callers = math.ceil(ALONE_CALLERS_PER_SEQ * sim.profile.max_num_seqs)

        async def scrape(client: httpx.AsyncClient, sim: Sim = sim) -> dict:
            return await scrape_workers(client, [sim])

        window = asyncio.run(saturate([sim.url + "/v1/chat/completions"], json_headers(None), callers,
                                      ALONE_RAMP_S, args.alone_warmup_s, args.alone_window_s, scrape,
                                      {"worker": [sim.process.pid]}))
        generated = deltas(window["before"], window["after"], GENERATED)[sim.label]
        capacities[sim.label] = round(generated / window["seconds"], 1)
        log(f"  {sim.label} alone: {capacities[sim.label]} tok/s with {callers} callers "
            f"(cpu {window['cpu']}, errors {window['errors']})")
    return capacities


def saturation_phase(args, urls: list[str], fleet, sims: SimFleet, alone: dict[str, float],
                     replicas: list[ServeProcess]) -> dict:
    """The fleet saturated through the replicas, against its capacity alone."""
    callers = math.ceil(FLEET_CALLERS_PER_SEQ * sum(sim.profile.max_num_seqs for sim in sims.sims))
    pids = {"replicas": [replica.process.pid for replica in replicas], "workers": [sim.process.pid for sim in sims.sims]}

    async def scrape(client: httpx.AsyncClient) -> dict:
        return await scrape_workers(client, sims.sims)

    window = asyncio.run(saturate(urls, json_headers(fleet.key), callers, min(FLEET_RAMP_S, args.saturation_warmup_s),
                                  args.saturation_warmup_s, args.saturation_window_s, scrape, pids))
    label_of_worker_id = {str(worker_id): sim.label for worker_id, sim in zip(fleet.worker_ids, sims.sims)}
    return {**traffic_against_capacity(window, alone), "callers": callers, "errors": window["errors"],
            "cpu": window["cpu"], "window_s": round(window["seconds"], 1),
            "proxy_capacity_tok_s": proxy_capacity(replicas[0], label_of_worker_id)}


def traffic_against_capacity(window: dict, alone: dict[str, float]) -> dict:
    """Goodput, and each worker's share of the tokens against its share of the capacity."""
    generated = deltas(window["before"], window["after"], GENERATED)
    total, capacity_total, seconds = sum(generated.values()), sum(alone.values()), window["seconds"]
    traffic_pct = {label: round(100 * tokens / total, 2) if total else 0.0 for label, tokens in generated.items()}
    capacity_pct = {label: round(100 * alone[label] / capacity_total, 2) for label in generated}
    return {
        "fleet_tok_s": round(total / seconds, 1),
        "goodput": round(total / seconds / capacity_total, 4),
        "worker_tok_s": {label: round(tokens / seconds, 1) for label, tokens in generated.items()},
        "traffic_share_pct": traffic_pct,
        "capacity_share_pct": capacity_pct,
        "share_gap_pp_max": round(max(abs(traffic_pct[label] - capacity_pct[label]) for label in generated), 2),
    }


# --- One policy --------------------------------------------------------------------

def run_policy(args, policy: str, database_url: str, fleet, sims: SimFleet, alone: dict[str, float]) -> dict:
    """The three phases under one routing policy, on fresh replicas; each
    phase starts the workers afresh (empty caches) at its own speed."""
    log(f"policy {policy}:")
    replicas: list[ServeProcess] = []
    results: dict = {}
    try:
        start_replicas(database_url, policy, replicas)
        urls = [f"{replica.url}/v1/chat/completions" for replica in replicas]
        spills_after = {"start": read_spills(replicas)}
        phases = {
            "followups": (args.followup_time_scale,
                          lambda: asyncio.run(followups_phase(args, urls, fleet.key, sims))),
            # Before the long prompts: the room the router keeps for them on the
            # workers that alone hold them (proxy/routing.py) would weigh on it.
            "saturation": (args.saturation_time_scale,
                           lambda: saturation_phase(args, urls, fleet, sims, alone, replicas)),
            "long_prompts": (args.long_prompt_time_scale,
                             lambda: asyncio.run(long_prompts_phase(args, urls, fleet.key, sims))),
        }
        for name, (time_scale, run_phase) in phases.items():
            restart_fleet(sims, fleet.engine, time_scale)
            wait_routable(fleet.engine, len(sims.sims))
            log(f"  {name} ...")
            results[name] = run_phase()
            log(f"  {name}: {json.dumps(results[name], sort_keys=True)}")
            spills_after[name] = read_spills(replicas)
    finally:
        stop_replicas(replicas)
    return {**results, "spills": spills_by_phase(spills_after)}


def spills_by_phase(spills_after: dict[str, Counter]) -> dict:
    phases = list(spills_after)
    by_phase = {phase: sum((spills_after[phase] - spills_after[previous]).values())
                for previous, phase in zip(phases, phases[1:])}
    return {**by_phase, "by_reason": dict(spills_after[phases[-1]])}


# --- The report ----------------------------------------------------------------------

def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


def ratios(policies: dict) -> dict:
    out = {}
    affinity = policies.get(AFFINITY, {}).get("followups", {})
    for baseline in (RANDOM, ROUND_ROBIN):
        other = policies.get(baseline, {}).get("followups", {})
        for stat in ("p50", "p90"):
            out[f"followup_ttft_{stat}_{baseline}_over_affinity"] = ratio(other.get(f"ttft_ms_{stat}"),
                                                                          affinity.get(f"ttft_ms_{stat}"))
    return out


def at_least(value: float | None, minimum: float) -> bool | None:
    return None if value is None else value >= minimum


def targets(policies: dict, ratios_: dict) -> dict:
    affinity = policies.get(AFFINITY)
    if affinity is None:
        return {}
    saturation = affinity["saturation"]
    return {
        "followup_p50_10x": at_least(ratios_["followup_ttft_p50_random_over_affinity"], FOLLOWUP_P50_RATIO_MIN),
        "followup_p90_5x": at_least(ratios_["followup_ttft_p90_random_over_affinity"], FOLLOWUP_P90_RATIO_MIN),
        "goodput_97pct": saturation["goodput"] >= GOODPUT_MIN,
        "share_gap_5pp": saturation["share_gap_pp_max"] <= SHARE_GAP_PP_MAX,
        "long_prompts_reach_holder": all(size["reached_holder"] for size in affinity["long_prompts"].values()),
    }


def settings(args, sims: SimFleet) -> dict:
    return {
        "fleet": dict(Counter(sim.profile.name for sim in sims.sims)),
        "replicas": REPLICAS,
        "quick": args.quick,
        "time_scale": {"followups": args.followup_time_scale, "long_prompts": args.long_prompt_time_scale,
                       "saturation": args.saturation_time_scale},
        "conversations": args.conversations, "followups_per_conversation": args.followups,
        "conversations_at_a_time": args.concurrency,
        "prefix_bytes": SYSTEM_PROMPT_BYTES + FIRST_QUESTION_BYTES, "followup_question_bytes": FOLLOWUP_QUESTION_BYTES,
        "followup_max_tokens": FOLLOWUP_MAX_TOKENS,
        "long_prompt_repeats": args.long_prompt_repeats, "long_prompt_max_tokens": LONG_PROMPT_MAX_TOKENS,
        "alone_callers_per_max_num_seqs": ALONE_CALLERS_PER_SEQ, "fleet_callers_per_max_num_seqs": FLEET_CALLERS_PER_SEQ,
        "saturation_max_tokens": SATURATION_MAX_TOKENS, "saturation_ramp_s": min(FLEET_RAMP_S, args.saturation_warmup_s),
        "alone_warmup_s": args.alone_warmup_s, "alone_window_s": args.alone_window_s,
        "saturation_warmup_s": args.saturation_warmup_s, "saturation_window_s": args.saturation_window_s,
        "health_interval_ms": HEALTH_INTERVAL_MS, "capacity_period_ms": CAPACITY_PERIOD_MS,
    }


def run(args, sims: SimFleet, database_url: str) -> dict:
    log(f"workers: {', '.join(sim.label for sim in sims.sims)}; capacity alone at time scale {args.saturation_time_scale}")
    sims.start(args.saturation_time_scale)
    fleet = make_fleet(database_url, [sim.url for sim in sims.sims], credits_usd=CREDITS_USD,
                       context_lengths=[sim.profile.max_model_len_tokens for sim in sims.sims])
    try:
        alone = capacity_alone(args, sims)
        policies = {policy: run_policy(args, policy, database_url, fleet, sims, alone) for policy in args.policies}
    finally:
        fleet.engine.dispose()
    ratios_ = ratios(policies)
    return {
        "policies": policies,
        "ratios": ratios_,
        "targets": targets(policies, ratios_),
        "capacity_alone_tok_s": alone,
        "context_tokens": {sim.label: sim.profile.max_model_len_tokens for sim in sims.sims},
        "settings": settings(args, sims),
    }


# --- Command line ------------------------------------------------------------------------

def parse_fleet(text: str) -> dict[str, int]:
    counts = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        get_profile(name.strip())  # an unknown profile fails here, with the known ones named
        counts[name.strip()] = int(count or 1)
    return counts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", DATABASE_URL_DEFAULT))
    parser.add_argument("--fleet", default=FLEET_DEFAULT, help="profile=count, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--followups", type=int, default=3, help="follow-up turns per conversation")
    parser.add_argument("--concurrency", type=int, default=16, help="conversations at a time")
    parser.add_argument("--long-prompt-repeats", type=int, default=6)
    parser.add_argument("--alone-warmup-s", type=float, default=3.0)
    parser.add_argument("--alone-window-s", type=float, default=8.0)
    parser.add_argument("--saturation-warmup-s", type=float, default=25.0)
    parser.add_argument("--saturation-window-s", type=float, default=20.0)
    parser.add_argument("--followup-time-scale", type=float, default=0.5)
    parser.add_argument("--long-prompt-time-scale", type=float, default=20.0)
    parser.add_argument("--saturation-time-scale", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true", help="fewer requests and shorter windows, for a smoke run")
    parser.add_argument("--json", action="store_true")
    if "--quick" in sys.argv[1:]:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    args.policies = [p.strip() for p in args.policies.split(",")]
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    return args


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    args = parse_args()
    # SIGTERM and SIGINT stop the run through the finally blocks, which stop every child.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    started = time.monotonic()
    sims = SimFleet(parse_fleet(args.fleet))
    try:
        with ScratchDatabase(args.database_url, SCRATCH_PREFIX) as scratch:
            try:
                result = run(args, sims, scratch.url.render_as_string(hide_password=False))
            finally:
                sims.stop()
    except KeyboardInterrupt:
        log("interrupted: every process started here is stopped, the scratch database dropped")
        raise SystemExit(130) from None
    finally:
        drop_app_role()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    log("targets: " + ", ".join(f"{name} {'met' if met else 'NOT met' if met is False else 'not measured'}"
                                for name, met in result["targets"].items()))
    print(json.dumps(result, sort_keys=True) if args.json else json.dumps(result, sort_keys=True, indent=2))


if __name__ == "__main__":
    main()
