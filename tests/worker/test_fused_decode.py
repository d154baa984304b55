"""The model runner's fused decode step (torch.ops.kvpage.decode_layers) against the same model
layer by layer.

It must give the same bits as the layer-by-layer kernel path in every case it takes, and must not
take the steps it cannot run (prefill chunks, H2O's mass, fp8 caches, the reference ops)."""

from __future__ import annotations

import weakref

import pytest
import torch

from kvpage.attention.metadata import AttentionMetadata
from kvpage.models import ModelConfig, load_model
from kvpage.worker.fused_decode import FusedDecode
from kvpage.worker.kv_cache import KVCache

pytestmark = pytest.mark.skipif(not __import__("kvpage.ops").ops.load(), reason="CPU kernels unavailable")

GQA_BIAS = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=16, attention_bias=True)  # fmt: skip
MHA = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=32, tie_word_embeddings=True)  # fmt: skip


def _step(lm, seq_lens, block_size, kv_cache_dtype="auto", seed=0):
    """A decode step of len(seq_lens) sequences over a cache of random contents, ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(lm.model.parameters()).dtype
    per = [-(-n // block_size) for n in seq_lens]
    kv = KVCache(lm.config, sum(per) + 1, block_size, dtype, kv_cache_dtype=kv_cache_dtype)
    for layer in kv.layers:
        if layer.quantized:
            for t in (layer.k, layer.v):
                t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
            layer.k_scale.uniform_(0.001, 0.02, generator=g)
            layer.v_scale.uniform_(0.001, 0.02, generator=g)
        else:
            layer.k.copy_(torch.randn(layer.k.shape, generator=g))
            layer.v.copy_(torch.randn(layer.v.shape, generator=g))
    ids = torch.randperm(sum(per), generator=g).tolist()  # blocks in no order, as a pool hands them out
    tables, start = [], 0
    for n in per:
        tables.append(ids[start : start + n])
        start += n
    meta = AttentionMetadata.build([1] * len(seq_lens), list(seq_lens), tables, block_size)
    input_ids = torch.randint(0, lm.config.vocab_size, (len(seq_lens),), generator=g)
    positions = torch.tensor([n - 1 for n in seq_lens])
    return input_ids, positions, kv, meta


_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per model, as one runner holds one


def _fused(lm) -> FusedDecode:
    if lm.model not in _FUSED:
        _FUSED[lm.model] = FusedDecode(lm.model)
    return _FUSED[lm.model]


def _both(lm, input_ids, positions, kv, meta):
    """(fused, layer by layer, whether the fused path ran), each from the same cache contents."""
    model = lm.model
    fused = _fused(lm)
    saved = [t.clone() for layer in kv.layers for t in layer.tensors()]
    ran = []
    real = fused.run

    def spy(*a):
        out = real(*a)
        ran.append(out is not None)
        return out

    with torch.inference_mode():
        fused.run = spy
        try:
            a = fused.forward(input_ids, positions, kv.layers, meta)
        finally:
            del fused.run
        for t, s in zip((t for layer in kv.layers for t in layer.tensors()), saved, strict=True):
            t.copy_(s)  # the layer-by-layer pass writes the same K/V into the same slots
        b = model(input_ids, positions, kv.layers, meta)
    return a, b, ran == [True]


@pytest.mark.parametrize("seq_lens", [[1], [37], [1, 17, 40, 100, 16, 33]])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_fused_equals_layer_by_layer(smollm2, smollm2_bf16, dtype, block_size, seq_lens):
    lm = smollm2 if dtype == "float32" else smollm2_bf16
    a, b, ran = _both(lm, *_step(lm, seq_lens, block_size))
    assert ran
    assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", [GQA_BIAS, MHA], ids=["gqa-bias", "mha-tied"])
@pytest.mark.parametrize("weight_dtype", [None, "int8", "int4"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_models_weights_and_caches(cfg, weight_dtype, kv_cache_dtype, dtype):
    lm = load_model(cfg, dtype=dtype, weight_dtype=weight_dtype)
    for lens in ([5], [3, 20, 9, 64, 1]):  # 1 row takes the row kernels; 5 rows torch's GEMM where it wins
        a, b, ran = _both(lm, *_step(lm, lens, 4, kv_cache_dtype, seed=len(lens)))
        assert ran
        assert torch.equal(a, b)


def test_steps_it_cannot_run_go_layer_by_layer(smollm2):
    lm = smollm2
    # a prefill chunk in the step
    ids, pos, kv, _ = _step(lm, [20, 8], 16)
    meta = AttentionMetadata.build([1, 8], [20, 8], [[0, 1], [2]], 16)
    a, b, ran = _both(lm, torch.arange(9), torch.tensor([19, *range(8)]), kv, meta)
    assert not ran and torch.equal(a, b)
    # H2O's attention mass is asked for
    ids, pos, kv, meta = _step(lm, [20, 30], 16)
    meta = AttentionMetadata.build([1, 1], [20, 30], meta.block_tables.tolist(), 16, want_mass=[True, False])
    assert meta.reads.mass is not None
    assert not _both(lm, ids, pos, kv, meta)[2]
    # an fp8 cache (the compiled kernels do not read it)
    assert not _both(lm, *_step(lm, [20], 16, "fp8"))[2]


def test_reference_ops_never_fuse():
    lm = load_model(MHA, dtype="float32", backend="torch")
    a, b, ran = _both(lm, *_step(lm, [7, 12], 4))
    assert not ran and torch.equal(a, b)


def test_weights_quantized_after_a_fused_step_are_read_afresh():
    from kvpage.models.weight_quant import quantize_model

    lm = load_model(GQA_BIAS, dtype="float32")
    step = _step(lm, [6, 9], 4)
    assert _both(lm, *step)[2]
    quantize_model(lm.model, "int8")
    a, b, ran = _both(lm, *_step(lm, [6, 9], 4))
    assert ran and torch.equal(a, b)
    assert _fused(lm)._weights[1] == 8  # it gathered the int8 weights, not the old float ones


@pytest.mark.parametrize("weight_dtype", [None, "int4"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tensor_parallel_rank_runs_the_same_kernels_in_halves(dtype, kv_cache_dtype, weight_dtype):
    """Under tensor parallelism each layer's two halves are called apart (decode_attention_part,
    decode_mlp_part), all-reduced between: in a real group of one the bits equal decode_layers'."""
    from kvpage.distributed.group import TPGroup
    from kvpage.distributed.launch import free_port

    group = TPGroup(0, 1, "127.0.0.1", free_port())
    sharded = load_model(GQA_BIAS, dtype=dtype, weight_dtype=weight_dtype, comm=group)
    whole = load_model(GQA_BIAS, dtype=dtype, weight_dtype=weight_dtype)
    for lens in ([5], [3, 20, 9, 64, 1]):
        step = _step(whole, lens, 4, kv_cache_dtype, seed=len(lens))
        a, b, ran = _both(sharded, *step)
        assert ran and torch.equal(a, b)
        reduces = group.num_all_reduces
        c, _, ran_whole = _both(whole, *step)
        assert ran_whole and torch.equal(a, c)
        assert group.num_all_reduces == reduces  # (the whole model all-reduces nothing)
    assert group.num_all_reduces > 0
    group.close()
