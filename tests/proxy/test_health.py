"""Health checks without servers: the Prometheus reader, and the probe's
effect on the registry, with workers answering through httpx's mock transport
and the registry on SQLite."""
from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
from sqlalchemy import update

from ledger import accounts as acc
from ledger import commands as cmd
from ledger.schema import utc_now
from proxy import limits
from proxy import workers as registry
from proxy.directory import Directory
from proxy.capacity import WorkerMetrics, parse_metrics
from proxy.health import HealthChecker
from proxy.schema import workers

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} 12345.0
"""
PREFIX_CACHE_METRICS = """# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {0}
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {1}
"""


# --- the Prometheus reader -----------------------------------------------------------


def _busy(text: str) -> int | None:
    return parse_metrics(text).busy


def test_running_and_waiting_are_summed():
    metrics = parse_metrics(VLLM_METRICS.format(running="3.0", waiting="2.0"))
    assert (metrics.busy, metrics.running, metrics.waiting) == (5, 3, 2)


def test_a_sample_with_a_timestamp_is_read_by_its_value():
    text = ('vllm:num_requests_running{model_name="m"} 3 1700000000000\n'
            'vllm:num_requests_waiting{model_name="m"} 1 1700000000000\n')
    assert _busy(text) == 4


def test_every_label_set_counts():
    text = 'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 5\n'
    assert _busy(text) == 7


def test_metrics_without_the_busy_gauges_or_not_prometheus_text_say_nothing():
    assert _busy('vllm:prompt_tokens_total{model_name="m"} 3\n') is None
    assert _busy("") is None
    assert parse_metrics("<html>not found</html>") == WorkerMetrics()


def test_a_similar_name_is_not_mistaken_for_a_busy_gauge():
    assert _busy("vllm:num_requests_running_total 9\nvllm:num_requests_waiting 1\n") == 1


def test_generated_tokens_and_the_kv_cache_are_read_from_vllms_names():
    text = VLLM_METRICS.format(running=1, waiting=0) + (
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{model_name="m"} 4200.0\n'
        'vllm:generation_tokens_created{model_name="m"} 1700000000.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n')
    metrics = parse_metrics(text)
    assert (metrics.generation_tokens, metrics.kv_capacity_tokens, metrics.free_kv_tokens()) == (4200.0, 16_000, 12_000)


def test_prefix_cache_counters_are_read_under_the_names_the_simulated_worker_sends():
    from prometheus_client import generate_latest

    from proxy.sim.worker import build_app

    worker = build_app("instant", "m")
    worker.engine.state.prefix_cache_queries_tokens, worker.engine.state.prefix_cache_hits_tokens = 4000, 3000
    metrics = parse_metrics(generate_latest(worker.metrics).decode())
    assert (metrics.prefix_cache_hits, metrics.prefix_cache_queries) == (3000.0, 4000.0)


def _prefix_cache(text: str) -> tuple[float | None, float | None]:
    metrics = parse_metrics(text)
    return metrics.prefix_cache_hits, metrics.prefix_cache_queries


def test_vllms_older_prefix_cache_names_count_and_both_namings_are_not_summed():
    old = ('vllm:gpu_prefix_cache_hits_total{model_name="m"} 30\n'
           'vllm:gpu_prefix_cache_queries_total{model_name="m"} 40\n')
    assert _prefix_cache(old) == (30.0, 40.0)
    both = old + ('vllm:prefix_cache_hits_total{model_name="m"} 30\n'
                  'vllm:prefix_cache_queries_total{model_name="m"} 40\n')
    assert _prefix_cache(both) == (30.0, 40.0), "vLLM 0.10 sends both: one pair is read"
    assert _prefix_cache(VLLM_METRICS.format(running=0, waiting=0)) == (None, None)
    assert _prefix_cache('vllm:prefix_cache_hits_total{model_name="m"} 3\n') == (None, None), "a pair, or nothing"


def test_llamacpps_names_count_too():
    text = ("llamacpp:tokens_predicted_total 300\nllamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n")
    metrics = parse_metrics(text)
    assert (metrics.generation_tokens, metrics.running, metrics.waiting) == (300.0, 2, 1)


# --- the probe and the registry ---------------------------------------------------------


class FakeWorkers:
    """Answers health, models and metrics per worker URL, as vLLM would."""

    def __init__(self) -> None:
        self.health_status: dict[str, int] = {}
        self.busy: dict[str, tuple[int, int]] = {}
        self.prefix_cache: dict[str, tuple[int, int]] = {}  # (hits, queries) of the workers that report them
        self.context_length = 8192

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/health":
            return httpx.Response(self.health_status.get(base, 200))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "served-m", "max_model_len": self.context_length}]})
        if request.url.path == "/metrics":
            running, waiting = self.busy.get(base, (0, 0))
            text = VLLM_METRICS.format(running=running, waiting=waiting)
            if base in self.prefix_cache:
                text += PREFIX_CACHE_METRICS.format(*self.prefix_cache[base])
            return httpx.Response(200, text=text)
        return httpx.Response(404)


def _add_worker(engine, port: int, engine_name: str = "vllm") -> tuple[int, str]:
    url = f"http://127.0.0.1:{port}"
    with engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, f"owner {port}")
        context = 4096 if engine_name == "llamacpp" else None
        return registry.add_worker(conn, owner, url, "m", engine_name, context), url


def _check(engine, answer) -> Directory:
    """One round of health checks, the workers answering through `answer(request)`."""
    directory = Directory(engine)

    async def round_() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await directory.refresh_async()
            await HealthChecker(directory, client).check_all()

    asyncio.run(round_())
    return directory


def _stored(engine, worker_id: int) -> registry.WorkerView:
    with engine.connect() as conn:
        return registry.get_worker(conn, worker_id)


def test_a_healthy_worker_records_its_heartbeat_context_served_name_and_load(registry_engine):
    worker_id, url = _add_worker(registry_engine, 9001)
    fake = FakeWorkers()
    fake.busy[url] = (3, 2)
    directory = _check(registry_engine, fake.handle)
    stored = _stored(registry_engine, worker_id)
    assert (stored.healthy, stored.context_length, stored.served_model) == (True, 8192, "served-m")
    assert stored.last_heartbeat_at is not None and stored.state == "active"
    assert directory.loads[worker_id].busy() == 5


def test_a_failing_worker_becomes_unhealthy_and_back(registry_engine):
    worker_id, url = _add_worker(registry_engine, 9002)
    fake = FakeWorkers()
    fake.health_status[url] = 500
    _check(registry_engine, fake.handle)
    assert _stored(registry_engine, worker_id).healthy is False
    fake.health_status[url] = 200
    _check(registry_engine, fake.handle)
    assert _stored(registry_engine, worker_id).healthy is True


def test_an_unreachable_worker_is_unhealthy(registry_engine):
    worker_id, _ = _add_worker(registry_engine, 9003)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    _check(registry_engine, refuse)
    assert _stored(registry_engine, worker_id).healthy is False


def _rounds(engine, worker_id: int, answers: list) -> list[registry.WorkerView]:
    """One replica's checker, one round per answer; the stored worker after each round."""
    directory, answer, after = Directory(engine), {}, []

    async def rounds() -> None:
        transport = httpx.MockTransport(lambda request: answer["now"](request))
        async with httpx.AsyncClient(transport=transport) as client:
            checker = HealthChecker(directory, client)
            for answer["now"] in answers:
                await directory.refresh_async()
                await checker.check_all()
                after.append(_stored(engine, worker_id))

    asyncio.run(rounds())
    return after


