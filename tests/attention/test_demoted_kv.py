"""Blocks demoted to a lower precision (core/eviction: Demote) on the worker's side: the int4 pool's
KIVI layout within its rounding, an int8 demotion equal to what an int8 cache stores, the demote
operation over every layer (all sources read before any destination is written), and attention over
a table plus demoted blocks equal to attention over a cache that holds those blocks in place."""

from __future__ import annotations

import pytest
import torch

from kvpage.attention import AttentionMetadata, get_backend
from kvpage.attention.int4_kv import Int4KV
from kvpage.attention.kv_quant import quantize
from kvpage.attention.layer_kv import LayerKV
from kvpage.models.config import ModelConfig
from kvpage.ops import load
from kvpage.worker.kv_cache import KVCache

BACKENDS = ["torch", "cpu"] if load() else ["torch"]
BS, KVH, H, D = 16, 2, 6, 64


def _blocks(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, KVH, BS, D, generator=g)
    k[:, :, :, 3] *= 20.0  # an outlier channel, as real keys have
    return k, torch.randn(n, KVH, BS, D, generator=g)


def test_int4_keeps_keys_per_channel_and_values_per_token_within_half_a_step():
    k, v = _blocks(3)
    store = Int4KV.allocate(5, KVH, BS, D, "cpu")
    ids = torch.tensor([4, 0, 2])
    store.put(ids, k, v)
    k4, v4 = store.dequantized(ids)
    k_step = (k.amax(2) - k.amin(2)) / 15  # per block, head and channel
    v_step = (v.amax(3) - v.amin(3)) / 15  # per block, head and token
    assert ((k4 - k).abs() <= k_step[:, :, None] * 0.51 + 1e-2).all()
    assert ((v4 - v).abs() <= v_step[..., None] * 0.51 + 1e-2).all()
    # per channel, the outlier does not cost the other channels their resolution
    assert (k4 - k)[..., :3].abs().mean() < 0.1 and (k4 - k)[..., 3].abs().mean() > 0.2
    assert store.k.shape == (5, KVH, BS, D // 2) and store.k.dtype == torch.uint8


def test_an_int8_demotion_stores_what_an_int8_cache_stores_bit_for_bit():
    k, v = _blocks(2)
    store = LayerKV.allocate((4, KVH, BS, D), torch.float32, "int8", "cpu")
    store.put(torch.tensor([3, 1]), k, v)
    qk, sk = quantize(k, "int8")
    assert torch.equal(store.k[[3, 1]], qk) and torch.equal(store.k_scale[[3, 1]], sk)
    assert torch.equal(store.v[[3, 1]], quantize(v, "int8")[0])


def _cfg(layers: int = 2) -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=H * D, intermediate_size=64, num_layers=layers, num_heads=H,
                       num_kv_heads=KVH, head_dim=D)  # fmt: skip


