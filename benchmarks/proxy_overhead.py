"""What the proxy adds to time-to-first-token, and how many tokens it relays
per second of its own CPU, with authentication, holds, metering and
settlement all on, against a bare relay on the same worker in the same run.

Steady closed-loop callers each stream one request after another, to a
simulated worker paced like a real GPU (one token per chunk, h200 profile):
directly, through the bare relay (benchmarks/bare_relay.py: uvicorn and httpx
forwarding raw bytes, nothing else), through a TCP forwarder (the floor:
benchmarks/tcp_forwarder.py pipes bytes and parses no HTTP) and through
`paralon serve`; the phases alternate so that drift on this shared machine
hits them all alike.

    python benchmarks/proxy_overhead.py --json

Prints one JSON line. At 16 callers: TTFT added over the direct path, p50 and
p99, by the proxy, the bare relay and the forwarder, and the proxy's ratios to
the bare relay's. At 64 callers: tokens the callers received per CPU-second
of the relaying process, for each, and the proxy's ratio to the bare
relay's; and the load generator's own CPU per phase, so that a starved
client cannot hide a slow proxy. What the forwarder adds is the most any
relay could save here: one more hop through a process costs that much.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import ScratchDatabase, log  # noqa: E402
from proxy.upstream import UpstreamPool  # noqa: E402
from tests.support.db_roles import drop_app_role  # noqa: E402
from tests.support.harness import (  # noqa: E402
    MODEL, ServeProcess, SimWorkerProcess, free_port, make_fleet, start_on_a_free_port, stop_process,
)

MAX_TOKENS = 64  # per request (--max-tokens), give or take a quarter
START_SPREAD_S = 0.5
CONTENT_MARK, EMPTY_CONTENT_MARK = b'"content":"', b'"content":""'
CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Relay:
    """A relay of this folder's in a process of its own, started as the tests
    start their servers: on a free port, taken as started once its own socket
    answers (tests.support.harness)."""

    def __init__(self, script: str, *args: str) -> None:
        self.script, self.args = script, args
        self.port, self.port_given, self.process = free_port(), False, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Relay":
        command = [sys.executable, str(Path(__file__).resolve().parent / self.script), *self.args]
        return start_on_a_free_port(self, lambda: subprocess.Popen([*command, "--port", str(self.port)]), self.script)

    def stop(self) -> None:
        stop_process(self.process)


def relayed_per_cpu_s(url: str, headers: dict, pid: int, seconds: float, max_tokens: int) -> tuple[int, float, float]:
    """(tokens received, CPU-seconds of the relaying process, CPU-seconds of this load generator) at 64 callers."""
    relay_before, own_before = process_cpu_s(pid), process_cpu_s(os.getpid())
    _, tokens = asyncio.run(run_phase(url, headers, 64, seconds, max_tokens))
    return tokens, process_cpu_s(pid) - relay_before, process_cpu_s(os.getpid()) - own_before


async def caller(pool: UpstreamPool, url: str, headers: dict, deadline: float, ttfts_ms: list[float], index: int,
                 callers: int, asked_tokens: int) -> int:
    """One closed-loop caller. The client is the proxy's own lean HTTP client,
    so that the caller's CPU, which shares these two cores, stays small."""
    tokens, turn = 0, 0
    # Callers start spread over one request's time and ask for slightly
    # different lengths, so that they do not move in lockstep: a steady load,
    # not 16 requests arriving in the same millisecond every round.
    await asyncio.sleep(index * START_SPREAD_S / max(callers, 1))
    spread = asked_tokens // 4
    max_tokens = asked_tokens - spread + (index * 7) % (2 * spread + 1)
    while time.monotonic() < deadline:
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"caller {index} turn {turn}"}],
                             "max_tokens": max_tokens, "stream": True})
        turn += 1
        started = time.perf_counter()
        response = await pool.post(url, body, headers)
        if response.status != 200:
            raise SystemExit(f"{url} answered {response.status}: {(await response.read())[:300]!r}")
        first = True
        async for piece in response.pieces():
            produced = piece.count(CONTENT_MARK) - piece.count(EMPTY_CONTENT_MARK)
            if produced and first:
                ttfts_ms.append((time.perf_counter() - started) * 1000)
                first = False
            tokens += produced
    return tokens


