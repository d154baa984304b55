"""A replica's metrics as plain families: merged into one text, they read as the replicas' own texts
would, each sample labelled with its replica; the load report and the dashboard read values from them.
Ray-free and torch-free."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from kvpage.fleet.fleet_feed import fleet_view
from kvpage.fleet.metric_families import families_of, fleet_load, merged_text, value

AWKWARD = 'a "quoted" \\ back\nslashed model'  # every character the text format escapes


class _Gauges:
    def __init__(self, usage: float, waiting: int, model: str) -> None:
        self.usage, self.waiting, self.model = usage, waiting, model

    def collect(self):
        g = GaugeMetricFamily("kvpage:kv_cache_usage_perc", "usage", labels=["model_name"])
        g.add_metric([self.model], self.usage)
        yield g
        g = GaugeMetricFamily("kvpage:num_requests_waiting", "waiting", labels=["model_name"])
        g.add_metric([self.model], self.waiting)
        yield g
        b = GaugeMetricFamily("kvpage:kv_cache_blocks", "blocks", labels=["model_name", "state"])
        b.add_metric([self.model, "used"], 3)
        b.add_metric([self.model, "free"], 5)
        yield b
        c = CounterMetricFamily("kvpage:prompt_tokens_total", "prompt tokens", labels=["model_name"])
        c.add_metric([self.model], 7)
        yield c


def _registry(usage: float, waiting: int, model: str = "m") -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(_Gauges(usage, waiting, model))
    success = Counter("kvpage:request_success", "finished", ["model_name", "finished_reason"], registry=reg)
    success.labels(model, "stop").inc()
    ttft = Histogram("kvpage:ttft_seconds", "ttft", ["model_name"], buckets=(0.1, 1.0), registry=reg)
    ttft.labels(model).observe(0.5)
    return reg


def _samples(text: str) -> list[tuple[str, tuple, float]]:
    return [(s.name, tuple(sorted(s.labels.items())), s.value)
            for f in text_string_to_metric_families(text) for s in f.samples]  # fmt: skip


def test_merged_families_read_as_the_replicas_own_texts_labelled_with_the_replica():
    regs = {"b": _registry(0.25, 1), "a": _registry(0.75, 2, model=AWKWARD)}
    merged = merged_text({r: families_of(reg) for r, reg in regs.items()})
    own = {r: _samples(generate_latest(reg).decode()) for r, reg in regs.items()}
    expected = sorted((name, tuple(sorted((*labels, ("replica", r)))), v)
                      for r in sorted(own) for name, labels, v in own[r])  # fmt: skip
    assert sorted(_samples(merged)) == expected
    assert len(expected) == 2 * 13  # per replica: 5 of _Gauges, 2 of the counter, 6 of the histogram
    assert ("kvpage:kv_cache_usage_perc", (("model_name", AWKWARD), ("replica", "a")), 0.75) in expected
    # the families, split as generate_latest writes them: _created in a gauge family of its own
    assert "# TYPE kvpage:ttft_seconds histogram" in merged and "# TYPE kvpage:ttft_seconds_created gauge" in merged
    assert "# TYPE kvpage:request_success counter" in merged
    assert "# TYPE kvpage:request_success_created gauge" in merged
    assert merged_text({}) == ""


def test_a_sample_is_found_by_name_and_the_labels_asked_for():
    fams = families_of(_registry(0.25, 1))
    assert value(fams, "kvpage:kv_cache_usage_perc") == 0.25
    assert value(fams, "kvpage:kv_cache_blocks", state="used") == 3.0
    assert value(fams, "kvpage:kv_cache_blocks", state="free") == 5.0
    assert value(fams, "kvpage:prompt_tokens_total") == 7.0
    assert value(fams, "kvpage:request_success_total", finished_reason="stop") == 1.0
    assert value(fams, "kvpage:ttft_seconds_bucket", le="0.1") == 0.0
    assert value(fams, "kvpage:ttft_seconds_bucket", le="1.0") == 1.0
    assert value(fams, "kvpage:kv_cache_blocks", state="swapped") is None
    assert value(fams, "kvpage:no_such_sample") is None
    assert value({}, "kvpage:kv_cache_usage_perc") is None


def test_the_load_report_is_the_replicas_mean_usage_and_their_waiting_requests():
    per_replica = {"a": families_of(_registry(0.25, 1)), "b": families_of(_registry(0.75, 2)), "c": {}}
    assert fleet_load(per_replica) == {"kv_cache_usage_perc": 0.5, "num_requests_waiting": 3}
    assert fleet_load({"c": {}}) is None
    assert fleet_load({}) is None


def test_the_dashboard_reads_each_replicas_usage_from_its_families():
    seen = {"trusted": True, "synced": True, "blocks": 4, "heard_ago": 0.1, "load": [1, 2]}
    st = {"replicas": {"r2": seen, "r1": {**seen, "trusted": False}}, "events_off": ["r3"],
          "metrics": {"r1": families_of(_registry(0.5, 0))}, "routed": 9, "gaps": 1}  # fmt: skip
    view = fleet_view(st)
    assert view["replicas"] == [
        {"replica": "r1", "trusted": False, "synced": True, "indexed_blocks": 4, "heard_ago": 0.1, "load": [1, 2],
         "usage": 0.5, "used_blocks": 3.0},
        {"replica": "r2", "trusted": True, "synced": True, "indexed_blocks": 4, "heard_ago": 0.1, "load": [1, 2],
         "usage": None, "used_blocks": None},  # no metrics report yet
        {"replica": "r3", "trusted": False, "events_off": True},
    ]  # fmt: skip
    assert (view["routed"], view["gaps"], view["fallbacks"]) == (9, 1, None)
