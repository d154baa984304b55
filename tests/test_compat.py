"""The compatibility table (kvpage/compat.py), pair by pair: each feature alone goes, each refused pair
fails with the error of its own row naming its field, and every pair of features not refused goes."""

from __future__ import annotations

import itertools

import pytest

from kvpage import compat
from kvpage.compat import REFUSALS, Feature, example, refusal_of
from kvpage.config import EngineConfig
from kvpage.errors import ParameterError

FEATURES = sorted({f.name: f for r in REFUSALS for f in (r.a, r.b)}.values(), key=lambda f: f.name)


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_every_feature_goes_alone(feature: Feature):
    assert feature.on(example(feature))
    assert refusal_of(example(feature)) is None


@pytest.mark.parametrize("row", REFUSALS, ids=lambda r: f"{r.a.name} x {r.b.name}")
def test_every_refused_pair_fails_with_its_own_row_naming_its_field(row: compat.Refusal):
    setup = example(row.a, row.b)  # (b's example after a's: "no key bounds" unsets a budget's bounds)
    found = refusal_of(setup)
    assert found is not None and found[0] is row
    with pytest.raises(ParameterError) as e:
        compat.check(setup)
    assert e.value.param == row.field and str(e.value) == found[1]


def _clash(f: Feature, g: Feature) -> bool:
    """The two examples set one fact two ways (e.g. two eviction policies): no setup has both."""
    return any(f.example[k] != g.example[k] for k in f.example.keys() & g.example.keys())


def test_a_pair_the_table_does_not_name_is_refused_only_for_what_each_brings_alone():
    """A policy that demotes also evicts and ranks by mass; 3 ranks are tensor parallel: such a pair
    meets a row through what one of its features implies, never through the two together."""
    named = {frozenset((r.a.name, r.b.name)) for r in REFUSALS}
    implied = 0
    for f, g in itertools.combinations(FEATURES, 2):
        if _clash(f, g) or frozenset((f.name, g.name)) in named:
            continue
        found = refusal_of(example(f, g))
        if found is None:
            continue
        implied += 1
        row, alone = found[0], (example(f), example(g))
        assert any(row.a.on(s) for s in alone) and any(row.b.on(s) for s in alone), (f.name, g.name)
    assert implied  # (the property is exercised: demote implies an evicting policy)


def test_an_engine_config_and_a_request_are_checked_by_the_table():
    with pytest.raises(ParameterError, match="^deterministic=True does not go with kv_cache_dtype='fp8'") as e:
        EngineConfig(deterministic=True, kv_cache_dtype="fp8")
    assert e.value.param == "deterministic"
    with pytest.raises(ParameterError, match="remote_kv is a tier of the prefix cache") as e:
        EngineConfig(remote_kv="redis://127.0.0.1:1", enable_prefix_caching=False)
    assert e.value.param == "remote_kv"
    plain = EngineConfig()
    assert refusal_of(plain.setup()) is None
    found = refusal_of(plain.setup(read_budget=64))  # a request's budget on an engine without key bounds
    assert found is not None and found[0].field == "kv_read_budget" and "keeps no key bounds" in found[1]
