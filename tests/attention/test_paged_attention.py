"""The reference paged attention equals dense scaled-dot-product attention on random ragged batches."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvpage.attention import AttentionMetadata, LayerKV, get_backend
from kvpage.attention.kv_quant import STORAGE, dequantize, quantize
from kvpage.attention.torch_ref import write_kv
from kvpage.ops import load


def dense_reference(q, k, v, scale):
    """Causal attention of one whole sequence, K/V repeated per query head: [n, heads, d]."""
    n, heads, _ = q.shape
    rep = heads // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


BACKENDS = ["torch", "cpu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("d", [32, 64, 128])  # head sizes of real models (SmolLM2: 64, Llama: 128) and a small one
def test_ragged_batch_of_decodes_and_prefills_matches_dense(heads, kv_heads, block_size, d, dtype, backend):
    g = torch.Generator().manual_seed(block_size * 100 + heads + d)
    rng = random.Random(block_size * 100 + heads)
    scale = d**-0.5
    # (total length, new tokens): 3 decodes of different contexts, a fresh prefill, two chunks with context
    shapes = [(1, 1), (37, 1), (9, 1), (23, 23), (40, 7), (18, 17)]
    num_blocks = sum(math.ceil(n / block_size) for n, _ in shapes) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered physical blocks
    k_cache = torch.zeros(num_blocks, kv_heads, block_size, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    full = []
    tables = []
    for n, _ in shapes:
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        k = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        full.append((q, k, v))
        tables.append([free.pop() for _ in range(math.ceil(n / block_size))])
    # the earlier tokens of each sequence are already in the cache
    for (n, new), (_, k, v), table in zip(shapes, full, tables, strict=True):
        for t in range(n - new):
            k_cache[table[t // block_size], :, t % block_size] = k[t]
            v_cache[table[t // block_size], :, t % block_size] = v[t]
    meta = AttentionMetadata.build([new for _, new in shapes], [n for n, _ in shapes], tables, block_size)
    q_in = torch.cat([q[n - new :] for (n, new), (q, _, _) in zip(shapes, full, strict=True)])
    k_in = torch.cat([k[n - new :] for (n, new), (_, k, _) in zip(shapes, full, strict=True)])
    v_in = torch.cat([v[n - new :] for (n, new), (_, _, v) in zip(shapes, full, strict=True)])
    out = get_backend(backend).forward(q_in, k_in, v_in, LayerKV(k_cache, v_cache), meta, scale)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 keeps 8 bits of mantissa
    start = 0
    for (n, new), (q, k, v) in zip(shapes, full, strict=True):
        expected = dense_reference(q.float(), k.float(), v.float(), scale)[n - new :]
        torch.testing.assert_close(out[start : start + new].float(), expected, atol=tol, rtol=tol)
        start += new
    # the new K/V were written where the slot mapping says
    for (n, _), (_, k, _), table in zip(shapes, full, tables, strict=True):
        t = n - 1
        torch.testing.assert_close(k_cache[table[t // block_size], :, t % block_size], k[t])


def test_metadata_rejects_decodes_after_prefills_and_short_tables():
    with pytest.raises(ValueError, match="decodes"):
        AttentionMetadata.build([3, 1], [3, 5], [[0], [1]], 4)
    with pytest.raises(ValueError, match="blocks"):
        AttentionMetadata.build([5], [5], [[0]], 4)
    meta = AttentionMetadata.build([1, 1, 3], [5, 2, 3], [[0, 1], [2], [3]], 4)
    assert meta.num_decodes == 2 and meta.query_start_loc == [0, 1, 2, 5]
    assert meta.slot_mapping.tolist() == [1 * 4 + 0, 2 * 4 + 1, 12, 13, 14]
    assert meta.block_tables.tolist() == [[0, 1], [2, 0], [3, 0]]


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'cuda-magic'"):
        get_backend("cuda-magic")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_decodes_of_different_lengths_are_grouped_correctly(dtype, backend):
    """More decodes than one group holds, in no particular order of length."""
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    heads, kv_heads, d, bs = 4, 2, 16, 4
    lens = [rng.randint(1, 60) for _ in range(75)]
    num_blocks = sum(math.ceil(n / bs) for n in lens)
    k_cache = torch.randn(num_blocks, kv_heads, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, bs, d, generator=g).to(dtype)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in lens:
        tables.append(ids[start : start + math.ceil(n / bs)])
        start += len(tables[-1])
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, bs)
    assert len(meta.decode_groups) == 3
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    # the new token's K/V are the ones already at its slot (write_kv stores them again)
    k_new = torch.stack([k_cache[t[(n - 1) // bs], :, (n - 1) % bs] for t, n in zip(tables, lens, strict=True)])
    v_new = torch.stack([v_cache[t[(n - 1) // bs], :, (n - 1) % bs] for t, n in zip(tables, lens, strict=True)])
    out = get_backend(backend).forward(q, k_new, v_new, LayerKV(k_cache, v_cache), meta, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        k = k_cache[t].transpose(1, 2).flatten(0, 1)[:n].float().repeat_interleave(2, dim=1)
        v = v_cache[t].transpose(1, 2).flatten(0, 1)[:n].float().repeat_interleave(2, dim=1)
        att = torch.einsum("hd,khd->hk", q[i].float(), k) * d**-0.5
        ref = torch.einsum("hk,khd->hd", att.softmax(-1), v)
        torch.testing.assert_close(out[i].float(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not load(), reason="no C++ compiler: the kernels cannot be built here")
@pytest.mark.parametrize("new", [1, 5, 16, 17])
def test_short_chunks_after_cached_context_run_in_place_as_decodes(new):
    """The kernel backend attends a chunk of up to 16 queries after cached context through the block
    table, one decode per query (no gather); a longer chunk or a fresh prompt goes to SDPA."""
    g = torch.Generator().manual_seed(new)
    heads, kv_heads, d, bs, n = 6, 2, 64, 4, 30
    table = list(range(8))[::-1]  # scattered in reverse
    k_cache = torch.randn(8, kv_heads, bs, d, generator=g)
    v_cache = torch.randn(8, kv_heads, bs, d, generator=g)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    for t in range(n):
        k_cache[table[t // bs], :, t % bs], v_cache[table[t // bs], :, t % bs] = k[t], v[t]
    meta = AttentionMetadata.build([new, n], [n, n], [table, table], bs)  # the chunk, then a fresh prompt
    q_in = torch.cat([q[n - new :], q])
    k_in, v_in = torch.cat([k[n - new :], k]), torch.cat([v[n - new :], v])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = get_backend("cpu").forward(q_in, k_in, v_in, LayerKV(k_cache, v_cache), meta, d**-0.5)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("kvpage::paged_decode_attention", 0) == (1 if new <= 16 else 0)
    assert calls.get("aten::scaled_dot_product_attention", 0) == (1 if new <= 16 else 2)
    expected = dense_reference(q, k, v, d**-0.5)
    torch.testing.assert_close(out[:new], expected[n - new :], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[new:], expected, atol=1e-5, rtol=1e-5)


def _prefill_kernel_runs(dtype) -> bool:
    if not load():
        return False
    probe = torch.zeros(1, 1, 64, dtype=dtype)
    return torch.ops.kvpage.paged_prefill_available(probe, torch.zeros(1, 1, 16, 64, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 32, 16), (8, 1, 64, 16)])
def test_prefill_chunks_run_the_prefill_kernel_and_match_dense(heads, kv_heads, d, bs, dtype):
    """Chunks of 16 queries or more, and fresh prompts: the prefill kernel (16 queries a task, partial tiles,
    keys masked per query) through scattered blocks, against dense attention (float32 on AVX-512 builds,
    bfloat16 with AVX512_BF16)."""
    if not _prefill_kernel_runs(dtype):
        pytest.skip(f"no prefill kernel for {dtype} in this build: its chunks take SDPA or decodes")
    g = torch.Generator().manual_seed(heads * d + bs)
    shapes = [(23, 23), (40, 40), (90, 33), (70, 16), (300, 17), (20, 5)]  # (length, new): the last as decodes
    num_blocks = sum(math.ceil(n / bs) for n, _ in shapes) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.zeros(num_blocks, kv_heads, bs, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    full, tables = [], []
    for n, new in shapes:
        q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        table = [free.pop() for _ in range(math.ceil(n / bs))]
        for t in range(n - new):
            k_cache[table[t // bs], :, t % bs], v_cache[table[t // bs], :, t % bs] = k[t], v[t]
        full.append((q, k, v))
        tables.append(table)
    meta = AttentionMetadata.build([new for _, new in shapes], [n for n, _ in shapes], tables, bs)
    new_rows = [slice(n - new, n) for n, new in shapes]
    q_in, k_in, v_in = (torch.cat([t[i][r] for r, t in zip(new_rows, full, strict=True)]) for i in (0, 1, 2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = get_backend("cpu").forward(q_in, k_in, v_in, LayerKV(k_cache, v_cache), meta, d**-0.5)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("kvpage::paged_prefill_attention", 0) == 5
    assert calls.get("kvpage::paged_decode_attention", 0) == 1 and "aten::scaled_dot_product_attention" not in calls
    start = 0
    for (n, new), (q, k, v) in zip(shapes, full, strict=True):
        expected = dense_reference(q.float(), k.float(), v.float(), d**-0.5)[n - new :]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[start : start + new].float(), expected, atol=tol, rtol=tol)
        start += new


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_cache_attends_to_exactly_its_dequantized_values(kind, backend):
    """Tokens are quantized as they are written (K and V, a scale per token and kv head) and
    dequantized as they are read; a prefill chunk with no earlier context attends its own fresh K/V."""
    if backend == "cpu" and not load():
        pytest.skip("no compiler for the CPU kernels")
    heads, kv_heads, bs, d = 6, 2, 4, 64
    g = torch.Generator().manual_seed(11)
    shapes = [(1, 1), (37, 1), (9, 1), (23, 23), (40, 7), (18, 5)]
    num_blocks = sum(math.ceil(n / bs) for n, _ in shapes) + 2
    kv = LayerKV.allocate((num_blocks, kv_heads, bs, d), torch.float32, kind, "cpu")
    free = list(range(num_blocks))[::-1]
    full, tables = [], []
    for n, _ in shapes:
        full.append(tuple(torch.randn(n, h, d, generator=g) * 3 for h in (heads, kv_heads, kv_heads)))
        tables.append([free.pop() for _ in range(math.ceil(n / bs))])
    for (n, new), (_, k, v), table in zip(shapes, full, tables, strict=True):
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n - new)], dtype=torch.int64)
        write_kv(k[: n - new], v[: n - new], kv, slots)
    meta = AttentionMetadata.build([new for _, new in shapes], [n for n, _ in shapes], tables, bs)
    q_in, k_in, v_in = (
        torch.cat([x[i][n - new :] for (n, new), x in zip(shapes, full, strict=True)]) for i in range(3)
    )
    out = get_backend(backend).forward(q_in, k_in, v_in, kv, meta, d**-0.5)
    start = 0
    for (n, new), (q, k, v) in zip(shapes, full, strict=True):
        if new == 1 or n != new:  # a decode, or a chunk after context: all read back from the quantized cache
            k, v = (dequantize(*quantize(x, kind), torch.float32) for x in (k, v))
        expected = dense_reference(q, k, v, d**-0.5)[n - new :]
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-5, rtol=1e-5)
        start += new
    assert kv.k.dtype == STORAGE[kind] and kv.k_scale.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_mass_per_block_is_the_softmax_each_block_received(backend):
    """H2O's scores: decodes and prefill chunks (with and without context) report, per block of the
    table, the softmax mass summed over heads and queries; the output stays the dense attention."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, bs = 4, 2, 16, 4
    shapes = [(9, 1), (13, 1), (6, 6), (15, 5)]  # 2 decodes, a fresh prefill, a chunk after context
    tables, next_block, full = [], 0, []
    num_blocks = sum(math.ceil(n / bs) for n, _ in shapes)
    k_cache = torch.zeros(num_blocks, kv_heads, bs, d)
    v_cache = torch.zeros_like(k_cache)
    for n, new in shapes:
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
        table = list(range(next_block, next_block + math.ceil(n / bs)))
        next_block += len(table)
        for t in range(n - new):
            k_cache[table[t // bs], :, t % bs], v_cache[table[t // bs], :, t % bs] = k[t], v[t]
        tables.append(table)
        full.append((q, k, v))
    meta = AttentionMetadata.build([new for _, new in shapes], [n for n, _ in shapes], tables, bs,
                                   want_mass=[True, False, True, True])  # fmt: skip
    assert meta.reads.mass is not None and meta.reads.mass.shape == (4, 4)
    q_in = torch.cat([q[n - new :] for (n, new), (q, _, _) in zip(shapes, full, strict=True)])
    k_in = torch.cat([k[n - new :] for (n, new), (_, k, _) in zip(shapes, full, strict=True)])
    v_in = torch.cat([v[n - new :] for (n, new), (_, _, v) in zip(shapes, full, strict=True)])
    out = get_backend(backend).forward(q_in, k_in, v_in, LayerKV(k_cache, v_cache), meta, d**-0.5)
    start = 0
    for i, ((n, new), (q, k, v)) in enumerate(zip(shapes, full, strict=True)):
        torch.testing.assert_close(out[start : start + new], dense_reference(q, k, v, d**-0.5)[n - new :],
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
        start += new
        if i == 1:
            continue  # a decode that did not ask: its row is whatever is cheapest
        kr = k.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kr) * d**-0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        per_token = scores.softmax(-1)[:, n - new :].sum((0, 1))  # [n]
        expected = torch.nn.functional.pad(per_token, (0, len(tables[i]) * bs - n)).view(-1, bs).sum(-1)
        torch.testing.assert_close(meta.reads.mass[i, : len(tables[i])], expected, atol=1e-5, rtol=1e-5)
        assert math.isclose(meta.reads.mass[i].sum().item(), heads * new, rel_tol=1e-5)
