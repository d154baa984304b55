"""Prometheus metrics for `/metrics`, in a registry of the app's own (several apps can coexist).

Names, units, types and meanings follow vLLM's (`vllm:X` is `kvpage:X` here, with the same
`model_name` label), so a vLLM dashboard ports by replacing the prefix:

    kvpage:num_requests_running / _waiting       gauges
    kvpage:kv_cache_usage_perc                    gauge, a fraction: 1 means every block is in use
    kvpage:prompt_tokens_total / generation_tokens_total / num_preemptions_total
    kvpage:prefix_cache_queries_total / prefix_cache_hits_total   counters, in prompt tokens
    kvpage:request_success_total{finished_reason="stop|length|abort|error"}
    kvpage:time_to_first_token_seconds / inter_token_latency_seconds / e2e_request_latency_seconds
    kvpage:request_prompt_tokens / request_generation_tokens      histograms, per finished request

kvpage's own, beside them: kvpage:num_requests_swapped, kvpage:kv_cache_blocks{state},
kvpage:kv_group_blocks{group, kind} (a model of several KV-cache groups: each group's blocks), the sharing
and waste ratios, kvpage:prefix_cache_hit_rate, kvpage:engine_steps and, for decodes within a read
budget, kvpage:kv_read_budget_blocks_read / _blocks_in_context. Gauges and counters kept by the
engine come from the one snapshot it published after its last step (engine/engine_stats.py), read once
per scrape: a scrape never sees a step half done. The rest are fed with each request output as it
leaves the engine (engine thread).
"""

from __future__ import annotations

import re
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvpage.engine.engine_stats import ITERATION_TOKEN_BUCKETS
from kvpage.engine.llm_engine import LLMEngine
from kvpage.fleet.metric_families import Families, families_of
from kvpage.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_N_BUCKETS = (1, 2, 4, 8, 16, 32)
PREFIXES = ("kvpage", "vllm")  # --metrics-prefix: kvpage's own names, or vLLM's for its dashboards
FINISH_REASONS = ("stop", "length", "abort", "error")
_NAME = re.compile(rb"^((?:# (?:HELP|TYPE) )?)kvpage:", re.M)


def renamed(text: bytes, prefix: str) -> bytes:
    """Prometheus text with every kvpage:* metric named prefix:* instead (--metrics-prefix vllm: a vLLM
    dashboard or autoscaler reads kvpage unchanged)."""
    return text if prefix == "kvpage" else _NAME.sub(rb"\1" + prefix.encode() + b":", text)


