"""The engine on a CUDA device (skipped without one; benchmarks/gpu_check.sh runs it on a GPU machine).

Weights, KV cache, inputs and sampling on the GPU, the Triton kernels for attention (compiled, not
interpreted): float32 greedy equal to transformers' (the CPU oracle), a tiny pool under both
preemption modes, n > 1 and beam search, seeded sampling independent of the batch, and the pool
sized from gpu_memory_utilization."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLM, BeamSearchParams, SamplingParams
from tests.engine.helpers import assert_clean, greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
N = 24


def cuda_llm(**kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_kv_blocks", 256)
    return LLM("smollm2", device="cuda", **kw)


def test_greedy_float32_equals_transformers(prompts, hf_f32_greedy):
    llm = cuda_llm()
    assert llm.llm_engine.kernels == "Triton kernels"
    outs = llm.generate(prompts, greedy(N), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t[:N] for t, _ in hf_f32_greedy]
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_tiny_pool_preempts_and_stays_exact(prompts, hf_f32_greedy, mode):
    llm = cuda_llm(num_kv_blocks=10, max_model_len=160, preemption_mode=mode,
                   **({"swap_space": "64MiB"} if mode == "swap" else {}))  # fmt: skip
    outs = llm.generate(prompts, greedy(N), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t[:N] for t, _ in hf_f32_greedy]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_clean(llm)


def test_samples_and_beams_on_the_device(prompts):
    llm = cuda_llm(dtype="bfloat16")
    sp = SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=16)
    alone = llm.generate([prompts[0]], sp, use_tqdm=False)[0]
    batched = llm.generate(prompts[:4], sp, use_tqdm=False)[0]  # same seed, other company: same samples
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batched.outputs]
    beams = llm.beam_search([prompts[1]], BeamSearchParams(beam_width=4, max_tokens=12))[0]
    assert len(beams.outputs) == 4
    assert_clean(llm)


def test_the_pool_is_sized_from_gpu_memory_utilization():
    small, large = (LLM("smollm2", device="cuda", gpu_memory_utilization=u) for u in (0.3, 0.6))
    blocks = [x.cache_stats().total_blocks for x in (small, large)]
    assert 0 < blocks[0] < blocks[1]
    assert "blocks of 16 tokens" in large.llm_engine.kv_pool_note
