"""The whole engine on the `triton` attention backend (Triton's interpreter on a CPU, the compiled
kernels on a GPU): greedy tokens equal to transformers', and prefix hits, beam forks and a tiny pool
give the same tokens as the reference backend. The interpreter is slow: few, short generations."""

from __future__ import annotations

import pytest

from kvpage import BeamSearchParams
from tests.engine.helpers import assert_clean, greedy, make_llm

pytest.importorskip("triton", reason="triton is not installed")
N = 3


@pytest.fixture(scope="module")
def triton_llm():
    return make_llm(attention_backend="triton", num_kv_blocks=12)


def test_greedy_matches_transformers(triton_llm, prompts, hf_f32_greedy):
    chosen = [3, 5]  # two short raw prompts, batched: a prefill each, then decodes side by side
    outs = triton_llm.generate([prompts[i] for i in chosen], greedy(N), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_f32_greedy[i][0][:N] for i in chosen]
    assert "Triton" in triton_llm.llm_engine.kernels
    assert_clean(triton_llm)


def test_prefix_hits_and_beam_forks_equal_the_reference(triton_llm, prompts):
    """The same prompt again hits the prefix cache (its tail is a chunk after cached context), and a
    beam search of width 2 forks copy-on-write blocks, in a pool of 12 blocks of 16 tokens."""
    reference = make_llm(attention_backend="torch", num_kv_blocks=12)
    prompt = prompts[5]
    for llm in (triton_llm, reference):
        llm.generate([prompt], greedy(2), use_tqdm=False)
    before = triton_llm.cache_stats().prefix_hit_tokens
    hit = triton_llm.generate([prompt], greedy(N), use_tqdm=False)[0]
    assert triton_llm.cache_stats().prefix_hit_tokens - before >= 16
    assert hit.outputs[0].token_ids == reference.generate([prompt], greedy(N), use_tqdm=False)[0].outputs[0].token_ids
    beams = [
        [b.token_ids for b in llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=2))[0].outputs]
        for llm in (triton_llm, reference)
    ]
    assert beams[0] == beams[1]
    assert_clean(triton_llm)
    assert_clean(reference)
