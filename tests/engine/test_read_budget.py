"""A decode read budget (`kv_read_budget`, kvpage/attention/key_bounds.py) on the real model.

A budget covering the context is the full read, bit for bit. A smaller one changes what a decode
reads and nothing else: prompts read in full (so the first token is the full read's), nothing is
freed, and in deterministic mode the same requests give the same bits whether they run alone or in a
batch, on a warm prefix cache, as parallel samples or beams, or swapped out and back in a tiny pool.
"""

from __future__ import annotations

import pytest

from kvpage import LLM, BeamSearchParams, SamplingParams
from kvpage.attention.key_bounds import DENSE_LAYERS
from kvpage.errors import ParameterError
from kvpage.tools.perplexity import english_corpus
from tests.engine.helpers import assert_clean

BUDGET = 128  # 8 blocks of 16 of prompts of 300-600 tokens


@pytest.fixture(scope="module")
def texts():
    return english_corpus()


def _prompts(llm: LLM, corpus: str) -> list[list[int]]:
    ids = llm.get_tokenizer().encode(corpus[:20000])
    return [ids[0:600], ids[1000:1300], ids[2000:2450]]


def _greedy(budget, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, kv_read_budget=budget, **kw)


def _answer(out) -> list[tuple]:
    return [(c.token_ids, [[(t, lp.logprob) for t, lp in pos.items()] for pos in c.logprobs]) for c in out.outputs]


def test_a_budget_covering_the_context_reads_in_full_and_a_small_one_reads_less(texts):
    # every run cold (a prefix hit computes the prompt's last token alone: other float32 rounding)
    llm = LLM("smollm2", dtype="float32", num_kv_blocks=160, kv_read_budget=0, enable_prefix_caching=False)
    layers = llm.llm_engine.kv_cache.layers
    assert [kv.bounded for kv in layers] == [False] * DENSE_LAYERS + [True] * (len(layers) - DENSE_LAYERS)
    prompts = _prompts(llm, texts)
    full = llm.generate(prompts, _greedy(None), use_tqdm=False)
    covering = llm.generate(prompts, _greedy(1024), use_tqdm=False)
    assert [_answer(o) for o in covering] == [_answer(o) for o in full]
    small = llm.generate(prompts, _greedy(BUDGET), use_tqdm=False)
    for s, f in zip(small, full, strict=True):
        # the first token comes from the prompt's forward, which reads in full
        assert s.outputs[0].logprobs[0] == f.outputs[0].logprobs[0]
        assert s.outputs[0].logprobs[1:] != f.outputs[0].logprobs[1:]  # the decodes read fewer blocks
    assert_clean(llm)


def test_in_deterministic_mode_a_budget_gives_the_same_bits_in_any_batch_cache_or_pool(texts):
    def run(llm, batch):
        return {rid: _answer(out) for rid, out in zip([r for r, _, _ in batch], llm.generate(
            [p for _, p, _ in batch], [sp for _, _, sp in batch], use_tqdm=False), strict=True)}  # fmt: skip

    roomy = LLM("smollm2", dtype="bfloat16", deterministic=True, num_kv_blocks=200, kv_read_budget=BUDGET)
    prompts = _prompts(roomy, texts)
    reqs = [("greedy", prompts[0], _greedy(None)),
            ("n3", prompts[1], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=1,
                                              ignore_eos=True)),
            ("full", prompts[2], _greedy(0))]  # fmt: skip
    alone = {}
    for r in reqs:
        alone.update(run(roomy, [r]))
    assert run(roomy, reqs) == alone  # in one batch
    assert run(roomy, reqs) == alone  # again, on a warm prefix cache
    # the engine's budget applied where a request gave none: 0 (every block) reads otherwise
    assert run(roomy, [("greedy", prompts[0], _greedy(0))])["greedy"] != alone["greedy"]
    beam = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    beams = [o.token_ids for o in roomy.beam_search([prompts[2]], beam)[0].outputs]
    assert_clean(roomy)
    # a pool too small for all of them at once: they are swapped out and back
    tiny = LLM("smollm2", dtype="bfloat16", deterministic=True, num_kv_blocks=90, max_model_len=1024,
               preemption_mode="swap", swap_space="256MiB", kv_read_budget=BUDGET)  # fmt: skip
    assert run(tiny, reqs) == alone
    assert tiny.llm_engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tiny.beam_search([prompts[2]], beam)[0].outputs] == beams
    assert_clean(tiny)


@pytest.mark.same_on_every_kind  # parameter checks
def test_bad_budgets_name_the_field():
    with pytest.raises(ParameterError) as e:
        SamplingParams(kv_read_budget=-1)
    assert e.value.param == "kv_read_budget"
    with pytest.raises(ValueError, match="kv_read_budget"):
        BeamSearchParams(kv_read_budget="64")
    with pytest.raises(ValueError, match="kv_read_budget"):
        LLM("smollm2", dtype="float32", num_kv_blocks=16, kv_read_budget=-5)
    with pytest.raises(ValueError, match="kv_read_budget"):
        LLM("smollm2", dtype="float32", num_kv_blocks=16, kv_read_budget=64, kv_eviction="streaming")
    with pytest.raises(ValueError, match="at least 64 tokens"):  # the engine's own, at start
        LLM("smollm2", dtype="float32", num_kv_blocks=16, kv_read_budget=32)
    plain = LLM("smollm2", dtype="float32", num_kv_blocks=16)
    with pytest.raises(ParameterError, match="keeps no key bounds") as e:
        plain.generate(["hello"], _greedy(256), use_tqdm=False)
    assert e.value.param == "kv_read_budget"
    assert_clean(plain)
    bounded = LLM("smollm2", dtype="float32", num_kv_blocks=16, kv_read_budget=0)
    with pytest.raises(ParameterError, match="at least 64 tokens"):
        bounded.generate(["hello"], _greedy(32), use_tqdm=False)
    with pytest.raises(ParameterError, match="does not go with kv_eviction"):
        bounded.generate(["hello"], _greedy(64, kv_eviction="streaming:sink_tokens=4,window_tokens=60"),
                         use_tqdm=False)  # fmt: skip
    assert_clean(bounded)


@pytest.mark.same_on_every_kind  # which blocks are registered: the scheduler's part
def test_tokens_decoded_within_a_budget_are_never_prefix_hits(texts):
    llm = LLM("smollm2", dtype="float32", num_kv_blocks=160, kv_read_budget=0)
    prompt = _prompts(llm, texts)[1]  # 300 tokens: 18 full blocks and 12 tokens
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    hits = {}
    for budget in (0, 64):  # the full read's answer is registered; the budgeted one's is not
        own = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, kv_read_budget=budget)
        answer = llm.generate([prompt], own, use_tqdm=False)[0]
        follow = prompt + list(answer.outputs[0].token_ids) + [13]
        hits[budget] = llm.generate([follow], params, use_tqdm=False)[0].num_cached_tokens
        llm.llm_engine.reset_prefix_cache()
    assert hits[0] >= 352  # the prompt and the full read's 60 tokens: 22 blocks (and a tail)
    assert hits[64] <= 300  # only the prompt's: nothing decoded within the budget
    assert_clean(llm)
