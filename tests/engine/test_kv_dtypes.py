"""Quantized KV blocks (kv_cache_dtype="int8" / "fp8") through the whole engine: more blocks in
the same memory, one byte count everywhere, shareable and movable like any block, and accurate."""

from __future__ import annotations

import pytest

from kvpage import LLM, EngineConfig
from kvpage.core.kv_bytes import kv_bytes_per_block
from kvpage.tools.kv_estimate import resolve_shape
from kvpage.tools.perplexity import english_corpus, perplexity
from tests.engine.helpers import assert_clean, greedy, make_llm, make_pressed_llm

N = 12
KINDS = ["int8", "fp8"]


def test_at_a_fixed_memory_the_pool_holds_more_blocks_and_every_count_agrees():
    blocks = {}
    for dtype, kind in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("float32", "fp8")):
        llm = LLM("smollm2", dtype=dtype, kv_cache_dtype=kind, kv_cache_memory="32MiB", max_model_len=512)
        st = llm.cache_stats()
        name = dtype if kind == "auto" else kind
        assert st.bytes_per_block == kv_bytes_per_block(30, 3, 64, name, 16)
        assert st.bytes_per_block == resolve_shape("smollm2").bytes_per_token(name) * 16  # `kvpage estimate`
        assert st.total_blocks == 32 * 2**20 // st.bytes_per_block and st.total_bytes <= 32 * 2**20
        real = sum(t.numel() * t.element_size() for layer in llm.llm_engine.kv_cache.layers for t in layer.tensors())
        assert real == st.total_bytes  # what is allocated is what is counted, scales included
        blocks[(dtype, kind)] = st.total_blocks
    assert blocks[("float32", "int8")] == blocks[("float32", "fp8")]
    # 68 bytes a head (64 values + a float32 scale) against 128 (bfloat16) and 256 (float32)
    assert blocks[("float32", "int8")] / blocks[("bfloat16", "auto")] == pytest.approx(128 / 68, rel=0.01)
    assert blocks[("float32", "int8")] / blocks[("float32", "auto")] == pytest.approx(256 / 68, rel=0.01)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_quantized_blocks_are_forked_preempted_and_hit_like_any_block(prompts, kind, mode):
    chosen = [prompts[i] for i in (0, 2, 6)]
    roomy = make_llm(kv_cache_dtype=kind)
    ref = [o.outputs[0].token_ids for o in roomy.generate(chosen, greedy(N), use_tqdm=False)]
    # three samples share each prompt's blocks (copy-on-write) in a pool too small for all of them
    llm = make_pressed_llm(12, mode, "32MiB", kv_cache_dtype=kind)
    outs = llm.generate(chosen, greedy(N, n=3), use_tqdm=False)
    for r, out in zip(ref, outs, strict=True):
        assert out.error is None and [c.token_ids for c in out.outputs] == [r] * 3
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0 and (sched.num_swapped_out > 0) == (mode == "swap")
    assert_clean(llm)
    # the same prompts again hit their quantized blocks in the prefix cache: the same tokens as cold
    before = roomy.cache_stats().prefix_hit_tokens
    again = [o.outputs[0].token_ids for o in roomy.generate(chosen, greedy(N), use_tqdm=False)]
    assert again == ref and roomy.cache_stats().prefix_hit_tokens > before
    assert_clean(roomy)


@pytest.mark.parametrize("kind,gate", [("int8", 0.01), ("fp8", 0.02)])
def test_perplexity_through_a_quantized_cache_stays_within_its_gate(smollm2, kind, gate):
    """Windows of 256 prefilled in chunks of 64: later chunks attend to earlier ones read back from
    the quantized cache. The gate: int8 under 1% (the seeds' claim); fp8's 3 mantissa bits cost more
    (benchmarks/kv_dtypes.py measures both on 24k tokens)."""
    ids = smollm2.tokenizer.encode(english_corpus())[: 4 * 256]
    base = perplexity(make_llm(max_num_batched_tokens=64), ids, window=256).perplexity
    llm = make_llm(max_num_batched_tokens=64, kv_cache_dtype=kind)
    quant = perplexity(llm, ids, window=256).perplexity
    assert quant != base and abs(quant / base - 1) < gate, (base, quant)  # read back quantized, and close
    assert_clean(llm)


def test_a_bad_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8; got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
