"""What the proxy adds to time-to-first-token, and how many tokens it relays
per second of its own CPU, with authentication, holds, metering and
settlement all on.

Steady closed-loop callers each stream one request after another, to a
simulated worker paced like a real GPU (one token per chunk, h200 profile),
once directly and once through `paralon serve`, in the same run; the phases
alternate so that drift on this shared machine hits both alike.

    python benchmarks/proxy_overhead.py --json

Prints one JSON line: ttft_added_ms_p50 and ttft_added_ms_p99 (16 callers),
relayed_tokens_per_cpu_s (64 callers: tokens the callers received through the
proxy per CPU-second of the proxy process).
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

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import ScratchDatabase, log  # noqa: E402
from proxy.upstream import UpstreamPool  # noqa: E402
from tests.support.harness import MODEL, ServeProcess, free_port, make_fleet  # noqa: E402

MAX_TOKENS = 64  # per request, give or take MAX_TOKENS_SPREAD
MAX_TOKENS_SPREAD = 16
START_SPREAD_S = 0.5
CONTENT_MARK, EMPTY_CONTENT_MARK = b'"content":"', b'"content":""'
CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start_worker(port: int, profile: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", "from app.cli import main; main()", "sim-worker", "--port", str(port),
                                "--profile", profile, "--model", MODEL])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("the simulated worker did not start")


async def caller(pool: UpstreamPool, url: str, headers: dict, deadline: float, ttfts_ms: list[float], index: int,
                 callers: int) -> int:
    """One closed-loop caller. The client is the proxy's own lean HTTP client,
    so that the caller's CPU, which shares these two cores, stays small."""
    tokens, turn = 0, 0
    # Callers start spread over one request's time and ask for slightly
    # different lengths, so that they do not move in lockstep: a steady load,
    # not 16 requests arriving in the same millisecond every round.
    await asyncio.sleep(index * START_SPREAD_S / max(callers, 1))
    max_tokens = MAX_TOKENS - MAX_TOKENS_SPREAD + (index * 7) % (2 * MAX_TOKENS_SPREAD + 1)
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


async def run_phase(url: str, headers: dict, callers: int, seconds: float) -> tuple[list[float], int]:
    ttfts_ms: list[float] = []
    pool = UpstreamPool()
    deadline = time.monotonic() + seconds
    tokens = await asyncio.gather(*(caller(pool, url, headers, deadline, ttfts_ms, i, callers) for i in range(callers)))
    pool.close()
    return ttfts_ms, sum(tokens)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=2, help="direct/proxy alternations at 16 callers")
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    worker_port = free_port()
    worker = start_worker(worker_port, args.profile)
    with ScratchDatabase(args.database_url, "paralon_proxybench") as scratch:
        url = scratch.url.render_as_string(hide_password=False)
        fleet = make_fleet(url, [f"http://127.0.0.1:{worker_port}"], credits_usd="100000")
        proxy = ServeProcess(url, PARALON_HEALTH_INTERVAL_MS="2000", PARALON_KEY_CACHE_TTL_MS="1000",
                             PARALON_GROUP_COMMIT_WAIT_MS="1").start()
        try:
            direct_url = f"http://127.0.0.1:{worker_port}/v1/chat/completions"
            proxy_url = f"{proxy.url}/v1/chat/completions"
            headers = {"authorization": f"Bearer {fleet.key}"}
            asyncio.run(run_phase(proxy_url, headers, 16, 2.0))  # warm-up: connections, caches
            direct_ttfts, proxy_ttfts = [], []
            for round_ in range(args.rounds):
                log(f"round {round_ + 1}: 16 callers direct, then through the proxy ...")
                direct_ttfts += asyncio.run(run_phase(direct_url, {}, 16, args.seconds))[0]
                proxy_ttfts += asyncio.run(run_phase(proxy_url, headers, 16, args.seconds))[0]
            log("64 callers through the proxy ...")
            cpu_before = process_cpu_s(proxy.process.pid)
            _, relayed_tokens = asyncio.run(run_phase(proxy_url, headers, 64, args.seconds))
            proxy_cpu_s = process_cpu_s(proxy.process.pid) - cpu_before
        finally:
            proxy.stop()
            worker.terminate()
            worker.wait(10)
        settled = len(fleet.settlements())
        fleet.engine.dispose()

    result = {
        "ttft_added_ms_p50": round(statistics.median(proxy_ttfts) - statistics.median(direct_ttfts), 2),
        "ttft_added_ms_p99": round(percentile(proxy_ttfts, 0.99) - percentile(direct_ttfts, 0.99), 2),
        "ttft_direct_ms_p50": round(statistics.median(direct_ttfts), 2),
        "ttft_proxy_ms_p50": round(statistics.median(proxy_ttfts), 2),
        "ttft_direct_ms_p99": round(percentile(direct_ttfts, 0.99), 2),
        "ttft_proxy_ms_p99": round(percentile(proxy_ttfts, 0.99), 2),
        "requests_measured": {"direct": len(direct_ttfts), "proxy": len(proxy_ttfts)},
        "relayed_tokens_per_cpu_s": round(relayed_tokens / proxy_cpu_s) if proxy_cpu_s else None,
        "relayed_tokens": relayed_tokens,
        "proxy_cpu_s": round(proxy_cpu_s, 2),
        "requests_settled": settled,
        "profile": args.profile,
        "seconds_per_phase": args.seconds,
    }
    print(json.dumps(result, sort_keys=True) if args.json else "\n".join(f"{k}: {v}" for k, v in sorted(result.items())))


if __name__ == "__main__":
    main()
