"""`paralon serve` loses its database under load and gets it back.

The database is reached through a TCP proxy the test controls
(tests/support/faults.py), or its backends are terminated with
`pg_terminate_backend`. While it is away every request is answered 503 with
Retry-After (never 500); once it is back the service answers again by itself,
without a restart; and the money is exact: every answer given was charged
exactly once, nothing else was, and the ledger verifies."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import orjson
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from app.tokens import CUSTOMER, create_token
from ledger.schema import ledger_events
from tests.conftest import _admin_engine
from tests.support.faults import FaultProxy
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for

CREDITS_USD = "100"
CALLERS = 6  # concurrent non-streaming callers
STREAMERS = 2  # concurrent streaming callers, each stream about 1.5 s long on the h200 profile
STREAM_MAX_TOKENS = 250
REQUEST_TIMEOUT_S = 60.0
OUTAGE_S = 3.0  # long enough for streams to end while the database is away
RECOVERY_WAIT_S = 10.0  # generous: the target is 2 s, measured and printed, not asserted
HOLD_TTL_S = 5  # holds a failed release left behind are swept soon after
MESSAGES = [{"role": "user", "content": "Say something."}]


@dataclass
class Answer:
    status: int
    sent_at: float
    done_at: float
    request_id: str | None = None
    cost_nano_usd: int | None = None  # as the answer reported it (header, or the stream's usage chunk)
    retry_after: str | None = None
    code: str | None = None
    streamed: bool = False
    completed: bool = False  # a stream that reached [DONE]


@dataclass
class Load:
    """Callers sending requests until stopped, every answer recorded."""

    url: str
    key: str
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> "Load":
        targets = [self._call] * CALLERS + [self._stream] * STREAMERS
        self.threads = [threading.Thread(target=self._loop, args=(t,), daemon=True) for t in targets]
        for thread in self.threads:
            thread.start()
        return self

    def finish(self) -> list[Answer]:
        self.stop.set()
        for thread in self.threads:
            thread.join(REQUEST_TIMEOUT_S + 5)
        return self.answers

    def _loop(self, target) -> None:
        with httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.key}"}, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    answer = target(client, sent)
                except httpx.HTTPError:
                    answer = Answer(0, sent, time.monotonic())
                self.answers.append(answer)
                if answer.status != 200:
                    time.sleep(0.05)  # a caller backs off a little, as Retry-After asks

    def _call(self, client: httpx.Client, sent: float) -> Answer:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5})
        answer = Answer(r.status_code, sent, time.monotonic(), r.headers.get("x-request-id"),
                        retry_after=r.headers.get("retry-after"))
        if r.status_code == 200:
            answer.request_id = r.json()["id"]
            answer.cost_nano_usd = int(r.headers["x-paralon-cost-nano-usd"])
        else:
            answer.code = (r.json().get("error") or {}).get("code") if r.headers.get("content-type", "").startswith("application/json") else None
        return answer

    def _stream(self, client: httpx.Client, sent: float) -> Answer:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": STREAM_MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            answer = Answer(r.status_code, sent, 0.0, r.headers.get("x-request-id"), retry_after=r.headers.get("retry-after"),
                            streamed=True)
            if r.status_code != 200:
                r.read()
                answer.done_at = time.monotonic()
                return answer
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    answer.completed = True
                elif line.startswith("data: "):
                    usage = orjson.loads(line[6:]).get("usage")
                    if usage:
                        answer.cost_nano_usd = round(float(usage["cost"]) * 10**9)
        answer.done_at = time.monotonic()
        return answer


@dataclass
class Site:
    fleet: object
    serve: object
    proxy: FaultProxy
    database: str
    token: str  # the customer's management token

    def get(self, path: str, token: str) -> httpx.Response:
        return httpx.get(self.serve.url + path, headers={"authorization": f"Bearer {token}"}, timeout=REQUEST_TIMEOUT_S)

    def load(self) -> Load:
        return Load(self.serve.url, self.fleet.key).start()

    def terminate_backends(self) -> int:
        """Every backend of this test's database (serve's, and the test's own pooled ones), nobody else's."""
        with _admin_engine().connect() as conn:
            return len(conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :db AND pid <> pg_backend_pid()"
            ), {"db": self.database}).all())


@pytest.fixture
def site(postgres_url):
    worker = sim_worker("h200")
    fleet = make_fleet(postgres_url, [worker.url], credits_usd=CREDITS_USD)
    with fleet.engine.begin() as conn:
        _, token = create_token(conn, fleet.customer_id, CUSTOMER)
    url = make_url(postgres_url)
    proxy = FaultProxy(url.host or "127.0.0.1", url.port or 5432).start()
    serve_url = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        with serving(serve_url, PARALON_HOLD_TTL_S=str(HOLD_TTL_S), PARALON_HOLD_SWEEP_INTERVAL_MS="500") as serve:
            yield Site(fleet, serve, proxy, url.database, token)
    finally:
        proxy.stop()
        worker.stop()
        fleet.engine.dispose()


def _answered_after(load: Load, moment: float, status: int = 200) -> list[Answer]:
    return [a for a in list(load.answers) if a.sent_at > moment and a.status == status]


def _assert_failures_are_503_with_retry_after(answers: list[Answer]) -> None:
    failed = [a for a in answers if a.status != 200]
    assert not [a for a in failed if a.status != 503], f"statuses other than 200 and 503: {_counts(failed)}"
    assert all(a.retry_after and int(a.retry_after) >= 1 for a in failed), "every 503 says when to retry"


def _counts(answers: list[Answer]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for a in answers:
        counts[a.status] = counts.get(a.status, 0) + 1
    return counts


def _settlements_standing(site: Site) -> list[dict]:
    """The settlements not reversed (a withheld answer whose settlement had committed is reversed)."""
    with site.fleet.engine.connect() as conn:
        rows = conn.execute(select(ledger_events.c.seq, ledger_events.c.event_type, ledger_events.c.payload)
                            .where(ledger_events.c.event_type.in_(("RequestSettled", "EventReversed")))).all()
    settled = {r.seq: orjson.loads(r.payload) for r in rows if r.event_type == "RequestSettled"}
    reversed_seqs = {orjson.loads(r.payload)["reversed_seq"] for r in rows if r.event_type == "EventReversed"}
    return [settlement for seq, settlement in settled.items() if seq not in reversed_seqs]


def _charges_by_request(site: Site) -> dict[str, int]:
    charged: dict[str, int] = {}
    for settlement in _settlements_standing(site):
        charged[settlement["request_id"]] = charged.get(settlement["request_id"], 0) + settlement["charge_nano_usd"]
    return charged


def _assert_money_exact(site: Site, answers: list[Answer]) -> None:
    """Each answer given is charged exactly what it reported, once; nothing else is charged."""
    fleet = site.fleet
    wait_for(lambda: fleet.balance(fleet.customer_id).held_nano_usd == 0, timeout_s=HOLD_TTL_S * 6)
    given = {a.request_id: a.cost_nano_usd for a in answers if a.status == 200 and not a.streamed}
    for a in answers:
        if a.streamed and a.completed:  # the caller has the whole stream and its cost
            given[a.request_id] = a.cost_nano_usd
    streamed = {a.request_id for a in answers if a.streamed and a.request_id}
    # A settlement whose commit the outage cut off may have committed though its answer was withheld: it is reversed.
    def only_what_was_asked_for() -> dict | None:
        charged = _charges_by_request(site)
        return charged if set(charged) <= set(given) | streamed else None

    charged = wait_for(only_what_was_asked_for, timeout_s=RECOVERY_WAIT_S)
    uncharged = {rid: cost for rid, cost in given.items() if charged.get(rid) != cost}
    assert not uncharged, f"answered but not charged exactly once: {uncharged} (charged {[charged.get(r) for r in uncharged]})"
    # Streams cut short by the test's own stop, or by a failure mid-stream, pay for what they delivered: only
    # the non-streaming answers that were refused must be free.
    refused = {a.request_id for a in answers if not a.streamed and a.status != 200 and a.request_id}
    assert not refused & set(charged), "a refused request was charged"
    total = sum(charged.values())
    assert fleet.balance(fleet.customer_id).balance_nano_usd == int(CREDITS_USD) * 10**9 - total
    owners_total = sum(fleet.balance(o).balance_nano_usd for o in fleet.owner_ids)
    assert owners_total == sum(s["charge_nano_usd"] * 80 // 100 for s in _settlements_standing(site)), "owners get 80%"
    verify = subprocess.run([sys.executable, "-c", "from app.cli import main; main()", "ledger", "verify"],
                            env={**os.environ, "PARALON_DATABASE_URL": fleet.database_url}, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _first_ok_after(load: Load, moment: float) -> float:
    ok = wait_for(lambda: _answered_after(load, moment), timeout_s=RECOVERY_WAIT_S)
    return min(a.done_at for a in ok) - moment


def test_terminated_backends_are_replaced_without_a_restart(site):
    load = site.load()
    wait_for(lambda: len(_answered_after(load, 0)) >= 20, timeout_s=30)
    recoveries = []
    for _ in range(3):
        terminated_at = time.monotonic()
        assert site.terminate_backends() > 0
        recoveries.append(_first_ok_after(load, terminated_at))
        wait_for(lambda: len(_answered_after(load, terminated_at)) >= 20, timeout_s=RECOVERY_WAIT_S)
    answers = load.finish()
    print(f"\npg_terminate_backend x3 under load: answers {_counts(answers)}, "
          f"first 200 after each termination in {', '.join(f'{s * 1000:.0f} ms' for s in recoveries)}")
    _assert_failures_are_503_with_retry_after(answers)
    _assert_money_exact(site, answers)


def test_the_database_away_is_503_and_back_within_seconds(site):
    load = site.load()
    wait_for(lambda: len(_answered_after(load, 0)) >= 20, timeout_s=30)
    cut_at = time.monotonic()
    site.proxy.outage()
    wait_for(lambda: len(_answered_after(load, cut_at, 503)) >= 20, timeout_s=RECOVERY_WAIT_S)
    time.sleep(max(0.0, cut_at + OUTAGE_S - time.monotonic()))
    assert httpx.get(site.serve.url + "/health").status_code == 200, "alive, though not ready"
    for path, token in (("/v1/account", site.token), ("/v1/keys", site.token), ("/v1/generations/chatcmpl-x", site.fleet.key)):
        read = site.get(path, token)  # a token lookup, then a read: each a 503 while the database is away
        assert read.status_code == 503 and read.headers["retry-after"], path
        assert read.json()["error"]["code"] == "database_unavailable"
    ready = httpx.get(site.serve.url + "/ready")
    assert ready.status_code == 503 and ready.json()["checks"]["database"]["ok"] is False
    assert ready.headers["retry-after"]
    restored_at = time.monotonic()
    site.proxy.restore()
    recovery_s = _first_ok_after(load, restored_at)
    wait_for(lambda: len(_answered_after(load, restored_at)) >= 20, timeout_s=RECOVERY_WAIT_S)
    assert site.get("/v1/account", site.token).status_code == 200
    ready_again = wait_for(lambda: httpx.get(site.serve.url + "/ready").status_code == 200, timeout_s=RECOVERY_WAIT_S)
    answers = load.finish()
    during = [a for a in answers if cut_at < a.sent_at < restored_at]
    streams = [a for a in answers if a.streamed and a.status == 200]
    print(f"\noutage of {restored_at - cut_at:.1f} s under load: answers during it {_counts(during)}, "
          f"in all {_counts(answers)}; first 200 {recovery_s * 1000:.0f} ms after the database came back; "
          f"streams completed {sum(a.completed for a in streams)} of {len(streams)}, "
          f"{sum(a.completed and cut_at < a.done_at < restored_at for a in streams)} of them during the outage")
    assert ready_again
    _assert_failures_are_503_with_retry_after(answers)
    _assert_money_exact(site, answers)


def test_a_slow_database_still_answers(site):
    """Latency is not an outage: with every byte to the database delayed, answers are slower, not errors."""
    site.proxy.delay(0.05)
    load = site.load()
    wait_for(lambda: len(_answered_after(load, 0)) >= 10, timeout_s=60)
    site.proxy.restore()
    answers = load.finish()
    _assert_failures_are_503_with_retry_after(answers)
    _assert_money_exact(site, answers)