def _time_out(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_a_healthy_worker_too_busy_to_answer_once_stays_healthy_and_is_unhealthy_the_second_time(registry_engine):
    worker_id, _ = _add_worker(registry_engine, 9010)
    answers = FakeWorkers().handle
    seen = _rounds(registry_engine, worker_id, [answers, _time_out, _time_out, answers, _time_out, answers])
    assert [w.healthy for w in seen] == [True, True, False, True, True, True]
    assert seen[1].last_heartbeat_at == seen[0].last_heartbeat_at, "a probe that timed out is no heartbeat"
    assert seen[5].last_heartbeat_at > seen[3].last_heartbeat_at


def test_a_worker_that_refuses_or_fails_is_unhealthy_at_once_and_one_that_never_answered_stays_so(registry_engine):
    worker_id, _ = _add_worker(registry_engine, 9011)
    answers, failing = FakeWorkers().handle, FakeWorkers()
    failing.health_status["http://127.0.0.1:9011"] = 503
    seen = _rounds(registry_engine, worker_id, [_time_out, answers, _refuse, answers, failing.handle])
    assert [w.healthy for w in seen] == [False, True, False, True, False]


def test_a_llamacpp_worker_is_up_when_its_server_answers_below_500(registry_engine):
    worker_id, url = _add_worker(registry_engine, 9004, "llamacpp")
    fake = FakeWorkers()
    fake.health_status[url] = 404  # llama-cpp-python's server has no /health
    _check(registry_engine, fake.handle)
    stored = _stored(registry_engine, worker_id)
    assert stored.healthy is True and stored.context_length == 4096, "its context comes from registration"


def test_a_draining_worker_is_drained_once_idle_and_a_heartbeat_never_undoes_a_drain(registry_engine):
    worker_id, url = _add_worker(registry_engine, 9005)
    with registry_engine.begin() as conn:
        registry.drain_worker(conn, worker_id)
    fake = FakeWorkers()
    fake.busy[url] = (1, 0)
    _check(registry_engine, fake.handle)
    assert _stored(registry_engine, worker_id).state == "draining", "still running a request"
    fake.busy[url] = (0, 0)
    _check(registry_engine, fake.handle)
    assert _stored(registry_engine, worker_id).state == "drained"
    _check(registry_engine, fake.handle)
    assert _stored(registry_engine, worker_id).state == "drained"


def test_a_draining_worker_still_busy_is_drained_at_the_deadline(registry_engine):
    worker_id, url = _add_worker(registry_engine, 9006)
    overdue = utc_now() - timedelta(seconds=limits.DRAIN_DEADLINE_S + 1)
    with registry_engine.begin() as conn:
        conn.execute(update(workers).where(workers.c.id == worker_id).values(state="draining", drain_requested_at=overdue))
    fake = FakeWorkers()
    fake.busy[url] = (4, 4)
    _check(registry_engine, fake.handle)
    assert _stored(registry_engine, worker_id).state == "drained"


def test_what_a_replica_relayed_is_added_to_every_replicas_total_once(registry_engine):
    worker_id, url = _add_worker(registry_engine, 9008)
    fake = FakeWorkers()
    directory = Directory(registry_engine)

    async def rounds() -> list[int]:
        totals = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake.handle)) as client:
            checker = HealthChecker(directory, client)
            await directory.refresh_async()
            for relayed in (120, 0, 30):
                directory.load(worker_id).relayed_tokens += relayed
                await checker.check_all()
                totals.append(_stored(registry_engine, worker_id).relayed_tokens_total)
        return totals

    assert asyncio.run(rounds()) == [120, 120, 150]
    assert directory.load(worker_id).unflushed() == 0


