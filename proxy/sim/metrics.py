"""The simulated worker's /metrics: vLLM's metric names and help, written by
prometheus_client from the engine's counters at each scrape. Each worker has
a registry of its own, so several in one process never mix their numbers."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.limits import SIM_KV_BLOCK_TOKENS
from proxy.sim.engine import Engine

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format vLLM serves
MODEL_LABEL = "model_name"


class EngineCollector:
    """vLLM's gauges and counters (the counters count tokens, as vLLM's do)."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[Metric]:
        state = self.engine.state
        yield self._metric(GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
                           state.requests_running)
        yield self._metric(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                           state.requests_waiting)
        yield self._metric(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                           self.engine.kv_cache_usage())
        cache_config = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
                                         labels=["block_size", "num_gpu_blocks"])
        profile = self.engine.profile
        cache_config.add_metric([str(SIM_KV_BLOCK_TOKENS), str(profile.kv_cache_capacity_tokens // SIM_KV_BLOCK_TOKENS)], 1.0)
        yield cache_config
        yield self._metric(CounterMetricFamily, "vllm:prefix_cache_queries",
                           "Prefix cache queries, in terms of number of queried tokens.", state.prefix_cache_queries_tokens)
        yield self._metric(CounterMetricFamily, "vllm:prefix_cache_hits",
                           "Prefix cache hits, in terms of number of cached tokens.", state.prefix_cache_hits_tokens)
        yield self._metric(CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                           state.prompt_tokens_total)
        yield self._metric(CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
                           state.generation_tokens_total)

    def _metric(self, family: type, name: str, help_text: str, value: float) -> Metric:
        metric = family(name, help_text, labels=[MODEL_LABEL])
        metric.add_metric([self.model], value)
        return metric


def engine_registry(engine: Engine, model: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model))
    return registry
