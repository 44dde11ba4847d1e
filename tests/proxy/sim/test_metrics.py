"""The simulated worker's /metrics, without a server."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.sim.worker import SimWorker, build_app

MODEL = "sim-model"


def test_each_worker_counts_in_a_registry_of_its_own() -> None:
    first, second = build_app("instant", MODEL), build_app("instant", MODEL)
    first.state.prompt_tokens_total += 7

    def prompt_tokens(app: SimWorker) -> float:
        families = text_string_to_metric_families(generate_latest(app.metrics).decode())
        return next(f for f in families if f.name == "vllm:prompt_tokens").samples[0].value

    assert (prompt_tokens(first), prompt_tokens(second)) == (7, 0)


def test_gauges_follow_the_engine_state() -> None:
    app = build_app("h200", MODEL)
    app.state.slots.running, app.state.slots.waiting = 3, 2
    app.state.kv_tokens_in_use = app.profile.kv_cache_capacity_tokens // 4
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(app.metrics).decode())
               for s in f.samples}
    assert samples["vllm:num_requests_running"] == 3 and samples["vllm:num_requests_waiting"] == 2
    assert samples["vllm:kv_cache_usage_perc"] == 0.25