def test_the_prefix_cache_counters_are_written_with_the_heartbeat_and_null_when_not_reported(registry_engine):
    worker_id, url = _add_worker(registry_engine, 9009)
    fake = FakeWorkers()
    fake.prefix_cache[url] = (750, 1000)
    _check(registry_engine, fake.handle)
    stored = _stored(registry_engine, worker_id)
    assert (stored.prefix_cache_hits_tokens, stored.prefix_cache_queries_tokens) == (750, 1000)
    assert stored.as_dict()["prefix_cache_hit_rate"] == 0.75

    fake.health_status[url] = 500
    _check(registry_engine, fake.handle)
    assert _stored(registry_engine, worker_id).prefix_cache_hit_rate() == 0.75, "an unhealthy probe says nothing new"

    fake.health_status[url] = 200
    del fake.prefix_cache[url]  # restarted without prefix caching
    _check(registry_engine, fake.handle)
    stored = _stored(registry_engine, worker_id)
    assert (stored.prefix_cache_hits_tokens, stored.prefix_cache_queries_tokens, stored.prefix_cache_hit_rate()) == (None, None, None)


def test_a_llamacpp_worker_reports_no_prefix_cache(registry_engine):
    worker_id, url = _add_worker(registry_engine, 9010, "llamacpp")
    _check(registry_engine, FakeWorkers().handle)
    assert _stored(registry_engine, worker_id).as_dict()["prefix_cache_hit_rate"] is None


def test_a_draining_worker_shows_the_seconds_left_before_its_deadline(registry_engine):
    worker_id, _ = _add_worker(registry_engine, 9011)
    with registry_engine.begin() as conn:
        drained_from = registry.drain_worker(conn, worker_id)
    assert drained_from.as_dict()["drain_seconds_left"] == limits.DRAIN_DEADLINE_S
    started = drained_from.drain_requested_at
    assert drained_from.drain_seconds_left(started + timedelta(seconds=30.5)) == limits.DRAIN_DEADLINE_S - 30
    assert drained_from.drain_seconds_left(started + timedelta(seconds=limits.DRAIN_DEADLINE_S + 5)) == 0
    with registry_engine.begin() as conn:
        registry.mark_drained(conn, worker_id)
        assert registry.get_worker(conn, worker_id).as_dict()["drain_seconds_left"] is None
