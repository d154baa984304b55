"""The real model on the paged cache against transformers running the same GGUF weights."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy
from tests.worker.driver import assert_pool_clean, decode_logits, greedy_generate, make_runner

N = 32  # the oracle fixture holds 32 tokens per prompt


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def blocks_for(prompts, n, bs):
    return sum(-(-(len(p) + n) // bs) for p in prompts) + 4


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_f32_batched_greedy_identical_to_transformers(smollm2, prompts, hf_f32_greedy, block_size):
    runner, mgr = make_runner(smollm2, blocks_for(prompts, N, block_size), block_size)
    r = greedy_generate(runner, mgr, prompts, N)
    for i, (hf_tokens, hf_logits) in enumerate(hf_f32_greedy):
        assert r.tokens[i] == hf_tokens, f"prompt {i}"
        assert rel_err(r.first_logits[i], hf_logits) < 1e-4
    assert_pool_clean(mgr)


def test_f32_one_by_one_identical_to_transformers(smollm2, prompts, hf_f32_greedy):
    runner, mgr = make_runner(smollm2, blocks_for(prompts, N, 16), 16)
    for i, p in enumerate(prompts):
        r = greedy_generate(runner, mgr, [p], N)
        assert r.tokens[0] == hf_f32_greedy[i][0], f"prompt {i}"
        assert rel_err(r.first_logits[0], hf_f32_greedy[i][1]) < 1e-4
    assert_pool_clean(mgr)


def test_f32_mixed_prefill_and_decode_batches(smollm2, prompts, hf_f32_greedy):
    """Prompts arrive at different steps, so most forwards mix prefills with decodes of other lengths."""
    runner, mgr = make_runner(smollm2, blocks_for(prompts, N, 16), 16)
    r = greedy_generate(runner, mgr, prompts, N, start_steps=[0, 0, 3, 5, 5, 9, 17, 30])
    assert r.tokens == [t for t, _ in hf_f32_greedy]
    assert_pool_clean(mgr)


def test_f32_prefix_cache_hits_give_identical_output(smollm2, prompts, hf_f32_greedy):
    runner, mgr = make_runner(smollm2, 2 * blocks_for(prompts, N, 16), 16)
    greedy_generate(runner, mgr, prompts[:4], 4)  # computes and caches the prompts' full blocks
    r = greedy_generate(runner, mgr, prompts, N)
    for i in range(4):
        n = len(prompts[i])
        # the first run cached the full blocks of n + 3 tokens (its 4th token's KV is never computed);
        # if that filled the block where the prompt ends, its leading tokens are a partial hit too
        tail_cached = n + 3 >= ((n - 1) // 16 + 1) * 16
        assert r.hit_tokens[i] == (n - 1 if tail_cached else (n - 1) // 16 * 16)
    assert sum(r.hit_tokens[:4]) >= 32
    # the chat prompts share the template's system preamble (its first full blocks) with prompt 0
    assert r.hit_tokens[6] >= 16
    assert r.tokens == [t for t, _ in hf_f32_greedy]
    for i, (_, hf_logits) in enumerate(hf_f32_greedy):
        assert rel_err(r.first_logits[i], hf_logits) < 1e-4
    assert mgr.stats().prefix_hit_tokens > 0
    assert_pool_clean(mgr)


def test_f32_chunked_prefill_identical(smollm2, prompts, hf_f32_greedy):
    runner, mgr = make_runner(smollm2, blocks_for(prompts, 16, 16), 16)
    r = greedy_generate(runner, mgr, prompts, 16, chunk_size=16)
    assert r.tokens == [t[:16] for t, _ in hf_f32_greedy]
    assert_pool_clean(mgr)


# bfloat16 -------------------------------------------------------------------------------------------
#
# Rule: our bfloat16 greedy tokens must equal transformers' bfloat16 tokens for the first 16 tokens,
# except that the two may part at a near-tie: at the first position where they differ, the float32
# logits (our float32 model, which equals transformers' to 1e-4) of the two chosen tokens must lie
# within NEAR_TIE of each other. bfloat16 keeps 8 bits of mantissa, so logits around 16-32 are rounded
# to steps of 0.125 and a 30-layer model accumulates several such errors; NEAR_TIE = 0.5 allows that
# much and no more. Nothing after a divergence is compared (the contexts differ from there on).
# How often the two part says little by itself (both round; which one rounds nearer float32 decides),
# so the second rule measures that: along the float32 greedy continuation, our bfloat16 decode logits
# must be no further from float32 than transformers' bfloat16 logits are (mean |difference|, within
# BF16_ERROR_SLACK; measured on a CPU with AMX: ours 0.107, transformers' 0.122).
NEAR_TIE = 0.5
N_BF16 = 16
BF16_ERROR_SLACK = 1.25


def test_bf16_agrees_with_transformers_bf16_or_parts_at_a_near_tie(smollm2, smollm2_bf16, prompts, hf_bf16):
    runner, mgr = make_runner(smollm2_bf16, blocks_for(prompts, N_BF16, 16), 16)
    ours = greedy_generate(runner, mgr, prompts, N_BF16).tokens
    assert_pool_clean(mgr)
    f32_runner, f32_mgr = make_runner(smollm2, blocks_for(prompts, N_BF16, 16), 16)
    for p, mine in zip(prompts, ours, strict=True):
        theirs, _ = hf_greedy(hf_bf16, p, N_BF16)
        if mine == theirs:
            continue
        i = next(j for j in range(N_BF16) if mine[j] != theirs[j])
        ref = greedy_generate(f32_runner, f32_mgr, [p + theirs[:i]], 1).first_logits[0]
        margin = abs(float(ref[mine[i]] - ref[theirs[i]]))
        assert margin < NEAR_TIE, f"bf16 parted from transformers at token {i} with a float32 margin of {margin:.3f}"
    assert_pool_clean(f32_mgr)


def test_bf16_is_as_close_to_float32_as_transformers_bf16(
    smollm2, smollm2_bf16, prompts, hf_f32_greedy, hf_f32, hf_bf16
):
    ours_err, theirs_err = [], []
    for p, (cont, _) in zip(prompts, hf_f32_greedy[:4], strict=False):
        seq = p + cont[: N_BF16 - 1]
        with torch.no_grad():
            ids = torch.tensor([seq])
            ref = hf_f32(ids).logits[0, len(p) - 1 :].float()
            theirs = hf_bf16(ids).logits[0, len(p) - 1 :].float()
        ours = decode_logits(smollm2_bf16, seq, len(p))
        assert ours.shape == ref.shape
        ours_err.append(float((ours - ref).abs().mean()))
        theirs_err.append(float((theirs - ref).abs().mean()))
    ours_mean, theirs_mean = sum(ours_err) / len(ours_err), sum(theirs_err) / len(theirs_err)
    assert 0 < ours_mean <= BF16_ERROR_SLACK * theirs_mean, (ours_err, theirs_err)
