"""A read budget (kvpage/attention/key_bounds.py): per-block key bounds kept exact by every write and
move of a block, the blocks Quest's bound chooses, and the compiled kernel reading exactly those."""

from __future__ import annotations

import random

import pytest
import torch

from kvpage.attention import AttentionMetadata, get_backend
from kvpage.attention.key_bounds import DENSE_LAYERS, choose_blocks, min_budget
from kvpage.models.config import ModelConfig
from kvpage.ops import load
from kvpage.worker.kv_cache import KVCache

BACKENDS = ["torch", "cpu"] if load() else ["torch"]
CACHES = [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8"), (torch.float32, "fp8")]
BS, KVH, H, D, NB = 16, 2, 6, 64, 48


def keys_of(kv) -> torch.Tensor:
    """Every slot's key in float32, as the kernels read it: [blocks, kv_heads, bs, d]."""
    return kv.k.float() * kv.k_scale[..., None] if kv.quantized else kv.k.float()


def bounded_cache(backend, dtype, kv_dtype):
    kv = backend.allocate_kv(NB, KVH, BS, D, dtype, kv_dtype, "cpu")
    kv.keep_bounds()
    return kv


def fill(backends_kvs, lens, dtype, seed=0):
    """Prefill sequences of these lengths into scattered blocks through each backend; their tables."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(NB))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    meta = AttentionMetadata.build(lens, lens, tables, BS)
    t = sum(lens)
    q, k, v = (torch.randn(t, heads, D, generator=g).to(dtype) for heads in (H, KVH, KVH))
    for backend, kv in backends_kvs:
        backend.forward(q, k, v, kv, meta, D**-0.5)
    return tables, free


@pytest.mark.parametrize("dtype,kv_dtype", CACHES)
def test_bounds_are_exact_whatever_order_the_slots_were_written_in(dtype, kv_dtype):
    pairs = [(b, bounded_cache(b, dtype, kv_dtype)) for b in map(get_backend, BACKENDS)]
    tables, _ = fill(pairs, [70, 33], dtype)
    # then the slots of one more block, one decode at a time in a shuffled order
    g = torch.Generator().manual_seed(5)
    order = list(range(BS))
    random.Random(3).shuffle(order)
    blk = 40 if 40 not in tables[0] + tables[1] else next(b for b in range(NB) if b not in tables[0] + tables[1])
    for off in order:
        k, v = torch.randn(1, KVH, D, generator=g).to(dtype), torch.randn(1, KVH, D, generator=g).to(dtype)
        slots = torch.tensor([blk * BS + off])
        for backend, kv in pairs:
            backend.write(k, v, kv, slots)
            backend.refresh_bounds(kv, slots)
    full = [b for t in tables for b in t[:-1]] + [blk]  # every block whose slots are all written
    for _, kv in pairs:
        keys = keys_of(kv)
        assert torch.equal(kv.k_min[full], keys[full].amin(2)) and torch.equal(kv.k_max[full], keys[full].amax(2))
    if len(pairs) == 2:  # the compiled refresh writes the same bits as the torch one
        assert torch.equal(pairs[0][1].k_min, pairs[1][1].k_min) and torch.equal(pairs[0][1].k_max, pairs[1][1].k_max)


def test_quest_bound_chooses_the_sink_the_recent_and_the_top_blocks_by_exact_id():
    backend = get_backend("torch")
    kv = bounded_cache(backend, torch.float32, "auto")
    table = torch.tensor([7, 3, 11, 20, 5, 9, 30, 31, 2, 14])  # 10 blocks, the last one partial
    length = 9 * BS + 4
    kv.k_min.zero_()
    kv.k_max.zero_()
    # dimension 0's bound for a query along +e0: block 20 (index 3) highest, then 31 (index 7), then 5, 9
    for blk, hi in ((20, 5.0), (31, 4.0), (5, 1.0), (9, 1.0)):
        kv.k_max[blk, :, 0] = hi
    q = torch.zeros(H, D)
    q[:, 0] = 1.0
    chosen = choose_blocks(q, kv, table, length, budget_blocks=5)  # sink 0, recent 8 and 9, two by bound
    assert [c.tolist() for c in chosen] == [[0, 3, 7, 8, 9]] * KVH
    # a tie (blocks 5 and 9 at 1.0) goes to the earlier table index
    chosen = choose_blocks(q, kv, table, length, budget_blocks=6)
    assert chosen[0].tolist() == [0, 3, 4, 7, 8, 9]
    # a query along -e0 is bounded by the min instead: block 11 (index 2), the lowest min, is chosen
    kv.k_min[11, :, 0] = -3.0
    q[:, 0] = -1.0
    assert choose_blocks(q, kv, table, length, budget_blocks=4)[1].tolist() == [0, 2, 8, 9]
    # a budget covering the sequence reads it all
    assert choose_blocks(q, kv, table, length, budget_blocks=10)[0].tolist() == list(range(10))
    assert min_budget(BS) == 4 * BS


@pytest.mark.skipif(not load(), reason="the CPU kernels do not build here")
@pytest.mark.parametrize("dtype,kv_dtype", CACHES)
def test_the_kernel_reads_the_blocks_the_reference_chooses(dtype, kv_dtype):
    ref, cpu = get_backend("torch"), get_backend("cpu")
    pairs = [(ref, bounded_cache(ref, dtype, kv_dtype)), (cpu, bounded_cache(cpu, dtype, kv_dtype))]
    lens = [300, 37, 161]  # 19, 3 (under the budget: a full read) and 11 blocks
    tables, free = fill(pairs, lens, dtype, seed=1)
    tables = [t + [free.pop()] if n % BS == 0 else t for t, n in zip(tables, lens, strict=True)]
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(3, heads, D, generator=g).to(dtype) for heads in (H, KVH, KVH))
    new = [n + 1 for n in lens]
    budget = [128, 128, 128]  # 8 blocks
    out = {}
    for name, (backend, kv) in zip(("ref", "cpu"), pairs, strict=True):
        meta = AttentionMetadata.build([1] * 3, new, tables, BS, read_budgets=budget)
        out[name] = backend.forward(q, k, v, kv, meta, D**-0.5).float()
    torch.testing.assert_close(out["cpu"], out["ref"], atol=2e-5 if dtype == torch.float32 else 1e-2, rtol=0)
    # the sequence under its budget reads everything: the same bits as no budget at all
    cpu, kv = pairs[1]
    dense = cpu.forward(q, k, v, kv, AttentionMetadata.build([1] * 3, new, tables, BS), D**-0.5)
    sparse = cpu.forward(q, k, v, kv, AttentionMetadata.build([1] * 3, new, tables, BS, read_budgets=budget), D**-0.5)
    assert torch.equal(dense[1], sparse[1])
    assert not torch.allclose(dense[0], sparse[0])  # random keys: leaving 11 of 19 blocks out changes the answer


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_block_outside_the_choice_is_never_read(backend_name):
    backend = get_backend(backend_name)
    kv = bounded_cache(backend, torch.float32, "auto")
    tables, free = fill([(backend, kv)], [160], torch.float32, seed=2)
    table = tables[0] + [free.pop()]
    q = torch.zeros(1, H, D)
    q[0, :, 0] = 1.0
    keys = kv.k[table[4]]
    keys[..., 0] = -50.0  # block index 4's keys point away from q: the lowest bound of all
    backend.refresh_bounds(kv, torch.tensor([table[4] * BS]))
    kv.v[table[4]] = float("nan")  # poisoned: any read of it makes the output NaN
    k, v = torch.zeros(1, KVH, D), torch.zeros(1, KVH, D)
    meta = AttentionMetadata.build([1], [161], [table], BS, read_budgets=[160])  # 10 of 11 blocks
    assert torch.isfinite(backend.forward(q, k, v, kv, meta, 0.125)).all()
    full = AttentionMetadata.build([1], [161], [table], BS)
    assert torch.isnan(backend.forward(q, k, v, kv, full, 0.125)).any()


def test_every_move_of_a_block_carries_its_bounds_and_a_slot_copy_recomputes_them():
    cfg = ModelConfig(vocab_size=32, hidden_size=H * D, intermediate_size=64, num_layers=4, num_heads=H,
                      num_kv_heads=KVH, head_dim=D, max_position_embeddings=4096)  # fmt: skip
    cache = KVCache(cfg, 8, BS, torch.float32, num_cpu_blocks=4, num_tier_blocks=4, key_bounds=True)
    assert [layer.bounded for layer in cache.layers] == [False] * DENSE_LAYERS + [True] * (4 - DENSE_LAYERS)
    per_block = sum(t[0].numel() * t.element_size() for layer in cache.layers for t in layer.tensors())
    assert KVCache.bytes_per_block(cfg, BS, torch.float32, key_bounds=True) == per_block
    assert KVCache.bytes_per_block(cfg, BS, torch.float32) == per_block - 2 * 2 * KVH * D * 4
    # the shared tier's namespace tells a bounded cache's blocks from a plain one's (other bytes)
    plain = KVCache(cfg, 2, BS, torch.float32)
    assert cache.layout() != plain.layout() and cache.layout().count("x[") == 2  # 2 plain layers, 2 bounded
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers[DENSE_LAYERS:]:
        layer.k.copy_(torch.randn(layer.k.shape, generator=g))
        layer.k_min.copy_(layer.k.amin(2))
        layer.k_max.copy_(layer.k.amax(2))
    top = cache.layers[-1]
    cache.copy_blocks([(1, 2)])
    cache.swap_out([(2, 0)])
    cache.swap_in([(0, 5)])
    cache.offload([(5, 3)])
    cache.restore([(3, 6)])
    assert torch.equal(top.k_min[6], top.k_min[1]) and torch.equal(top.k_max[6], top.k_max[1])
    # a rotated copy (StreamingLLM's sink, a segment) has new keys: its bounds are those of the new keys
    cache.copy_slots([(1 * BS, 7 * BS, BS, 100)], torch.rand(D // 2))
    assert not torch.equal(top.k[7], top.k[1])
    assert torch.equal(top.k_min[7], top.k[7].amin(1)) and torch.equal(top.k_max[7], top.k[7].amax(1))