class _EngineCollector:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def collect(self):
        snap, model = self.engine.snapshot, self.model_name  # one step's state, whatever the engine does now
        st = snap.cache
        yield self._gauge("kvpage:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent usage", st.usage)
        blocks = GaugeMetricFamily("kvpage:kv_cache_blocks", "KV-cache blocks by state", labels=["model_name", "state"])
        for state, value in (("used", st.used_blocks), ("free", st.free_blocks), ("cached", st.cached_blocks),
                             ("shared", st.shared_blocks), ("total", st.total_blocks)):  # fmt: skip
            blocks.add_metric([model, state], value)
        yield blocks
        kv_bytes = GaugeMetricFamily("kvpage:kv_cache_bytes", "KV-cache bytes (scales included) by state",
                                     labels=["model_name", "state"])  # fmt: skip
        kv_bytes.add_metric([model, "used"], st.used_bytes)
        kv_bytes.add_metric([model, "total"], st.total_bytes)
        yield kv_bytes
        yield self._gauge("kvpage:kv_cache_shared_of_used_ratio", "shared blocks / used blocks", st.shared_of_used)
        seed_rate = "shared blocks / total blocks (the seed documents' sharing rate)"
        yield self._gauge("kvpage:kv_cache_shared_of_total_ratio", seed_rate, st.shared_of_total)
        yield self._gauge("kvpage:kv_cache_waste_ratio", "allocated slots holding no token", st.waste)
        yield self._gauge("kvpage:prefix_cache_hit_rate", "prompt tokens served from the prefix cache",
                          st.prefix_hit_rate)  # fmt: skip
        yield self._counter("kvpage:prefix_cache_queries", "prefix-cache queries, in prompt tokens",
                            st.prefix_query_tokens)  # fmt: skip
        yield self._counter("kvpage:prefix_cache_hits", "prefix-cache hits, in prompt tokens", st.prefix_hit_tokens)
        yield self._counter("kvpage:cpu_tier_hits", "of the prefix-cache hits, tokens brought back from the CPU tier",
                            st.tier_hit_tokens)  # fmt: skip
        yield self._counter("kvpage:evicted_tokens", "tokens released by eviction policies (StreamingLLM, H2O)",
                            st.evicted_tokens)  # fmt: skip
        yield self._counter("kvpage:kv_verify_blocks", "KV-cache blocks checked by --verify-kv-every",
                            snap.num_kv_verified_blocks)  # fmt: skip
        yield self._counter("kvpage:kv_verify_mismatches", "KV-cache check failures (bad values, or a recompute "
                            "that differs in deterministic mode)", snap.num_kv_mismatches)  # fmt: skip
        tier = GaugeMetricFamily("kvpage:cpu_tier_blocks", "blocks of the prefix cache's CPU tier by state",
                                 labels=["model_name", "state"])  # fmt: skip
        tier.add_metric([model, "cached"], st.tier_cached_blocks)
        tier.add_metric([model, "total"], st.tier_total_blocks)
        yield tier
        if st.demoted_total_blocks:  # a demoting kv_eviction's pools per precision
            used = GaugeMetricFamily("kvpage:kv_demoted_blocks", "blocks of the demoted pools by precision and state",
                                     labels=["model_name", "precision", "state"])  # fmt: skip
            moves = CounterMetricFamily("kvpage:kv_demotions", "blocks demoted into each precision",
                                        labels=["model_name", "precision"])  # fmt: skip
            for p, n in st.demoted_total_blocks.items():
                used.add_metric([model, p, "used"], st.demoted_used_blocks[p])
                used.add_metric([model, p, "total"], n)
                moves.add_metric([model, p], st.demotions[p])
            yield used
            yield moves
        if len(st.group_kinds) > 1:  # a model of several KV-cache groups: each one's share of the blocks
            groups = GaugeMetricFamily("kvpage:kv_group_blocks", "blocks the running sequences' tables hold in each "
                                       "KV-cache group (a block shared by several tables counted in each)",
                                       labels=["model_name", "group", "kind"])  # fmt: skip
            for g, (kind, n) in enumerate(zip(st.group_kinds, st.group_blocks, strict=True)):
                groups.add_metric([model, str(g), kind], n)
            yield groups
        if self.engine.remote is not None:
            yield from self._remote(self.engine.remote, st.block_size)
        for name, value in (("running", snap.num_running), ("waiting", snap.num_waiting),
                            ("swapped", snap.num_swapped)):  # fmt: skip
            yield self._gauge(f"kvpage:num_requests_{name}", f"number of requests {name}", value)
        waiting = GaugeMetricFamily("kvpage:num_requests_waiting_by_reason", "requests waiting, by why: capacity "
                                    "(blocks or seats), deferred (never here: no remote prefill)",
                                    labels=["model_name", "reason"])  # fmt: skip
        waiting.add_metric([model, "capacity"], snap.num_waiting)
        waiting.add_metric([model, "deferred"], 0)
        yield waiting
        counts, total, steps = snap.iteration_tokens
        if counts:
            h = HistogramMetricFamily("kvpage:iteration_tokens_total", "tokens per engine step", labels=["model_name"])
            buckets = [(str(b), c) for b, c in zip(ITERATION_TOKEN_BUCKETS, counts, strict=True)] + [("+Inf", steps)]
            h.add_metric([model], buckets, total)
            yield h
        cfg = self.engine.config
        info = GaugeMetricFamily("kvpage:cache_config_info", "the KV cache's configuration (labels; value 1)",
                                 labels=["model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype",
                                         "enable_prefix_caching", "num_cpu_tier_blocks", "remote_kv"])  # fmt: skip
        info.add_metric([model, str(st.block_size), str(st.total_blocks), str(st.cpu_total_blocks),
                         self.engine.kv_dtype_name, str(cfg.enable_prefix_caching), str(st.tier_total_blocks),
                         str(bool(cfg.remote_kv))], 1.0)  # fmt: skip
        yield info
        yield self._counter("kvpage:num_preemptions", "cumulative number of preemptions", snap.num_preemptions)
        yield self._counter("kvpage:prompt_tokens", "number of prefill tokens processed", snap.num_prompt_tokens)
        yield self._counter("kvpage:generation_tokens", "number of generation tokens processed",
                            snap.num_generation_tokens)  # fmt: skip
        yield self._counter("kvpage:engine_steps", "engine steps run (the step this scrape's state is from)", snap.step)
        yield self._counter("kvpage:kv_read_budget_blocks_read", "decodes within a kv_read_budget: blocks each "
                            "read (per layer past the first two and kv head), summed",
                            snap.budget_blocks_read)  # fmt: skip
        yield self._counter("kvpage:kv_read_budget_blocks_in_context", "decodes within a kv_read_budget: blocks "
                            "in their contexts, summed (read / in context: the share read)",
                            snap.budget_blocks_in_context)  # fmt: skip

    def _remote(self, remote, block_size: int):
        rs = remote.stats
        yield self._gauge("kvpage:remote_kv_up", "1 while the shared KV tier answers (0: skipped until it does)",
                          float(rs.up))  # fmt: skip
        yield self._counter("kvpage:remote_kv_fetched_tokens", "tokens fetched from the shared KV tier (checked)",
                            rs.hit_blocks * block_size)  # fmt: skip
        yield self._counter("kvpage:remote_kv_stored_tokens", "tokens written through to the shared KV tier",
                            rs.stored_blocks * block_size)  # fmt: skip
        yield self._counter("kvpage:remote_kv_refused_blocks", "shared-tier records refused: another model's, "
                            "other tokens, or damaged", rs.refused_blocks)  # fmt: skip
        yield self._counter("kvpage:remote_kv_errors", "failed calls to the shared KV tier", rs.errors)
        yield self._counter("kvpage:remote_kv_dropped_blocks", "writes to the shared KV tier given up",
                            remote.kv_store.num_dropped)  # fmt: skip


