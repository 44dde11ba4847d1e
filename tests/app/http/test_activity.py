"""`GET /v1/activity` and `paralon activity`: an account's requests, settled
and unbilled, newest first, page by page with cursors and none skipped or
repeated; what changed comes again after a cursor; who may read it; bad
filters refused with nothing written."""
from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from app.accounts import NotVisible
from app.activity import activity
from app.cli import main
from app.tokens import OWNER, Principal
from invoices import read_models
from invoices.schema import generations
from ledger import commands as cmd
from ledger.holds import PlaceHold, settlement_key
from ledger.service import Ledger
from proxy.keys import KeyGrant
from proxy.schema import unbilled_generations
from proxy.unbilled import FAILED, NO_WORKER, UnbilledLog
from tests.app.http.conftest import MODEL

SETTLED, UNBILLED = 7, 3


def _settle(site, ledger: Ledger, request_id: str, charge: int) -> int:
    hold = ledger.place_hold(PlaceHold(site.customer_id, 10**6, f"hold:{request_id}"))
    return ledger.append(cmd.SettleRequest(hold.hold_id, site.owner_id, charge, request_id, settlement_key(request_id), {
        "model": MODEL, "worker_id": site.worker_id, "api_key_id": site.key_id, "prompt_tokens": 3, "completion_tokens": 4,
        "ttft_ms": 25, "stream": True, "outcome": "completed"})).seq


def _unbilled(site, request_id: str) -> None:
    log = UnbilledLog(site.engine)
    log.record(request_id, KeyGrant(site.key_id, site.customer_id, None), MODEL, None, stream=False, ttft_ms=None,
               status=FAILED, reason=NO_WORKER)
    asyncio.run(log.flush())


@pytest.fixture
def busy(site):
    """The site's customer with settled and unbilled requests, interleaved, its read models caught up."""
    ledger = Ledger(site.engine)
    seqs = {}
    for i in range(SETTLED):
        seqs[f"req-{i}"] = _settle(site, ledger, f"req-{i}", 1_000 + i)
        if i < UNBILLED:
            _unbilled(site, f"failed-{i}")
    read_models.catch_up(site.engine)
    yield site, ledger, seqs
    ledger.close()


def _get(site, query: str = "", token: str = "customer"):
    return site.call("GET", f"/v1/activity{query}", site.tokens[token])


def _newest_first(site) -> list[str]:
    with site.engine.connect() as conn:
        rows = [*conn.execute(select(generations.c.request_id, generations.c.completed_at)
                              .where(generations.c.account_id == site.customer_id)),
                *conn.execute(select(unbilled_generations.c.request_id, unbilled_generations.c.completed_at))]
    return [r.request_id for r in sorted(rows, key=lambda r: r.completed_at, reverse=True)]


def test_pages_walk_every_request_once_newest_first(busy):
    site, _, _ = busy
    seen, query = [], "?limit=3"
    while True:
        page = _get(site, query).json()
        seen += [row["id"] for row in page["data"]]
        if page["before"] is None:
            break
        query = f"?limit=3&before={page['before']}"
    assert seen == _newest_first(site) and len(seen) == SETTLED + UNBILLED + 1, "the site's own settled request too"

    rows = {row["id"]: row for row in _get(site, "?limit=50").json()["data"]}
    assert rows["req-2"] == {"id": "req-2", "completed_at": rows["req-2"]["completed_at"], "model": MODEL,
                             "api_key_id": site.key_id, "api_key_name": "ci", "status": "streamed", "prompt_tokens": 3,
                             "completion_tokens": 4, "cost_nano_usd": 1_002, "ttft_ms": 25, "reason": None}
    assert rows["failed-1"]["cost_nano_usd"] == 0 and (rows["failed-1"]["status"], rows["failed-1"]["reason"]) == (
        "failed", "no_worker")
    assert "worker_id" not in rows["req-2"] and "owner_nano_usd" not in rows["req-2"], "the owner's side is not shown"
    assert [r["id"] for r in _get(site, "?status=failed").json()["data"]] == ["failed-2", "failed-1", "failed-0"]
    assert {r["id"] for r in _get(site, "?status=streamed").json()["data"]} == {f"req-{i}" for i in range(SETTLED)}


