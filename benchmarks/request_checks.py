"""What checking a body against OpenAI's API document (proxy/request_checks.py)
costs per request, in microseconds of this thread's CPU time (a loaded machine
inflates wall time with waiting), against what the prompt bound that every
request already computes (proxy/metering.py) costs on the same body, and
against a yardstick of 1,000 empty `dict.get` calls (about 25 us on an idle
modern core) to tell how loaded the machine was.

The body is a typical agent turn: a system prompt, 8 function tools with JSON
schemas, 10 rounds of user, assistant tool call and tool reply, sampling
parameters and stream options. The ratio is what to read: this machine is
shared and absolute numbers drift.

    python benchmarks/request_checks.py --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy import metering  # noqa: E402
from proxy.request_checks import check_body  # noqa: E402

TOOLS = 8
ROUNDS = 10
CALLS_PER_ROUND = 300
ROUNDS_MEASURED = 30


def agent_body() -> dict:
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "Reads one table of the warehouse and returns its rows as CSV.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                       "required": ["path"]}}} for i in range(TOOLS)]
    messages = [{"role": "system", "content": "You are a data agent. Use the tools, then answer in JSON."}]
    for i in range(ROUNDS):
        call_id = f"call_{i:02d}"
        messages += [
            {"role": "user", "content": f"How many open orders are in table {i}?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": f"tool_{i % TOOLS}", "arguments": json.dumps({"path": f"/srv/orders_{i}.csv", "limit": 100})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "rows: 120, open: 17"},
        ]
    return {"model": "paralon-test", "messages": messages, "tools": tools, "tool_choice": "auto", "temperature": 0.2,
            "top_p": 0.95, "max_tokens": 512, "stream": True, "stream_options": {"include_usage": True},
            "top_k": 40, "repetition_penalty": 1.05}


YARDSTICK_GETS = 1000


def per_call_us(work, body: dict) -> float:
    """The median over rounds of the mean CPU time of one call, in microseconds."""
    rounds = []
    for _ in range(ROUNDS_MEASURED):
        started = time.thread_time()
        for _ in range(CALLS_PER_ROUND):
            work(body)
        rounds.append((time.thread_time() - started) / CALLS_PER_ROUND * 1e6)
    return statistics.median(rounds)


def yardstick(empty: dict) -> None:
    for _ in range(YARDSTICK_GETS):
        empty.get("absent")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    shown = parser.parse_args()
    body = agent_body()
    checks_us = per_call_us(lambda b: check_body("chat", b), body)
    bound_us = per_call_us(lambda b: metering.prompt_tokens_bound("chat", b), body)
    yardstick_us = per_call_us(yardstick, {})
    result = {"messages": len(body["messages"]), "tools": TOOLS, "request_checks_us": round(checks_us, 2),
              "prompt_bound_us": round(bound_us, 2), "checks_over_bound": round(checks_us / bound_us, 3),
              "yardstick_1000_gets_us": round(yardstick_us, 2), "checks_over_yardstick": round(checks_us / yardstick_us, 3)}
    print(json.dumps(result) if shown.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
