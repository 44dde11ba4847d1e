"""An account's activity from a real `paralon serve` in front of a simulated
worker: a streamed answer, a non-streamed one, a caller who leaves mid-stream
and requests that fail are each one row, with the exact charge of the ledger's
settlements, the time to first token and the status; filters narrow it, a
cursor gives what is new, another account is not there, and a rebuild of the
read models gives the same rows."""
from __future__ import annotations

import time

import httpx
import orjson
from sqlalchemy import select

from app.activity import account_activity
from app.tokens import create_token
from invoices import read_models
from invoices.schema import generations
from ledger import accounts as acc
from ledger.schema import ledger_events
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def _post(proxy, fleet, body: dict) -> tuple[httpx.Response, float]:
    started_s = time.perf_counter()
    response = httpx.post(proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body},
                          headers={"authorization": f"Bearer {fleet.key}"}, timeout=30)
    return response, (time.perf_counter() - started_s) * 1000


def _first_chunk_ms(proxy, fleet, body: dict, *, leave_after_events: int | None = None) -> tuple[str, float]:
    """A streamed request; its id, and how long its first chunk took to come. With
    leave_after_events, the caller leaves after that many events."""
    started_s, first_ms, request_id, events = time.perf_counter(), None, None, 0
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": MESSAGES, "stream": True, **body},
                      headers={"authorization": f"Bearer {fleet.key}"}) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            first_ms = first_ms or (time.perf_counter() - started_s) * 1000
            events += 1
            if leave_after_events and events >= leave_after_events:
                break
    return request_id, first_ms


def _settlements(fleet) -> dict[str, list[dict]]:
    """Each request's RequestSettled events (there are no reversals here)."""
    settled: dict[str, list[dict]] = {}
    with fleet.engine.connect() as conn:
        for row in conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "RequestSettled")):
            event = orjson.loads(row.payload)
            settled.setdefault(event["request_id"], []).append(event)
    return settled


def _rows_when(rows: list, count: int) -> list | None:
    return rows if len(rows) == count else None


def _activity(proxy, token: str, query: str = "") -> httpx.Response:
    return httpx.get(f"{proxy.url}/v1/activity{query}", headers={"authorization": f"Bearer {token}"}, timeout=30)


