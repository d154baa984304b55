"""Prometheus metrics for `/metrics`, in a registry of the app's own (several apps can coexist).

Gauges and counters are read from the engine when scraped; latency histograms are fed with each
request output as it leaves the engine.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpage.engine.llm_engine import LLMEngine
from kvpage.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self):
        engine, sched = self.engine, self.engine.scheduler
        st = engine.cache_stats()
        yield GaugeMetricFamily("kvpage:kv_cache_usage_perc", "KV-cache blocks in use, percent", value=100 * st.usage)
        blocks = GaugeMetricFamily("kvpage:kv_cache_blocks", "KV-cache blocks by state", labels=["state"])
        for state, value in (("used", st.used_blocks), ("free", st.free_blocks), ("cached", st.cached_blocks),
                             ("shared", st.shared_blocks), ("total", st.total_blocks)):  # fmt: skip
            blocks.add_metric([state], value)
        yield blocks
        yield GaugeMetricFamily("kvpage:kv_cache_sharing_ratio", "shared / used blocks", value=st.sharing_ratio)
        yield GaugeMetricFamily("kvpage:kv_cache_waste_ratio", "allocated slots holding no token", value=st.waste)
        yield GaugeMetricFamily("kvpage:prefix_cache_hit_rate", "prompt tokens served from the prefix cache",
                                value=st.prefix_hit_rate)  # fmt: skip
        yield CounterMetricFamily(
            "kvpage:prefix_cache_queries", "prompt tokens looked up", value=st.prefix_query_tokens
        )
        yield CounterMetricFamily("kvpage:prefix_cache_hits", "prompt tokens hit", value=st.prefix_hit_tokens)
        for name, value in (("running", len(sched.running)), ("waiting", len(sched.waiting)),
                            ("swapped", len(sched.swapped))):  # fmt: skip
            yield GaugeMetricFamily(f"kvpage:num_requests_{name}", f"requests {name}", value=value)
        yield CounterMetricFamily("kvpage:num_preemptions", "preemptions", value=sched.num_preemptions)
        yield CounterMetricFamily("kvpage:prompt_tokens", "prompt tokens received", value=engine.num_prompt_tokens)
        yield CounterMetricFamily("kvpage:generation_tokens", "tokens generated", value=engine.num_generation_tokens)


class Metrics:
    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("kvpage:time_to_first_token_seconds", "time to first token",
                              registry=self.registry, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.itl = Histogram("kvpage:inter_token_latency_seconds", "time between tokens of a request",
                             registry=self.registry, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self._seen_first: set[str] = set()

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if m.get("first_token_time") is not None and out.request_id not in self._seen_first:
            self._seen_first.add(out.request_id)
            self.ttft.observe(m["first_token_time"] - m["arrival_time"])
        for gap in m.get("inter_token_latencies") or ():
            self.itl.observe(gap)
        if out.finished:
            self._seen_first.discard(out.request_id)