async def run_phase(url: str, headers: dict, callers: int, seconds: float, max_tokens: int = MAX_TOKENS) -> tuple[list[float], int]:
    ttfts_ms: list[float] = []
    pool = UpstreamPool()
    deadline = time.monotonic() + seconds
    tokens = await asyncio.gather(*(caller(pool, url, headers, deadline, ttfts_ms, i, callers, max_tokens) for i in range(callers)))
    pool.close()
    return ttfts_ms, sum(tokens)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def figures(ttfts: dict[str, list[float]], relay_tokens: int, relay_cpu_s: float, proxy_tokens: int, proxy_cpu_s: float) -> dict:
    """Absolute figures, and the proxy's as ratios to the bare relay's."""
    direct_p50, direct_p99 = statistics.median(ttfts["direct"]), percentile(ttfts["direct"], 0.99)
    added = {name: (statistics.median(ttfts[name]) - direct_p50, percentile(ttfts[name], 0.99) - direct_p99)
             for name in ("relay", "forwarder", "proxy")}
    relay_rate = relay_tokens / relay_cpu_s if relay_cpu_s else None
    proxy_rate = proxy_tokens / proxy_cpu_s if proxy_cpu_s else None
    return {
        "ttft_added_ms_p50": round(added["proxy"][0], 2), "ttft_added_ms_p99": round(added["proxy"][1], 2),
        "bare_relay_ttft_added_ms_p50": round(added["relay"][0], 2), "bare_relay_ttft_added_ms_p99": round(added["relay"][1], 2),
        "tcp_forwarder_ttft_added_ms_p50": round(added["forwarder"][0], 2),
        "tcp_forwarder_ttft_added_ms_p99": round(added["forwarder"][1], 2),
        "ttft_direct_ms_p50": round(direct_p50, 2), "ttft_direct_ms_p99": round(direct_p99, 2),
        "relayed_tokens_per_cpu_s": round(proxy_rate) if proxy_rate else None,
        "bare_relay_tokens_per_cpu_s": round(relay_rate) if relay_rate else None,
        "ttft_added_p50_ratio_to_bare": round(added["proxy"][0] / added["relay"][0], 2) if added["relay"][0] > 0 else None,
        "ttft_added_p99_ratio_to_bare": round(added["proxy"][1] / added["relay"][1], 2) if added["relay"][1] > 0 else None,
        "relayed_tokens_per_cpu_s_ratio_to_bare": round(proxy_rate / relay_rate, 3) if proxy_rate and relay_rate else None,
        "relayed_tokens": proxy_tokens, "proxy_cpu_s": round(proxy_cpu_s, 2),
        "bare_relay_tokens": relay_tokens, "bare_relay_cpu_s": round(relay_cpu_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=2, help="direct/proxy alternations at 16 callers")
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help="tokens per request at 64 callers, give or take a quarter: a request's own cost weighs less in longer ones")
    parser.add_argument("--hold-per-request", action="store_true",
                        help="the proxy places a hold per request (PARALON_HOLD_POOLS=0), not pooled holds (the default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.max_tokens < 1:
        parser.error("--max-tokens is at least 1")

    worker = SimWorkerProcess(args.profile).start()
    relay = Relay("bare_relay.py", "--upstream", worker.url)
    forwarder = Relay("tcp_forwarder.py", "--upstream-port", str(worker.port))
    try:
        relay.start()
        forwarder.start()
        with ScratchDatabase(args.database_url, "paralon_proxybench") as scratch:
            url = scratch.url.render_as_string(hide_password=False)
            fleet = make_fleet(url, [worker.url], credits_usd="100000")
            proxy = ServeProcess(url, PARALON_HEALTH_INTERVAL_MS="2000", PARALON_KEY_CACHE_TTL_MS="1000",
                                 PARALON_GROUP_COMMIT_WAIT_MS="1", PARALON_HOLD_POOLS="0" if args.hold_per_request else "1").start()
            try:
                path = "/v1/chat/completions"
                direct_url, relay_url, proxy_url = worker.url + path, relay.url + path, proxy.url + path
                forwarder_url = forwarder.url + path
                headers = {"authorization": f"Bearer {fleet.key}"}
                asyncio.run(run_phase(proxy_url, headers, 16, 2.0))  # warm-up: connections, caches
                asyncio.run(run_phase(relay_url, {}, 16, 2.0))
                ttfts = {"direct": [], "relay": [], "forwarder": [], "proxy": []}
                for round_ in range(args.rounds):
                    log(f"round {round_ + 1}: 16 callers direct, through the bare relay, the forwarder, then the proxy ...")
                    ttfts["direct"] += asyncio.run(run_phase(direct_url, {}, 16, args.seconds))[0]
                    ttfts["relay"] += asyncio.run(run_phase(relay_url, {}, 16, args.seconds))[0]
                    ttfts["forwarder"] += asyncio.run(run_phase(forwarder_url, {}, 16, args.seconds))[0]
                    ttfts["proxy"] += asyncio.run(run_phase(proxy_url, headers, 16, args.seconds))[0]
                log("64 callers through the forwarder, the bare relay, then the proxy ...")
                forwarder_tokens, forwarder_cpu_s, _ = relayed_per_cpu_s(forwarder_url, {}, forwarder.process.pid, args.seconds, args.max_tokens)
                relay_tokens, relay_cpu_s, relay_client_cpu_s = relayed_per_cpu_s(relay_url, {}, relay.process.pid, args.seconds, args.max_tokens)
                proxy_tokens, proxy_cpu_s, proxy_client_cpu_s = relayed_per_cpu_s(proxy_url, headers, proxy.process.pid, args.seconds, args.max_tokens)
            finally:
                proxy.stop()
            settled = len(fleet.settlements())
            fleet.engine.dispose()
    finally:
        worker.stop()
        relay.stop()
        forwarder.stop()
        drop_app_role()  # the role `serve` ran as (tests.support.db_roles), once its database is gone
    result = figures(ttfts, relay_tokens, relay_cpu_s, proxy_tokens, proxy_cpu_s)
    result.update({"tcp_forwarder_tokens_per_cpu_s": round(forwarder_tokens / forwarder_cpu_s) if forwarder_cpu_s else None,
                   "tcp_forwarder_cpu_s": round(forwarder_cpu_s, 2)})
    result.update({"load_generator_cpu_s": {"relay_phase": round(relay_client_cpu_s, 2), "proxy_phase": round(proxy_client_cpu_s, 2)},
                   "load_generator_cpu_share": round(proxy_client_cpu_s / args.seconds, 2),
                   "requests_settled": settled, "hold_pools": not args.hold_per_request, "profile": args.profile, "max_tokens": args.max_tokens, "seconds_per_phase": args.seconds,
                   "requests_measured": {name: len(values) for name, values in ttfts.items()}})
    print(json.dumps(result, sort_keys=True) if args.json else "\n".join(f"{k}: {v}" for k, v in sorted(result.items())))


if __name__ == "__main__":
    main()
