"""For a customer whose last hold was granted in full, the proxy sends the
request to a worker while its hold is being placed (proxy/service.py,
InferenceProxy.open). When that hold is refused, the worker is stopped at
once and nothing is charged: a customer cannot get a worker's prefill, or
its tokens, for free by running out of credits between two requests."""
from __future__ import annotations

import asyncio

from litestar.testing import TestClient

from app.http.factory import create_app
from ledger.holds import PlaceHold
from ledger.service import Ledger
from tests.ledger.helpers import money_snapshot
from tests.support.harness import MODEL, make_fleet, sim_worker, wait_for

# h200's prefill runs 5,000 tokens a second: this prompt keeps a worker busy for about 10 s unless it is stopped.
LONG_PROMPT = "word " * 50_000
STOPPED_WITHIN_S = 5.0


def test_a_request_sent_before_its_hold_is_refused_is_stopped_at_the_worker_and_costs_nothing(tmp_path):
    worker = sim_worker("h200")
    fleet = make_fleet(f"sqlite:///{tmp_path}/paralon.db", [worker.url])
    ledger, engine_state = Ledger(fleet.engine), worker.app.engine.state
    place_hold = ledger.hold_placed

    def placed_once_the_worker_has_it(request: PlaceHold) -> asyncio.Future:
        """The real hold, asked for once the speculative request is at the worker, so that the test does not race it."""
        started = engine_state.requests_started
        placed = asyncio.get_running_loop().create_future()

        async def place() -> None:
            while engine_state.requests_started == started:
                await asyncio.sleep(0.01)
            try:
                placed.set_result(await place_hold(request))
            except Exception as exc:
                placed.set_exception(exc)
        placed.placing = asyncio.ensure_future(place())  # kept, so that the task is not collected
        return placed

    headers = {"authorization": f"Bearer {fleet.key}"}
    try:
        # A hold of its own (no pool): its placement is what this test holds back until the worker has the request.
        with TestClient(create_app(ledger, health_interval_s=60, hold_pools=False)) as client:
            first = client.post("/v1/chat/completions", headers=headers,
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert first.status_code == 200, first.text  # a hold granted in full: the next request goes out before its hold
            available = fleet.balance(fleet.customer_id).available_nano_usd
            ledger.place_hold(PlaceHold(fleet.customer_id, available, "spends-the-rest"))
            before = money_snapshot(fleet.engine)
            ledger.hold_placed = placed_once_the_worker_has_it
            refused = client.post("/v1/chat/completions", headers=headers,
                                  json={"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 64})
            assert refused.status_code == 402, refused.text
            assert engine_state.requests_started == 2, "the second request reached the worker before its hold was refused"
            wait_for(lambda: engine_state.requests_aborted == 1, timeout_s=STOPPED_WITHIN_S)
            assert engine_state.requests_running == 0 and engine_state.generation_tokens_total == 4
            assert money_snapshot(fleet.engine) == before, "nothing held, nothing charged"
            assert len(fleet.settlements()) == 1
    finally:
        ledger.close()
        fleet.engine.dispose()
        worker.stop()