def test_demote_moves_every_layer_and_reads_every_source_before_writing():
    cache = KVCache(_cfg(), 6, BS, torch.float32, cold_blocks={"int8": 2, "int4": 3})
    blocks = [_blocks(6, seed) for seed in range(2)]
    for layer, (k, v) in zip(cache.layers, blocks, strict=True):
        layer.k.copy_(k)
        layer.v.copy_(v)
    cache.demote([("hot", 1, "int8", 0)])
    # block 2 takes int8 block 0, whose content goes to int4 block 1 in the same step: read first
    cache.demote([("int8", 0, "int4", 1), ("hot", 2, "int8", 0)])
    for layer, (k, v) in zip(cache.layers, blocks, strict=True):
        k8, v8 = layer.cold["int8"].dequantized(torch.tensor([0]))
        assert torch.allclose(k8[0], k[2], atol=k[2].abs().amax() / 127)
        k4, v4 = layer.cold["int4"].dequantized(torch.tensor([1]))  # block 1, via int8
        assert (k4[0] - k[1]).abs().mean() < 0.2 and (v4[0] - v[1]).abs().mean() < 0.1
    assert KVCache.demoted_bytes_per_block(_cfg(), BS, "int4") == 2 * KVH * (BS * D + 4 * D + 4 * BS)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_demoted_blocks_equals_attention_with_them_in_place(backend_name, dtype):
    """A sequence of 5 blocks whose blocks 0 and 2 were demoted (int8, int4), decoding and running a
    chunk, against the same sequence in a cache that holds those blocks' dequantized K/V in place:
    the same output and the same mass per block, whatever the order the keys are read in."""
    backend = get_backend(backend_name)
    kv = backend.allocate_kv(12, KVH, BS, D, dtype, "auto", "cpu")
    kv.cold = {"int8": LayerKV.allocate((3, KVH, BS, D), dtype, "int8", "cpu"),
               "int4": Int4KV.allocate(3, KVH, BS, D, "cpu")}  # fmt: skip
    dense = backend.allocate_kv(12, KVH, BS, D, dtype, "auto", "cpu")
    k, v = _blocks(5, seed=3)
    kv.cold["int8"].put(torch.tensor([2]), k[0:1], v[0:1])
    kv.cold["int4"].put(torch.tensor([1]), k[2:3], v[2:3])
    for j, (store, b) in enumerate([("int8", 2), (None, None), ("int4", 1), (None, None), (None, None)]):
        kj, vj = (k[j : j + 1], v[j : j + 1]) if store is None else kv.cold[store].dequantized(torch.tensor([b]))
        dense.k[j], dense.v[j] = kj[0].to(dtype), vj[0].to(dtype)
        if store is None:
            kv.k[j + 5], kv.v[j + 5] = kj[0].to(dtype), vj[0].to(dtype)
    g = torch.Generator().manual_seed(4)
    for m in (1, 7):  # a decode, then a chunk of 7 (its K/V written by the step)
        n = 5 * BS + m  # the dense cache's keys
        q = torch.randn(m, H, D, generator=g).to(dtype)
        knew, vnew = (torch.randn(m, KVH, D, generator=g).to(dtype) for _ in range(2))
        # the new tokens go into a sixth block: physical 10 (dense), 11 (the demoted cache, whose
        # resident logical blocks 1, 3, 4 are physical 6, 8, 9)
        dense_table, table = [0, 1, 2, 3, 4, 10], [6, 8, 9, 11]
        metas = [
            AttentionMetadata.build([m], [n], [dense_table], BS, want_mass=[True]),
            AttentionMetadata.build(
                [m], [n - 2 * BS], [table], BS, want_mass=[True], demoted=[[("int8", 2), ("int4", 1)]]
            ),  # fmt: skip
        ]
        outs = []
        for cache, meta in zip((dense, kv), metas, strict=True):
            outs.append(backend.forward(q, knew, vnew, cache, meta, D**-0.5).float())
        assert torch.allclose(outs[0], outs[1], atol=1e-5 if dtype == torch.float32 else 2e-2)
        dense_mass, mass = metas[0].reads.mass[0], metas[1].reads.mass[0]
        assert torch.allclose(mass[: len(table)], dense_mass[[1, 3, 4, 5]], atol=1e-4)
        assert torch.allclose(metas[1].reads.demoted_mass[0], dense_mass[[0, 2]], atol=1e-4)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_first_token_decoded_beside_a_sequence_with_demoted_blocks(backend_name):
    """A batch where some decode reads demoted blocks attends every decode explicitly; a sequence's
    first token (one query, one key: its own, written by the step) is one of them."""
    backend = get_backend(backend_name)
    kv = backend.allocate_kv(8, KVH, BS, D, torch.float32, "auto", "cpu")
    kv.cold = {"int8": LayerKV.allocate((2, KVH, BS, D), torch.float32, "int8", "cpu")}
    k, v = _blocks(2, seed=5)
    kv.cold["int8"].put(torch.tensor([1]), k[:1], v[:1])
    kv.k[2], kv.v[2] = k[1], v[1]
    meta = AttentionMetadata.build([1, 1], [BS, 1], [[2], [5]], BS, want_mass=[True, False],
                                   demoted=[[("int8", 1)], []])  # fmt: skip
    g = torch.Generator().manual_seed(6)
    q, knew, vnew = (
        torch.randn(2, H, D, generator=g),
        torch.randn(2, KVH, D, generator=g),
        torch.randn(2, KVH, D, generator=g),
    )
    out = backend.forward(q, knew, vnew, kv, meta, D**-0.5)
    # the first token sees only itself: its value, for each query head of the group
    assert torch.allclose(out[1], vnew[1].repeat_interleave(H // KVH, 0), atol=1e-6)
    assert meta.reads.demoted_mass[0, 0] > 0 and torch.isclose(
        meta.reads.demoted_mass[0, 0] + meta.reads.mass[0, 0], torch.tensor(H * 1.0)
    )
