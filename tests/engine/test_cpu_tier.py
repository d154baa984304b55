"""The prefix cache's CPU tier through the whole engine: a prompt whose blocks were pushed out of
the pool comes back from the tier, not recomputed, and gives the same tokens as a cold run."""

from __future__ import annotations

import pytest

from kvpage import EngineConfig, SamplingParams
from tests.engine.helpers import assert_clean, greedy, make_llm

N = 8


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_a_prompt_pushed_out_of_the_pool_comes_back_from_the_tier(prompts, kind):
    tok_prompt = prompts[7] * 3  # ~75 tokens: four full blocks
    cold = make_llm(kv_cache_dtype=kind).generate([tok_prompt], greedy(N), use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(num_kv_blocks=12, max_model_len=192, cpu_offload_memory="64MiB", kv_cache_dtype=kind)
    assert llm.cache_stats().tier_total_blocks > 0
    first = llm.generate([tok_prompt], greedy(N), use_tqdm=False)[0].outputs[0].token_ids
    others = [[1000 + 7 * i + j for j in range(150)] for i in range(2)]  # fill the pool: evict everything
    llm.generate(others, greedy(4), use_tqdm=False)
    st = llm.cache_stats()
    assert st.tier_cached_blocks >= len(tok_prompt) // 16
    before_hits = st.tier_hit_tokens
    again = llm.generate([tok_prompt], greedy(N), use_tqdm=False)[0]
    st = llm.cache_stats()
    restored = st.tier_hit_tokens - before_hits
    assert restored == (len(tok_prompt) - 1) // 16 * 16  # every full block but a last token's came back
    assert again.outputs[0].token_ids == first == cold
    assert_clean(llm)
    llm.llm_engine.kv_manager.check_invariants()


def test_samples_of_a_restored_prompt_share_its_blocks():
    llm = make_llm(num_kv_blocks=12, max_model_len=192, cpu_offload_memory="64MiB")
    prompt = list(range(500, 570))
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    llm.generate([[2000 + j for j in range(170)]], greedy(4), use_tqdm=False)
    again = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert again == first and llm.cache_stats().tier_hit_tokens > 0
    assert_clean(llm)


def test_the_tier_needs_prefix_caching_and_a_size():
    with pytest.raises(ValueError, match="cpu_offload_memory is a tier of the prefix cache"):
        EngineConfig(cpu_offload_memory="1GiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="cpu_offload_memory"):
        EngineConfig(cpu_offload_memory="lots")