def test_after_a_cursor_come_the_new_rows_and_the_changed_ones(busy):
    site, ledger, seqs = busy
    first = _get(site).json()
    assert _get(site, f"?after={first['after']}").json() == {"data": [], "after": first["after"], "before": None}

    ledger.append(cmd.ReverseEvent(seqs["req-1"], "refunded", "rev-req-1"))
    _settle(site, ledger, "req-new", 5_000)
    _unbilled(site, "failed-new")
    read_models.catch_up(site.engine)
    newer = _get(site, f"?after={first['after']}&limit=2").json()  # the two that changed first, shown newest first
    assert [(r["id"], r["cost_nano_usd"]) for r in newer["data"]] == [("req-new", 5_000), ("req-1", 0)]
    rest = _get(site, f"?after={newer['after']}").json()
    assert [r["id"] for r in rest["data"]] == ["failed-new"], "none skipped, none repeated"
    assert _get(site, f"?after={rest['after']}").json()["data"] == []


def test_who_reads_the_activity(busy):
    site, _, _ = busy
    mine = _get(site).json()["data"]
    assert _get(site, token="accountant").json()["data"] == mine
    assert _get(site, f"?account_id={site.customer_id}", "admin").json()["data"] == mine
    assert _get(site, token="other_customer").json()["data"] == []
    assert _get(site, f"?account_id={site.customer_id}", "other_customer").status_code == 404
    assert _get(site, token="owner").status_code == 403, "an owner never sees its customers' keys"
    assert _get(site, token="revoked").status_code == 401
    with site.engine.connect() as conn, pytest.raises(NotVisible):  # whatever a guard lets through
        activity(conn, Principal(site.token_ids["owner"], site.owner_id, OWNER), None)


@pytest.mark.parametrize("query", ["?status=nope", "?status=", "?limit=0", "?limit=501", "?limit=x", "?key_id=0",
                                   "?key_id=-1", "?after=12", "?after=1.2.3", "?before=99999999999999999999.1",
                                   "?after=1.1&before=1.1", "?model=", f"?model={'m' * 201}", "?account_id=0"])
def test_bad_filters_are_refused_and_write_nothing(busy, query):
    site, _, _ = busy
    before = (site.money(), _newest_first(site))
    refused = _get(site, query)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error" and refused.json()["error"]["message"]
    assert (site.money(), _newest_first(site)) == before


def test_the_api_document_describes_the_route(site):
    operation = site.call("GET", "/docs/openapi.json").json()["paths"]["/v1/activity"]["get"]
    parameters = {p["name"]: p for p in operation["parameters"]}
    assert {"model", "key_id", "status", "after", "before", "limit", "account_id"} <= set(parameters)
    assert "failed" in json.dumps(parameters["status"]["schema"])
    assert {"400", "401", "403", "404"} <= set(operation["responses"])


def test_the_command_line_shows_the_same(busy):
    site, _, _ = busy
    url = str(site.engine.url)

    def run(*args, expect=0):
        result = CliRunner().invoke(main, ["activity", *args], env={"PARALON_DATABASE_URL": url})
        assert result.exit_code == expect, result.output
        return result

    shown = json.loads(run(str(site.customer_id), "--limit", "4", "--json").stdout)
    assert shown == _get(site, "?limit=4").json()
    failed = json.loads(run(str(site.customer_id), "--status", "failed", "--key-id", str(site.key_id), "--json").stdout)
    assert [r["id"] for r in failed["data"]] == ["failed-2", "failed-1", "failed-0"]
    assert "req-6" in run(str(site.customer_id)).stdout
    events = site.money()["events"]
    assert json.loads(run(str(site.customer_id), "--after", "12", "--json", expect=2).stderr)["error"]["code"] == "invalid_input"
    run(str(site.customer_id), "--status", "nope", expect=2)
    assert site.money()["events"] == events
