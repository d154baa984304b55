"""Blocks demoted instead of dropped (kv_eviction="demote:..."), through the whole engine on the real
model: with no room below the heavy hitters it is H2O token for token; demoted to int8 / int4 the
perplexity stays within the quantization gates where H2O's drops cost far more; memory stays bounded
in every pool; samples, beams, both preemption modes and aborts end with every pool free."""

from __future__ import annotations

import math

import pytest

from kvpage import EngineConfig, SamplingParams
from kvpage.core.eviction import H2O, Demote
from kvpage.tools.perplexity import english_corpus, token_nlls
from tests.engine.helpers import assert_clean, greedy, make_llm, make_pressed_llm

DEMOTE = Demote(hot_tokens=64, int8_tokens=128, int4_tokens=256, recent_tokens=64, cpu_tokens=256)


@pytest.fixture(scope="module")
def llm():
    """An engine whose default policy demotes (its pools per precision sized at start), prefilling 64
    tokens a step as the window does."""
    return make_llm(num_kv_blocks=160, max_model_len=2048, max_num_batched_tokens=64, kv_eviction=DEMOTE)


@pytest.fixture(scope="module")
def text(llm) -> list[int]:
    return llm.get_tokenizer().encode(english_corpus(), add_special_tokens=False)[:1024]


def _ppl(llm, text, policy, skip=300) -> tuple[float, list[float]]:
    nlls = token_nlls(llm, text, window=len(text), kv_eviction=policy)[0]
    return math.exp(sum(nlls[skip:]) / len(nlls[skip:])), nlls


def test_with_no_room_below_the_heavy_hitters_it_is_h2o_exactly(llm, text):
    h2o = _ppl(llm, text[:512], H2O(heavy_tokens=64, recent_tokens=64))[1]  # 384 tokens past the budget
    demote = _ppl(llm, text[:512], Demote(hot_tokens=64, int8_tokens=0, int4_tokens=0, recent_tokens=64))[1]
    assert demote == h2o  # the same blocks dropped in the same steps: the same bits
    out = [llm.generate([text[:400]], greedy(24, kv_eviction=p), use_tqdm=False)[0].outputs[0].token_ids
           for p in (H2O(32, 64), Demote(32, 0, 0, 64))]  # fmt: skip
    assert out[0] == out[1]
    assert_clean(llm)
    # an engine whose own demoting policy has no rung below its heavy hitters keeps no pools: H2O again
    bare = make_llm(num_kv_blocks=48, max_model_len=1024, kv_eviction=Demote(32, 0, 0, 64))
    assert not bare.llm_engine.kv_manager.eviction.cold
    assert bare.generate([text[:400]], greedy(24), use_tqdm=False)[0].outputs[0].token_ids == out[0]
    assert_clean(bare)


def test_demoted_blocks_keep_the_perplexity_within_the_quantization_gates(llm, text):
    full = _ppl(llm, text, "none")[0]
    engine = llm.llm_engine
    before = dict(engine.kv_manager.eviction.num_demoted)
    all_int8 = _ppl(llm, text, Demote(64, 1024, 0, 64))[0]
    all_int4 = _ppl(llm, text, Demote(64, 0, 1024, 64))[0]
    ladder = _ppl(llm, text, DEMOTE)[0]
    h2o = _ppl(llm, text, H2O(64, 64))[0]  # the same hot blocks, the rest dropped
    demoted = engine.kv_manager.eviction.num_demoted
    assert demoted["int8"] > before.get("int8", 0) + 40 and demoted["int4"] > before.get("int4", 0) + 40
    assert abs(all_int8 / full - 1) < 0.01  # int8 per token: within 1% (amx, float32: +0.03%)
    assert abs(all_int4 / full - 1) < 0.05  # int4, KIVI's layout: within 5% (amx: -0.1%)
    # the CPU-tier rung holds the same int4 blocks in host memory: the same bits
    assert _ppl(llm, text, Demote(64, 0, 0, 64, cpu_tokens=1024))[0] == all_int4
    assert ladder < full * 1.10 and h2o > ladder * 1.15  # amx: 11.32 vs full 10.96, H2O 14.04
    assert_clean(llm)