def test_the_activity_shows_each_request_as_the_ledger_charged_it(database_url):
    worker = sim_worker("h200", time_scale=1.0)  # about 170 tokens a second: a caller can leave mid-stream
    fleet = make_fleet(database_url, [worker.url])
    with fleet.engine.begin() as conn:
        other = acc.create_account(conn, "customer", "someone else")
        tokens = {"customer": create_token(conn, fleet.customer_id, "customer")[1],
                  "owner": create_token(conn, fleet.owner_ids[0], "owner")[1],
                  "other": create_token(conn, other, "customer")[1]}
    with serving(database_url) as proxy:
        streamed_id, streamed_first_ms = _first_chunk_ms(proxy, fleet, {"max_tokens": 8})
        whole, whole_ms = _post(proxy, fleet, {"max_tokens": 6})
        left_id, _ = _first_chunk_ms(proxy, fleet, {"max_tokens": 2000}, leave_after_events=5)
        wait_for(lambda: worker.app.state.requests_aborted == 1)
        worker.app.fail_after_tokens = 3  # the worker dies after 3 tokens: a non-streaming caller receives nothing
        failed, _ = _post(proxy, fleet, {"max_tokens": 6})
        worker.app.fail_after_tokens = 0  # it dies before any token, on every try: nothing to relay
        no_worker, _ = _post(proxy, fleet, {"max_tokens": 6})
        worker.app.fail_after_tokens = None
        assert whole.status_code == 200 and failed.status_code >= 500 and no_worker.status_code == 503
        whole_id, failed_id = whole.json()["id"], failed.headers.get("x-request-id")

        rows = wait_for(lambda: _rows_when(_activity(proxy, tokens["customer"]).json()["data"], 5))
        first_page = _activity(proxy, tokens["customer"]).json()

        by_status: dict[str, list[dict]] = {}
        for row in rows:
            by_status.setdefault(row["status"], []).append(row)
        assert sorted(by_status) == ["cancelled", "completed", "failed", "streamed"]
        settled = _settlements(fleet)
        charged = {request_id: sum(e["charge_nano_usd"] for e in events) for request_id, events in settled.items()}
        [streamed], [completed], [cancelled] = by_status["streamed"], by_status["completed"], by_status["cancelled"]
        assert (streamed["id"], completed["id"], cancelled["id"]) == (streamed_id, whole_id, left_id)
        for row in (streamed, completed, cancelled):
            assert row["cost_nano_usd"] == charged[row["id"]] > 0, "exactly what the ledger charged"
            assert row["api_key_id"] == fleet.key_id and row["model"] == MODEL and row["reason"] is None
            assert type(row["ttft_ms"]) is int and row["ttft_ms"] >= 0
        assert streamed["ttft_ms"] <= streamed_first_ms + 1, "the proxy's clock starts after the caller's"
        metas = {row["id"]: settled[row["id"]][0]["meta"] for row in (streamed, completed, cancelled)}
        assert [(m["stream"], m["outcome"], m["ttft_ms"]) for m in metas.values()] == [
            (True, "completed", streamed["ttft_ms"]), (False, "completed", completed["ttft_ms"]),
            (True, "cancelled", cancelled["ttft_ms"])], "the settlement says how the stream ended"
        assert completed["ttft_ms"] <= whole_ms + 1
        assert completed["cost_nano_usd"] == int(whole.headers["x-paralon-cost-nano-usd"])
        assert (completed["completion_tokens"], streamed["completion_tokens"]) == (6, 8)
        assert 4 <= cancelled["completion_tokens"] < 2000, "billed for what was relayed"
        assert set(charged) == {streamed_id, whole_id, left_id}, "failed requests moved no money"

        failures = by_status["failed"]
        assert all(f["cost_nano_usd"] == 0 and f["prompt_tokens"] == 0 for f in failures)
        assert sorted(f["reason"] for f in failures) == ["no_worker", "worker_failed"]
        assert failed_id is None or failed_id in {f["id"] for f in failures}
        assert [r["completed_at"] for r in rows] == sorted((r["completed_at"] for r in rows), reverse=True), "newest first"

        # Filters
        only_failed = _activity(proxy, tokens["customer"], "?status=failed").json()["data"]
        assert {r["id"] for r in only_failed} == {f["id"] for f in failures}
        assert _activity(proxy, tokens["customer"], "?status=streamed").json()["data"] == [streamed]
        assert _activity(proxy, tokens["customer"], "?model=another-model").json()["data"] == []
        assert len(_activity(proxy, tokens["customer"], f"?key_id={fleet.key_id}").json()["data"]) == 5
        assert _activity(proxy, tokens["customer"], f"?key_id={fleet.key_id + 1}").json()["data"] == []
        assert [r["id"] for r in _activity(proxy, tokens["customer"], "?limit=2").json()["data"]] == [r["id"] for r in rows[:2]]

        # What is new since the first page, and nothing else
        assert _activity(proxy, tokens["customer"], f"?after={first_page['after']}").json()["data"] == []
        late, _ = _post(proxy, fleet, {"max_tokens": 3})
        newer = wait_for(lambda: _activity(proxy, tokens["customer"], f"?after={first_page['after']}").json()["data"])
        assert [r["id"] for r in newer] == [late.json()["id"]]

        # Nobody else's; bad filters are refused and write nothing
        assert _activity(proxy, tokens["other"]).json()["data"] == []
        assert _activity(proxy, tokens["other"], f"?account_id={fleet.customer_id}").status_code == 404
        assert _activity(proxy, tokens["owner"]).status_code == 403
        events_before = fleet.events("RequestSettled")
        for bad in ("?status=nope", "?limit=0", "?limit=100000", "?after=12", "?key_id=0", "?after=1.1&before=2.2"):
            refused = _activity(proxy, tokens["customer"], bad)
            assert refused.status_code == 400 and refused.json()["error"]["message"], bad
        assert fleet.events("RequestSettled") == events_before

    worker.stop()
    with fleet.engine.connect() as conn:
        before = sorted(tuple(r) for r in conn.execute(select(generations)))
        shown = account_activity(conn, fleet.customer_id)
    read_models.rebuild(fleet.engine)
    with fleet.engine.connect() as conn:
        assert sorted(tuple(r) for r in conn.execute(select(generations))) == before, "a rebuild gives the same rows"
        assert account_activity(conn, fleet.customer_id) == shown
    assert fleet.balance(fleet.customer_id).held_nano_usd == 0
    fleet.assert_books_close()
    fleet.engine.dispose()
