"""The benchmark suite (`make bench`, `kvpage bench --suite`): every member runs on a tiny configuration
(--smoke) and writes well-formed JSON and a plot, records nothing, and the README's headline table is
built from that JSON. The figures themselves are never asserted: these machines are noisy."""

from __future__ import annotations

import importlib
import json
import math
import sys

import pytest

from kvpage.tools.bench_suite import SUITE, benchmarks_dir, resolve

BENCH = benchmarks_dir()
# what the README's headline table (benchmarks/headline.py) reads from each JSON
KEYS = {
    "cache_vs_nocache": ["rows", "short"],
    "paged_vs_static": ["part1", "part2", "trace"],
    "sharing": ["full_sequence", "customer_service", "ttft", "by_kv_dtype"],
    "beam_memory": ["rows"],
    "block_size": ["rows", "seed_rule", "advised", "measured_best"],
    "kv_policies": ["rows", "args"],
    "forward_pass": ["rows"],
    "segments": ["rows"],
    "read_budget": ["speed", "fidelity"],
    "demotion": ["rows", "budgets", "cost"],
    "tensor_parallel": ["rows", "cores"],
    "kv_groups": ["per_sequence", "one_pool", "speed", "hits"],
    "structured_outputs": ["rows", "jump_forward"],
}


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    """Every suite member's --smoke run, in-process (the model loads from the conversion cache each time)."""
    out = tmp_path_factory.mktemp("bench")
    results = (BENCH / "RESULTS.md").read_text()
    readme = (BENCH.parent / "README.md").read_text()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPAGE_BENCH_OUT", str(out))
    mp.syspath_prepend(str(BENCH))
    try:
        for name in SUITE:
            importlib.import_module(name).main(["--smoke"])
    finally:
        mp.undo()
        for name in [*SUITE, "_report", "_bound", "_drive", "_facts", "headline"]:
            sys.modules.pop(name, None)
    assert (BENCH / "RESULTS.md").read_text() == results, "a smoke run wrote RESULTS.md"
    assert (BENCH.parent / "README.md").read_text() == readme, "a smoke run wrote the README"
    return out


def finite(x) -> bool:
    if isinstance(x, dict):
        return all(finite(v) for v in x.values())
    if isinstance(x, list):
        return all(finite(v) for v in x)
    return not isinstance(x, float) or math.isfinite(x)


def test_the_suite_is_the_issues_list_and_each_member_is_a_script():
    assert list(SUITE) == list(KEYS)
    for name in SUITE:
        assert (BENCH / f"{name}.py").exists()
    assert resolve(["all"]) == list(SUITE)
    with pytest.raises(ValueError, match="unknown suite benchmark"):
        resolve(["sharing", "nope"])


@pytest.mark.parametrize("name", list(SUITE))
def test_each_benchmark_writes_well_formed_json_and_a_plot(smoke_results, name):
    data = json.loads((smoke_results / f"{name}.json").read_text())
    for key in KEYS[name]:
        assert data[key], (name, key)
    assert finite(data), name
    meta = data["_meta"]
    assert meta["machine"] and meta["date"] and "kvpage@" in meta["versions"] and meta["command"]
    png = smoke_results / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name


def test_the_headline_table_has_a_row_per_claim_and_rewrites_only_its_markers(smoke_results, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    headline = importlib.import_module("headline")
    try:
        names = [r[3] for r in headline.rows(smoke_results)]
        assert set(names) == set(SUITE)
        text = headline.table(smoke_results)
        assert text.count("\n| ") == len(names) and "[plot](benchmarks/results/sharing.png)" in text
        readme = tmp_path / "README.md"
        readme.write_text(f"# x\n\nbefore\n{headline.START}\nSTALE\n{headline.END}\nafter\n")
        assert headline.update_readme(readme, text)
        body = readme.read_text()
        assert "STALE" not in body and body.startswith("# x\n\nbefore\n") and body.endswith(f"{headline.END}\nafter\n")
        assert text in body
    finally:
        sys.modules.pop("headline", None)
        sys.modules.pop("_report", None)