def test_every_pool_stays_bounded_while_a_sequence_grows_far_past_them(llm, text):
    engine = llm.llm_engine
    kv = engine.kv_manager
    peaks = {"hot": 0, "int8": 0, "int4": 0, "cpu": 0}
    step = engine.step

    def recording_step():
        out = step()
        peaks["hot"] = max(peaks["hot"], kv.pool.num_used)
        for p, pool in kv.eviction.cold.items():
            peaks[p] = max(peaks[p], pool.num_used)
        return out

    engine.step = recording_step
    try:
        out = llm.generate([text[:900]], greedy(100), use_tqdm=False)[0]
    finally:
        engine.step = step
    assert len(out.outputs[0].token_ids) == 100
    # heavy (4) + window (4) + a 64-token chunk (4) + a partial block; the other rungs' quotas exactly
    assert peaks["hot"] <= 4 + 4 + 4 + 1 and (peaks["int8"], peaks["int4"], peaks["cpu"]) == (8, 16, 16)
    assert_clean(llm)


def test_samples_and_beams_share_demoted_blocks_and_free_them(llm, text):
    engine = llm.llm_engine
    engine.add_request("n", text[:500], SamplingParams(n=3, temperature=0.8, seed=2, max_tokens=30, ignore_eos=True))
    from kvpage import BeamSearchParams

    engine.add_request("beam", text[100:600], BeamSearchParams(beam_width=3, max_tokens=16))
    shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
        shared = max(shared, sum(b.ref_count > 1 for p in engine.kv_manager.eviction.cold.values() for b in p.blocks))
    assert shared > 0  # forks after a demotion hold its blocks by reference
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_demoting_requests_under_preemption_in_a_tiny_pool(mode, text):
    params = SamplingParams(n=2, temperature=0.0, max_tokens=30, ignore_eos=True)
    policy = Demote(hot_tokens=16, int8_tokens=32, int4_tokens=64, recent_tokens=48)
    llm = make_pressed_llm(12, mode, max_model_len=512, kv_eviction=policy)
    prompts = [text[:200], text[300:500]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(len(c.token_ids) == 30 for o in outs for c in o.outputs)
    if mode == "swap":  # demoted blocks stay put, the rest comes back: the same tokens as alone
        alone = make_llm(num_kv_blocks=64, kv_eviction=policy).generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in alone]
    assert_clean(llm)


def test_an_aborted_request_gives_its_demoted_blocks_back(llm, text):
    engine = llm.llm_engine
    engine.add_request("a", text[:600], greedy(50))
    while not any(p.num_used for p in engine.kv_manager.eviction.cold.values()):
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(llm)


def test_bad_demotions_are_value_errors_naming_the_field(llm):
    plain = make_llm(num_kv_blocks=32)
    with pytest.raises(ValueError, match="kv_eviction: demote.* needs an engine started with a demoting"):
        plain.generate([[1, 2, 3]], greedy(2, kv_eviction=DEMOTE), use_tqdm=False)
    with pytest.raises(ValueError, match="kv_eviction.int8_tokens must be 0 with kv_cache_dtype='int8'"):
        EngineConfig(kv_cache_dtype="int8", kv_eviction=DEMOTE)
    with pytest.raises(ValueError, match="deterministic=True does not go with kv_eviction demote"):
        EngineConfig(deterministic=True, kv_eviction=DEMOTE)
    with pytest.raises(ValueError, match="kv_read_budget does not go with kv_eviction demote"):
        EngineConfig(kv_read_budget=0, kv_eviction=DEMOTE)
    with pytest.raises(ValueError, match="kv_eviction.int4_tokens"):
        SamplingParams(kv_eviction="demote:int4_tokens=-5")
    assert_clean(llm)
    assert_clean(plain)
