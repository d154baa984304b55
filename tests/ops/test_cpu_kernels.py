"""kvpage's compiled CPU kernels equal the torch reference ops they replace, op by op."""

from __future__ import annotations

import pytest
import torch

from kvpage.models.layer_ops import UNLIMITED, KernelLayerOps, LinearPolicy, TorchLayerOps
from kvpage.ops import load

pytestmark = pytest.mark.skipif(not load(), reason="no C++ compiler: the kernels cannot be built here")

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture
def ops():
    return TorchLayerOps(), KernelLayerOps(LinearPolicy.always_kernel())  # the kernels at any row count


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms(ops, dtype):
    ref, ker = ops
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    delta = torch.randn(7, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    torch.testing.assert_close(ker.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **tol(dtype))
    rx, rh = ref.add_rms_norm(x.clone(), delta, w, 1e-5)
    kx_in = x.clone()
    kx, kh = ker.add_rms_norm(kx_in, delta, w, 1e-5)
    assert kx is kx_in  # the residual stream is updated in place
    torch.testing.assert_close(kx, rx, atol=0, rtol=0)  # one rounded add, as torch's
    torch.testing.assert_close(kh, rh, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_silu(ops, dtype):
    ref, ker = ops
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, t = 6, 2, 32, 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    freqs = torch.arange(t).float()[:, None] * torch.rand(d // 2, generator=g)[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected = ref.qkv_rope(qkv.clone(), cos, sin, heads, kv_heads, d)
    got = ker.qkv_rope(qkv.clone(), cos, sin, heads, kv_heads, d)
    for e, o in zip(expected, got, strict=True):
        assert e.shape == o.shape
        torch.testing.assert_close(o, e, **tol(dtype))
    gu = (torch.randn(t, 2 * 40, generator=g) * 4).to(dtype)
    torch.testing.assert_close(ker.silu_mul(gu), ref.silu_mul(gu), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 17])
@pytest.mark.parametrize("k", [64, 100])  # 100: not a multiple of the vector width
def test_linear(ops, dtype, rows, k):
    ref, ker = ops
    g = torch.Generator().manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(131, k, generator=g).to(dtype)  # 131 outputs: not a multiple of the row tile
    b = torch.randn(131, generator=g).to(dtype)
    t = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.25, "rtol": 2e-2}
    torch.testing.assert_close(ker.linear(x, w), ref.linear(x, w), **t)
    torch.testing.assert_close(ker.linear(x, w, b), ref.linear(x, w, b), **t)
    # a strided view of rows (as the logits' rows picked out of the hidden states)
    wide = torch.randn(rows, 2 * k, generator=g).to(dtype)[:, :k]
    torch.testing.assert_close(ker.linear(wide, w), ref.linear(wide, w), **t)


def test_linear_policy_follows_the_cpu():
    f32, bf16 = torch.float32, torch.bfloat16
    avx2 = LinearPolicy.for_cpu({"avx2", "fma"})
    assert avx2.plain == {f32: 64, bf16: UNLIMITED} and avx2.quantized == {f32: 64, bf16: UNLIMITED}
    avx512 = LinearPolicy.for_cpu({"avx2", "avx512f"})  # torch's float32 GEMM is 16 wide; bf16 still emulated
    assert avx512.plain == {f32: 0, bf16: UNLIMITED} and avx512.quantized == {f32: 16, bf16: UNLIMITED}
    amx = LinearPolicy.for_cpu({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert amx.plain == {f32: 0, bf16: 3} and amx.quantized == {f32: 16, bf16: 16}  # (benchmarks/linear_policy.py)
    zen = LinearPolicy.for_cpu({"avx2", "fma", "avx512f", "avx512_bf16"})  # torch's float32 GEMM is slow there
    assert zen.plain == {f32: 128, bf16: 24} and zen.quantized == {f32: 16, bf16: 16}


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_dispatch_follows_the_policy(dtype):
    """Rows up to the limit run the kernel, more rows torch's GEMM; both give the reference's values."""
    ker = KernelLayerOps(LinearPolicy(plain={dtype: 3}, quantized={dtype: 3}))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 32, generator=g).to(dtype)
    t = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.25, "rtol": 2e-2}
    for rows, kernel_calls in ((1, 1), (3, 1), (4, 0), (9, 0)):
        x = torch.randn(rows, 32, generator=g).to(dtype)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = ker.linear(x, w)
        assert sum(e.count for e in prof.key_averages() if e.key == "kvpage::linear_rows") == kernel_calls
        torch.testing.assert_close(out, TorchLayerOps().linear(x, w), **t)


def test_kernels_reject_bad_input_by_name():
    k = torch.ops.kvpage
    cache = torch.zeros(4, 2, 4, 8)
    with pytest.raises(RuntimeError, match="k_cache and v_cache differ"):
        k.write_kv(
            torch.zeros(1, 2, 8),
            torch.zeros(1, 2, 8),
            cache,
            torch.zeros(4, 2, 4, 16),
            torch.zeros(1, dtype=torch.long),
        )
    with pytest.raises(RuntimeError, match="out of range"):
        k.write_kv(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), cache, cache.clone(), torch.tensor([16]))
    q = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        k.paged_decode_attention(
            q.clone(), q, cache, cache.clone(), torch.zeros(1, 1, dtype=torch.long), torch.tensor([5]), 1.0
        )
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        k.silu_mul(torch.zeros(2, 4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_write_stores_the_same_bytes_as_the_reference(dtype):
    from kvpage.attention import LayerKV
    from kvpage.attention.torch_ref import write_kv

    g = torch.Generator().manual_seed(4)
    k = (torch.randn(9, 3, 64, generator=g) * torch.logspace(-2, 2, 9)[:, None, None]).to(dtype)
    v = torch.randn(9, 3, 64, generator=g).to(dtype)
    k[2, 1] = 0.0  # an all-zero row: the smallest scale, zeros stored
    slots = torch.tensor([0, 5, 9, 13, 17, 18, 30, 31, 2])
    ours, ref = (LayerKV.allocate((8, 3, 4, 64), dtype, "int8", "cpu") for _ in range(2))
    torch.ops.kvpage.write_kv_int8(k, v, ours.k, ours.v, ours.k_scale, ours.v_scale, slots)
    write_kv(k, v, ref, slots)
    for a, b in zip(ours.tensors(), ref.tensors(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        torch.ops.kvpage.write_kv_int8(k, v, ours.k, ours.v, ours.k_scale.double(), ours.v_scale, slots)
    with pytest.raises(RuntimeError, match="an int8 cache must be int8"):
        torch.ops.kvpage.write_kv_int8(k, v, ours.k.float(), ours.v.float(), ours.k_scale, ours.v_scale, slots)


def test_the_cpu_backend_reads_int8_in_place_and_fp8_on_the_reference_path():
    from kvpage.attention import AttentionMetadata, LayerKV, get_backend

    g = torch.Generator().manual_seed(5)
    backend = get_backend("cpu")
    for kind, kernel_calls in (("int8", 1), ("fp8", 0)):
        kv = LayerKV.allocate((6, 2, 4, 32), torch.float32, kind, "cpu")
        q, k, v = (
            torch.randn(2, 4, 32, generator=g),
            torch.randn(2, 2, 32, generator=g),
            torch.randn(2, 2, 32, generator=g),
        )
        meta = AttentionMetadata.build([1, 1], [3, 9], [[0], [1, 2, 3]], 4)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = backend.forward(q, k, v, kv, meta, 32**-0.5)
        calls = {e.key: e.count for e in prof.key_averages()}
        assert calls.get("kvpage::paged_decode_attention_int8", 0) == kernel_calls, kind
        assert calls.get("kvpage::write_kv_int8", 0) == kernel_calls, kind
        ref = get_backend("torch").forward(q, k, v, LayerKV.allocate((6, 2, 4, 32), torch.float32, kind, "cpu"),
                                           meta, 32**-0.5)  # fmt: skip
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
