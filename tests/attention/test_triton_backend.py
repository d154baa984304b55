"""The `triton` backend's kernels against the reference backend and dense attention.

Without a GPU they run under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton), on small shapes: ragged batches of decodes and
prefill chunks, block sizes 1 / 16 / 32 and one that is not a power of two, GQA and MHA, contexts
not a multiple of the block size, shared blocks, prefix hits, float32 and bfloat16, int8 caches,
and decodes split along the context (flash-decoding) as well as whole."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvpage.attention import AttentionMetadata, LayerKV, get_backend
from kvpage.attention.kv_quant import dequantize, quantize
from kvpage.attention.torch_ref import write_kv

triton = pytest.importorskip("triton", reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def dense(q, k, v, scale):
    """Causal attention of one whole sequence, float32: [n, heads, d]."""
    n, heads, _ = q.shape
    rep = heads // k.shape[1]
    k, v = k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def ragged(shapes, heads, kv_heads, d, block_size, dtype, seed, shared_prefix=0, kind="auto"):
    """A cache holding each sequence's earlier tokens and the step's new ones as inputs; with
    shared_prefix, every sequence's first shared_prefix // block_size blocks are the same blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    shared_blocks = shared_prefix // block_size
    num_blocks = sum(math.ceil(n / block_size) for n, _ in shapes) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    common = [free.pop() for _ in range(shared_blocks)]
    prefix = [torch.randn(shared_prefix, h, d, generator=g) for h in (heads, kv_heads, kv_heads)]
    kv = LayerKV.allocate((num_blocks, kv_heads, block_size, d), dtype, kind, DEVICE)
    full, tables = [], []
    for n, new in shapes:
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
        if shared_prefix:
            k[:shared_prefix], v[:shared_prefix] = prefix[1], prefix[2]
        table = common + [free.pop() for _ in range(math.ceil(n / block_size) - shared_blocks)]
        full.append(tuple(x.to(dtype).to(DEVICE) for x in (q, k, v)))
        tables.append(table)
        done = n - new
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(done)],
                             dtype=torch.int64, device=DEVICE)  # fmt: skip
        write_kv(full[-1][1][:done], full[-1][2][:done], kv, slots)
    meta = AttentionMetadata.build([new for _, new in shapes], [n for n, _ in shapes], tables, block_size, DEVICE)
    inputs = [torch.cat([x[i][n - new :] for (n, new), x in zip(shapes, full, strict=True)]) for i in range(3)]
    return kv, meta, inputs, full


def expected_of(shapes, full, scale, kind):
    out = []
    for (n, new), (q, k, v) in zip(shapes, full, strict=True):
        if kind != "auto" and (new == 1 or n != new):  # read back from the quantized cache
            k, v = (dequantize(*quantize(x, kind), torch.float32) for x in (k, v))
        out.append(dense(q, k, v, scale)[n - new :])
    return torch.cat(out)


TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# (total length, new tokens): decodes of several contexts, a fresh prefill, chunks after context
SHAPES = [(1, 1), (37, 1), (70, 1), (23, 23), (40, 7), (35, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32, 12])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_ragged_batch_matches_dense_and_the_reference(heads, kv_heads, block_size, dtype):
    d, scale = 32, 32**-0.5
    kv, meta, (q, k, v), full = ragged(SHAPES, heads, kv_heads, d, block_size, dtype, seed=block_size + heads)
    ref_kv = LayerKV(kv.k.clone(), kv.v.clone())
    out = get_backend("triton", DEVICE).forward(q, k, v, kv, meta, scale)
    ref = get_backend("torch").forward(q.cpu(), k.cpu(), v.cpu(), LayerKV(ref_kv.k.cpu(), ref_kv.v.cpu()),
                                       _on_cpu(meta), scale)  # fmt: skip
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float().cpu(), expected_of(SHAPES, full, scale, "auto").cpu(),
                               atol=TOL[dtype], rtol=TOL[dtype])  # fmt: skip
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # the new K/V went where the slot mapping says, bit for bit
    for (n, new), (_, kk, vv), table in zip(SHAPES, full, meta.block_tables.tolist(), strict=True):
        for t in range(n - new, n):
            assert torch.equal(kv.k[table[t // block_size], :, t % block_size], kk[t])
            assert torch.equal(kv.v[table[t // block_size], :, t % block_size], vv[t])


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_decodes_split_along_the_context_equal_whole(splits):
    """Flash-decoding: the context cut into splits (some of them past a short sequence's end) and
    merged gives the same attention as one pass; MQA (one kv head for 8 query heads), head size 64."""
    shapes = [(300, 1), (5, 1), (129, 1)]
    kv, meta, (q, k, v), full = ragged(shapes, 8, 1, 64, 16, torch.float32, seed=splits)
    backend = get_backend("triton", DEVICE)
    backend.splits = splits
    out = backend.forward(q, k, v, kv, meta, 0.125)
    torch.testing.assert_close(out.cpu(), expected_of(shapes, full, 0.125, "auto").cpu(), atol=2e-5, rtol=2e-5)


def test_the_backend_splits_only_long_contexts_of_few_sequences():
    choose = get_backend("triton", DEVICE)._choose_splits
    assert choose(programs=2, longest=300) == 1  # short: one pass
    assert choose(programs=2, longest=8192) == 16  # few and long: 512 keys a split
    assert choose(programs=256, longest=8192) == 1  # enough programs already


def test_shared_blocks_and_a_prefix_hit():
    """Three sequences on the same 32 prefix blocks (refcounted sharing): two decode, one is the tail
    of a prompt whose prefix hit the cache (a chunk after 32 cached tokens)."""
    shapes = [(45, 1), (33, 1), (50, 18)]
    kv, meta, (q, k, v), full = ragged(shapes, 4, 2, 32, 16, torch.float32, seed=5, shared_prefix=32)
    tables = meta.block_tables.tolist()
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    out = get_backend("triton", DEVICE).forward(q, k, v, kv, meta, 32**-0.5)
    torch.testing.assert_close(out.cpu(), expected_of(shapes, full, 32**-0.5, "auto").cpu(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_an_int8_cache_is_written_as_the_reference_writes_it_and_read_back(dtype):
    """int8 K/V: the kernel writes the same bytes and scales as kv_quant.py, and attends to exactly
    the dequantized values (a chunk without context to its own K/V as computed)."""
    shapes = [(1, 1), (37, 1), (23, 23), (40, 7)]
    kv, meta, (q, k, v), full = ragged(shapes, 6, 2, 32, 4, dtype, seed=3, kind="int8")
    ref = LayerKV(kv.k.clone(), kv.v.clone(), kv.k_scale.clone(), kv.v_scale.clone(), "int8")
    out = get_backend("triton", DEVICE).forward(q, k, v, kv, meta, 32**-0.5)
    write_kv(k, v, ref, meta.slot_mapping)
    assert torch.equal(kv.k, ref.k) and torch.equal(kv.v, ref.v)
    assert torch.equal(kv.k_scale, ref.k_scale) and torch.equal(kv.v_scale, ref.v_scale)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), expected_of(shapes, full, 32**-0.5, "int8").cpu(), atol=tol, rtol=tol)


def test_fp8_caches_and_attention_mass_take_the_reference_path():
    shapes = [(9, 1), (12, 4)]
    kv, meta, (q, k, v), full = ragged(shapes, 4, 2, 16, 4, torch.float32, seed=1, kind="fp8")
    out = get_backend("triton", DEVICE).forward(q, k, v, kv, meta, 0.25)
    torch.testing.assert_close(out.cpu(), expected_of(shapes, full, 0.25, "fp8").cpu(), atol=1e-5, rtol=1e-5)


def test_off_cuda_without_the_interpreter_it_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")


def _on_cpu(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata.build(
        [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in range(meta.num_seqs)],
        meta.seq_lens_list,
        [
            row[: -(-n // meta.block_size)]
            for row, n in zip(meta.block_tables.tolist(), meta.seq_lens_list, strict=True)
        ],
        meta.block_size,
    )