class Metrics:
    def __init__(self, engine: LLMEngine, model_name: str = "kvpage") -> None:
        self.model_name, self.engine = model_name, engine
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, label, registry=self.registry, buckets=buckets).labels(model_name)

        self.ttft = histogram("kvpage:time_to_first_token_seconds", "time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("kvpage:inter_token_latency_seconds", "time between tokens of a request",
                             _LATENCY_BUCKETS)  # fmt: skip
        self.e2e = histogram("kvpage:e2e_request_latency_seconds", "arrival to finish of a request",
                             _LATENCY_BUCKETS)  # fmt: skip
        self.prompt_tokens = histogram("kvpage:request_prompt_tokens", "prompt tokens of a finished request",
                                       _TOKEN_BUCKETS)  # fmt: skip
        self.generation_tokens = histogram("kvpage:request_generation_tokens",
                                           "tokens generated by a finished request", _TOKEN_BUCKETS)  # fmt: skip
        phases = (("queue", "arrival to its first step"), ("prefill", "first step to first token"),
                  ("decode", "first token to last"), ("inference", "first step to last token"))  # fmt: skip
        self.phases = {name: histogram(f"kvpage:request_{name}_time_seconds", f"a finished request's {doc}",
                                       _LATENCY_BUCKETS) for name, doc in phases}  # fmt: skip
        self.params_n = histogram("kvpage:request_params_n", "n (or beam width) of a finished request", _N_BUCKETS)
        self.params_max_tokens = histogram("kvpage:request_params_max_tokens", "max_tokens of a finished request",
                                           _TOKEN_BUCKETS)  # fmt: skip
        success = Counter("kvpage:request_success", "finished requests by finish reason",
                          ["model_name", "finished_reason"], registry=self.registry)  # fmt: skip
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._arrival: dict[str, float] = {}  # requests seen and not yet ended, by id: their arrival time
        self._first_seen: set[str] = set()
        self._lock = threading.Lock()

    def render(self) -> bytes:
        """The Prometheus text of every metric."""
        return generate_latest(self.registry)

    def families(self) -> Families:
        """Every metric as plain data (fleet/metric_families.py), as a fleet replica reports them."""
        return families_of(self.registry)

    def load_report(self) -> dict:
        """What an ORCA load report names (app.py's endpoint-load-metrics header), from the latest snapshot."""
        snap = self.engine.snapshot
        return {"kv_cache_usage_perc": snap.cache.usage, "num_requests_waiting": snap.num_waiting}

    def observe(self, out: RequestOutput) -> None:
        m, rid = out.metrics, out.request_id
        with self._lock:
            if m.get("arrival_time") is not None:
                self._arrival.setdefault(rid, m["arrival_time"])
            if m.get("first_token_time") is not None and rid not in self._first_seen:
                self._first_seen.add(rid)
                self.ttft.observe(m["first_token_time"] - m["arrival_time"])
            for gap in m.get("inter_token_latencies") or ():
                self.itl.observe(gap)
            if not out.finished:
                return
            self._forget(rid)
        reason = "error" if out.error else next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
        self.success[reason if reason in self.success else "stop"].inc()
        if m.get("arrival_time") is not None:
            self.e2e.observe(time.monotonic() - m["arrival_time"])
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        self._phases(m)

    def _phases(self, m: dict) -> None:
        """vLLM's per-phase times of a finished request (those it reached)."""
        arrival, scheduled, first, last = (m.get(k) for k in ("arrival_time", "first_scheduled_time",
                                                                "first_token_time", "last_token_time"))  # fmt: skip
        if m.get("n") is not None:
            self.params_n.observe(m["n"])
        if m.get("max_tokens") is not None:
            self.params_max_tokens.observe(m["max_tokens"])
        if arrival is None or scheduled is None:
            return
        self.phases["queue"].observe(scheduled - arrival)
        if first is not None:
            self.phases["prefill"].observe(first - scheduled)
            self.phases["decode"].observe((last or first) - first)
            self.phases["inference"].observe((last or first) - scheduled)

    def aborted(self, request_id: str) -> None:
        """A request left before it finished (its client went away, or the server is stopping)."""
        with self._lock:
            arrival = self._forget(request_id)
        self.success["abort"].inc()
        if arrival is not None:
            self.e2e.observe(time.monotonic() - arrival)

    def _forget(self, request_id: str) -> float | None:
        self._first_seen.discard(request_id)
        return self._arrival.pop(request_id, None)

    @property
    def tracked(self) -> int:
        """Requests the metrics hold state for (zero when idle: nothing accumulates)."""
        return len(self._arrival) + len(self._first_seen)
