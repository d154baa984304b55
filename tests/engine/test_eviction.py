"""StreamingLLM and H2O through the whole engine, on the real model: memory stays flat however long a
sequence grows (past max_model_len for StreamingLLM), blocks others share are never corrupted, the
policies survive n > 1, beam search and both preemption modes, and a policy that never has to evict
changes nothing."""

from __future__ import annotations

import pytest

from kvpage import LLM, BeamSearchParams, EngineConfig, SamplingParams
from kvpage.core.eviction import H2O, StreamingLLM
from tests.engine.helpers import assert_clean, greedy, make_llm, make_pressed_llm

STREAM = StreamingLLM(sink_tokens=4, window_tokens=64)
HEAVY = H2O(heavy_tokens=32, recent_tokens=64)


def _tokens(llm: LLM, n: int) -> list[int]:
    from kvpage.tools.perplexity import english_corpus

    return llm.get_tokenizer().encode(english_corpus())[:n]


def _record_used(llm: LLM) -> list[int]:
    """Blocks in use after every engine step."""
    engine, used = llm.llm_engine, []
    step = engine.step

    def recording_step():
        out = step()
        used.append(engine.kv_manager.pool.num_used)
        return out

    engine.step = recording_step
    return used


@pytest.mark.parametrize("policy", [STREAM, HEAVY], ids=["streaming", "h2o"])
def test_a_policy_that_never_has_to_evict_changes_nothing(prompts, policy):
    llm = make_llm()
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], greedy(12), use_tqdm=False)]
    kept = llm.generate(prompts[:4], greedy(12, kv_eviction=policy), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in kept] == plain  # every sequence fits its budget (<= 96 tokens)
    assert llm.cache_stats().evicted_tokens == 0
    assert_clean(llm)


def test_streaming_runs_thousands_of_tokens_past_max_model_len_with_a_flat_block_count():
    llm = make_llm(num_kv_blocks=24, max_model_len=256)
    prompt = _tokens(llm, 1800)  # 7x max_model_len, 4.7x the whole pool
    used = _record_used(llm)
    out = llm.generate([prompt], greedy(160, kv_eviction=STREAM), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 160 and out.outputs[0].finish_reason == "length"
    # sink block + its rotated copy + the 64-token window (4 blocks) + a 64-token chunk (4) + a partial one
    budget = 1 + 1 + 4 + 4 + 1
    assert max(used) <= budget
    decode = used[-140:-1]  # generation (the last step freed it all): the count never grows
    assert max(decode) - min(decode) <= 1 and max(decode) <= 1 + 1 + 4 + 1
    assert llm.cache_stats().evicted_tokens >= 1800 + 160 - 4 * 64
    assert_clean(llm)


def test_h2o_generates_far_beyond_its_budget_in_bounded_memory():
    llm = make_llm(num_kv_blocks=24, max_model_len=1024, kv_eviction=HEAVY)  # longer than the pool: H2O is the default
    used = _record_used(llm)
    out = llm.generate([_tokens(llm, 500)], greedy(120), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 120
    assert max(used) <= 2 + 4 + 4 + 1  # heavy hitters + recent window + a chunk + a partial block
    assert max(used[-100:-1]) <= 2 + 4 + 1
    assert_clean(llm)


def test_a_policy_never_corrupts_blocks_that_others_share(prompts):
    """A plain request, a StreamingLLM request with two samples and an H2O beam search, all on one
    long prompt at once: the evicting ones drop blocks the prefix cache and their siblings hold."""
    shared = _tokens(make_llm(num_kv_blocks=8, max_model_len=128), 240)
    solo = make_llm().generate([shared], greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(num_kv_blocks=96, max_model_len=512)
    llm.generate([shared], greedy(2), use_tqdm=False)  # the prompt's blocks are in the prefix cache
    engine = llm.llm_engine
    engine.add_request("plain", shared, greedy(24))
    engine.add_request("stream", shared + prompts[0], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=40,
                                                                    ignore_eos=True, kv_eviction=STREAM))  # fmt: skip
    engine.add_request("beam", shared + prompts[1], BeamSearchParams(beam_width=3, max_tokens=20, kv_eviction=HEAVY))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.scheduler.check_invariants()
    assert llm.cache_stats().evicted_tokens > 0
    assert outs["plain"].outputs[0].token_ids == solo
    assert len(outs["stream"].outputs) == 2 and all(len(c.token_ids) == 40 for c in outs["stream"].outputs)
    assert len(outs["beam"].outputs) == 3
    again = llm.generate([shared], greedy(24), use_tqdm=False)[0]  # its cached blocks are intact too
    assert again.outputs[0].token_ids == solo
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_policies_under_preemption_in_a_tiny_pool(mode):
    """Two evicting requests with two samples each, where only one fits at a time."""
    llm = make_pressed_llm(14, mode, max_model_len=128)
    prompts = [list(range(300 + 50 * i, 300 + 50 * i + 150)) for i in range(2)]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=40, ignore_eos=True,
                            kv_eviction=StreamingLLM(sink_tokens=16, window_tokens=48))  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(len(c.token_ids) == 40 for o in outs for c in o.outputs)
    if mode == "swap":  # a swapped request resumes with the same KV: the same tokens as alone
        alone = make_llm().generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in alone]
    assert_clean(llm)


def test_an_engine_default_policy_and_a_per_request_none():
    llm = make_llm(num_kv_blocks=24, max_model_len=256, kv_eviction="streaming:sink_tokens=4,window_tokens=64")
    prompt = list(range(100, 400))  # longer than max_model_len: fine under the engine's StreamingLLM
    assert len(llm.generate([prompt], greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    failed = llm.generate([prompt], greedy(4, kv_eviction="none"), use_tqdm=False)[0]
    assert failed.error is not None and "max_model_len" in failed.error
    assert_clean(llm)


def test_bad_policies_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="kv_eviction.policy must be"):
        EngineConfig(kv_eviction="lru")
    with pytest.raises(ValueError, match="kv_eviction.window_tokens"):
        SamplingParams(kv_eviction={"policy": "streaming", "window_tokens": 0})
    with pytest.raises(ValueError, match="unknown field"):
        BeamSearchParams(kv_eviction="h2o:heavy=3")
