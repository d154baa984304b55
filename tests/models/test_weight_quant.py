"""Weight-only quantization: the schemes, the kernel against the reference, the real model."""

from __future__ import annotations

import pytest
import torch

from kvpage.config import EngineConfig
from kvpage.models.layer_ops import UNLIMITED, KernelLayerOps, LinearPolicy, TorchLayerOps
from kvpage.models.weight_quant import QuantizedWeight, quantize
from kvpage.ops import KERNEL_DTYPES, load


def test_int8_and_int4_errors_are_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    for bits, levels in ((8, None), (4, 15)):
        qw = quantize(w, bits)
        assert qw.shape == (48, 96) and qw.scales.shape == (48, 3)
        step = qw.scales.repeat_interleave(32, dim=1)
        assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-6).all()
        assert qw.nbytes == w.numel() * (1.0625 if bits == 8 else 0.625)  # float16 scales (and mins)
        if levels:
            assert qw.q.dtype == torch.uint8 and qw.q.shape == (48, 48)


def test_int4_gives_back_values_already_on_a_q4_1_grid():
    """A GGUF's Q4_1 tensor, de-quantized, is quantized to int4 without loss (same groups, same levels)."""
    g = torch.Generator().manual_seed(1)
    d = (torch.rand(8, 4, generator=g) * 0.1 + 0.01).half().float()  # Q4_1 stores d and min in float16
    lo = torch.randn(8, 4, generator=g).half().float()
    levels = torch.randint(0, 16, (8, 4, 32), generator=g)
    levels[..., 0], levels[..., 1] = 0, 15  # every group uses its lowest and highest level, as Q4_1's do
    w = (levels * d[..., None] + lo[..., None]).reshape(8, 128)
    torch.testing.assert_close(quantize(w, 4).dequantize(), w, atol=1e-6, rtol=0)
    zero = quantize(torch.zeros(2, 32), 4)  # a constant group has no step: no division by zero
    assert torch.equal(zero.dequantize(), torch.zeros(2, 32))


def test_quantize_refuses_what_it_cannot_group():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.zeros(4, 40), 8)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize(torch.zeros(4, 32), 2)
    with pytest.raises(ValueError, match="weight_dtype must be int8, int4"):
        EngineConfig(model="smollm2", weight_dtype="int3")


@pytest.mark.skipif(not load(), reason="no C++ compiler: the kernels cannot be built here")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 70])
@pytest.mark.parametrize("limit", [UNLIMITED, 0])  # the kernel at any row count; dequantize + GEMM always
def test_kernel_equals_the_reference(bits, dtype, rows, limit):
    g = torch.Generator().manual_seed(rows + bits)
    qw = quantize(torch.randn(75, 64, generator=g), bits)
    assert isinstance(qw, QuantizedWeight)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    bias = torch.randn(75, generator=g).to(dtype)
    ref = TorchLayerOps()
    rows_limit = dict.fromkeys(KERNEL_DTYPES, limit)
    ker = KernelLayerOps(LinearPolicy(plain=rows_limit, quantized=dict(rows_limit)))
    t = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    for b in (None, bias):
        out = ker.linear(x, qw, b)
        assert out.shape == (rows, 75) and out.dtype == dtype
        torch.testing.assert_close(out, ref.linear(x, qw, b), **t)


def test_a_tied_embedding_is_looked_up_in_the_quantized_head_and_the_table_goes():
    from kvpage.models import ModelConfig, load_model
    from kvpage.models.weight_quant import QuantizedEmbedding, quantize_model

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=32, tie_word_embeddings=True)  # fmt: skip
    model = load_model(cfg, dtype="bfloat16", backend="torch").model
    table = model.embed_tokens.weight.clone()
    quantize_model(model, "int4")
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert not any(p.shape == table.shape for p in model.parameters())  # the unquantized table is gone
    ids = torch.tensor([[0, 5, 96], [5, 5, 1]])
    x = model.embed_tokens(ids)
    assert x.shape == (2, 3, 64) and x.dtype == torch.bfloat16
    assert torch.equal(x, model.head_weight.dequantize()[ids].to(torch.bfloat16))  # the head's own rows
    torch.testing.assert_close(x, table[ids], atol=0.02, rtol=0.02)  # within int8's step of the original
    assert model.dtype == torch.bfloat16


def test_bfloat16_gemm_rows_come_in_few_sizes_and_pad_little():
    from kvpage.models.layer_ops import gemm_rows

    sizes = {gemm_rows(r) for r in range(1, 4097)}
    assert len(sizes) <= 48  # oneDNN keeps a primitive per size: a bounded number of them
    for r in range(1, 4097):
        p = gemm_rows(r)
        assert p >= r and p % 16 == 0
        assert r <= 128 or (p - r) * 8 <= r


@pytest.mark.skipif(not load(), reason="no C++ compiler: the kernels cannot be built here")
@pytest.mark.parametrize("rows", [5, 37, 129, 300])
def test_a_padded_bfloat16_gemm_gives_each_row_its_own_result(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    ker = KernelLayerOps(LinearPolicy(plain=dict.fromkeys(KERNEL_DTYPES, 0), quantized=dict.fromkeys(KERNEL_DTYPES, 0)))
    out = ker.linear(x, w, bias)
    assert out.shape == (rows, 48) and out.is_contiguous()
    ref = x.float() @ w.float().T + bias.float()
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("tied", [True, False])
def test_the_estimate_counts_the_weights_kvpage_holds_byte_for_byte(tied):
    from kvpage.models import ModelConfig, load_model
    from kvpage.models.weight_quant import quantize_model
    from kvpage.tools.kv_estimate import KVShape, ModelDims

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=tied)  # fmt: skip
    shape = KVShape("dummy", 2, 2, 16, ModelDims(64, 96, 97, 4, tied))
    model = load_model(cfg, dtype="bfloat16", backend="torch").model
    assert shape.weight_bytes("bfloat16") == sum(p.numel() * p.element_size() for p in model.parameters())
    assert shape.params() == sum(p.numel() for p in model.parameters())
    for wd in ("int8", "int4"):
        m = load_model(cfg, dtype="bfloat16", backend="torch").model
        quantize_model(m, wd)
        held = sum(p.numel() * p.element_size() for p in m.parameters()) + m.head_weight.nbytes  # (lm_head: the same)
        linears = [(x.self_attn.qkv_proj, x.self_attn.o_proj, x.mlp.gate_up_proj, x.mlp.down_proj) for x in m.layers]
        held += sum(lin.weight.nbytes for layer in linears for lin in layer)
        assert shape.weight_bytes(wd) == held, wd
