"""int8 / fp8 KV values: per token and kv head, the error bounded by the format's step."""

from __future__ import annotations

import pytest
import torch

from kvpage.attention.kv_quant import FP8_MAX, INT8_MAX, dequantize, quantize


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantization_error_is_bounded_per_token_and_head(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]  # scales far apart
    x[7, 1, 5] = 900.0  # an outlier only moves its own token's scale
    q, s = quantize(x, kind)
    assert s.shape == (50, 3) and s.dtype == torch.float32
    back = dequantize(q, s, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    err = (back - x).abs()
    if kind == "int8":
        assert q.dtype == torch.int8 and int(q.abs().max()) <= INT8_MAX
        assert bool((err <= amax / INT8_MAX / 2 * 1.0001).all())  # half a step of max|x| / 127
    else:
        assert q.dtype == torch.float8_e4m3fn and float(q.float().abs().max()) <= FP8_MAX
        assert bool((err <= x.abs() / 16 + amax / FP8_MAX * 2**-9).all())  # 3 mantissa bits, subnormals
    others = torch.ones(50, 3, dtype=torch.bool)
    others[7, 1] = False
    assert float((err[others] / amax.expand_as(x)[others]).max()) < 0.07


def test_bfloat16_values_dequantize_to_bfloat16():
    x = torch.randn(4, 2, 8).to(torch.bfloat16)
    assert dequantize(*quantize(x, "int8"), torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown quantized KV dtype"):
        quantize(x, "int4")
