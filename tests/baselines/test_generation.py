"""The baselines are real and correct: with no cache and with a static cache, greedy tokens equal the
paged engine's on the real model, and a seeded sample draws the same tokens."""

from __future__ import annotations

import pytest

from kvpage import SamplingParams
from kvpage.baselines import NoCacheGenerator, StaticCacheGenerator
from tests.engine.helpers import greedy, make_llm

N = 10


@pytest.fixture(scope="module")
def paged(prompts):
    llm = make_llm()
    return {
        "greedy": [o.outputs[0].token_ids for o in llm.generate(prompts[:5], greedy(N), use_tqdm=False)],
        "seeded": [o.outputs[0].token_ids for o in llm.generate(prompts[:2], _seeded(), use_tqdm=False)],
    }


def _seeded() -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=N, ignore_eos=True)


@pytest.mark.parametrize("kind", ["no-cache", "static"])
def test_baselines_give_the_paged_engines_tokens(smollm2, prompts, paged, kind):
    gen = NoCacheGenerator(smollm2.model) if kind == "no-cache" else StaticCacheGenerator(smollm2.model, 8, 256)
    assert gen.generate(prompts[:5], greedy(N)) == paged["greedy"]  # a ragged batch of five
    assert gen.generate(prompts[:2], _seeded()) == paged["seeded"]
    if kind == "static":
        assert gen.reserved_slots == 8 * 256  # the last sampled token has no KV yet:
        assert gen.used_tokens == sum(len(p) + N - 1 for p in prompts[:2])


def test_the_static_cache_refuses_what_it_cannot_hold(smollm2, prompts):
    gen = StaticCacheGenerator(smollm2.model, 2, 64)
    with pytest.raises(ValueError, match="static slot of 64"):
        gen.generate([prompts[0]], greedy(64))
    with pytest.raises(ValueError, match="2 slots"):
        gen.generate(prompts[:3], greedy(2))


def test_a_sequence_that_ends_stops_and_the_others_go_on(smollm2, prompts):
    eos = frozenset(smollm2.tokenizer.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=40)
    tokens = NoCacheGenerator(smollm2.model, eos).generate(prompts[:2], params)
    expected = [o.outputs[0].token_ids for o in make_llm().generate(prompts[:2], params, use_tqdm=False)]
    assert tokens == expected and min(map(len, tokens)) < 40  # (one of them ends early)


def test_each_prompt_may_have_its_own_length(smollm2, prompts, paged):
    out = StaticCacheGenerator(smollm2.model, 2, 128).generate(prompts[:2], [greedy(3), greedy(N)])
    assert out == [paged["greedy"][0][:3], paged["greedy"][1]]
