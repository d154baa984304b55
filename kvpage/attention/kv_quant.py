"""Quantized KV values: int8 and fp8 (float8_e4m3fn), each with a float32 scale per token and kv head.

    int8: scale = max|x| / 127 over the token's head_dim values; q = round(x / scale), in [-127, 127]
    fp8:  scale = max|x| / 448 (e4m3's largest finite value); q = float8_e4m3fn(x / scale)
    x ~= q * scale, dequantized inside attention in float32, then cast to the compute dtype

Why per token (and kv head) rather than per block: a block fills one token per decode step, so a
per-block scale is unknown until the block is full (or needs every earlier token re-quantized when
a larger value arrives); a per-token scale is final when the token is written, never changes, and
follows outlier tokens (attention sinks have keys far larger than the rest). It costs 4 bytes per
64-value head (6%). Measured on SmolLM2 (benchmarks/kv_dtypes.py, RESULTS.md).

The alternatives, measured by fake quantization on the same 8,192 tokens (benchmarks/
kv_quant_schemes.py; perplexity change against the float32 cache): int8 per token +0.07%, per
token with float16 scales +0.03%, per block and head +0.12% (6% fewer bytes, but it needs the
whole block before its scale is known), K per channel per block as KIVI does +0.02% (9% more
bytes); fp8 per token +0.53%, per block +0.68%. At 8 bits the granularity hardly matters and per
token is the only one that works for decode. At 4 bits it does: int4 per token +18%, with K per
channel per block (KIVI) +4.1% -- the layout to use if an int4 cache is ever added.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values [..., head_dim] of the storage dtype, scales [...] float32)."""
    xf = x.float()
    amax = xf.abs().amax(-1).clamp_min(1e-12)
    if kind == "int8":
        scale = amax / INT8_MAX
        q = torch.round(xf / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif kind == "fp8":
        scale = amax / FP8_MAX
        q = (xf / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"unknown quantized KV dtype {kind!r}")
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., head_dim], scales [...]) -> [..., head_dim] in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)
