"""Weight-only quantization of the linear layers: `weight_dtype="int8"` or `"int4"`.

Groups of 32 weights along each output row share a float16 scale, llama.cpp's schemes:
    int8  w = d * q,        q in -127..127, d = max|w| / 127      1.0625 bytes per weight
    int4  w = d * q + min,  q in 0..15,     d = (max - min) / 15   0.625 bytes per weight
(d and min in float16 as llama.cpp's Q8_0 and Q4_1 store them; the levels are chosen against the
rounded d and min.)
Activations stay in the model's dtype; the kernel (kvpage/ops, `linear_quant`) widens the weights
to float32 in cache and multiplies, so at small batches the step reads a quarter (int8) or a sixth
(int4) of float32's bytes. A GGUF whose tensors are Q4_1 (SmolLM2's) quantized to int4 here gets
its own values back: the group boundaries are the same and each group's min and max are levels 0 and 15.
The output projection is quantized to int8 under both, as llama.cpp's 4-bit files keep it at 6-8 bits
(SmolLM2's GGUF: Q8_0, which int8 reproduces). Where it is the tied embedding, lookups read the same
int8 rows (as llama.cpp's do), and the unquantized table goes: 57 MB less for SmolLM2 in bfloat16.
An untied model's embedding stays unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.errors import ParameterError

GROUP = 32
WEIGHT_DTYPES = ("int8", "int4")


@dataclass(slots=True)
class QuantizedWeight:
    bits: int
    q: torch.Tensor  # int8 [out, in] or uint8 [out, in / 2] (two 4-bit values per byte)
    scales: torch.Tensor  # float16 [out, in / 32]
    mins: torch.Tensor | None  # float16 [out, in / 32] for int4
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        out, k = self.shape
        d = self.scales[:, :, None].float()
        if self.bits == 8:
            return (self.q.view(out, k // GROUP, GROUP).float() * d).view(out, k)
        packed = self.q.view(out, k // GROUP, GROUP // 2)
        levels = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # low nibbles first
        return (levels * d + self.mins[:, :, None].float()).view(out, k)

    def rows(self, ids: torch.Tensor) -> QuantizedWeight:
        """The rows `ids` (a lookup in a quantized embedding table)."""
        mins = None if self.mins is None else self.mins[ids]
        return QuantizedWeight(self.bits, self.q[ids], self.scales[ids], mins, (ids.numel(), self.shape[1]))


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table read from quantized rows, widened to `dtype` per lookup."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1)).dequantize().to(self.dtype).view(*ids.shape, -1)


def quantize(w: torch.Tensor, bits: int) -> QuantizedWeight:
    out, k = w.shape
    if k % GROUP:
        raise ValueError(f"weight-only quantization needs input sizes divisible by {GROUP}, got {k}")
    g = w.detach().float().reshape(out, k // GROUP, GROUP)
    if bits == 8:
        d16 = _half(g.abs().amax(-1) / 127)
        d = d16.float()
        q = torch.where(d[..., None] > 0, g / d[..., None].clamp_min(1e-30), 0).round().clamp(-127, 127)
        return QuantizedWeight(8, q.to(torch.int8).reshape(out, k).contiguous(), d16.contiguous(), None, (out, k))
    if bits == 4:
        lo16 = _half(g.amin(-1))
        lo = lo16.float()
        d16 = _half((g.amax(-1) - lo) / 15)
        d = d16.float()
        q = torch.where(d[..., None] > 0, (g - lo[..., None]) / d[..., None].clamp_min(1e-30), 0).round().clamp(0, 15)
        q = q.to(torch.uint8)
        packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
        return QuantizedWeight(4, packed.reshape(out, k // 2).contiguous(), d16.contiguous(), lo16.contiguous(),
                               (out, k))  # fmt: skip
    raise ValueError(f"bits must be 8 or 4, got {bits}")


def _half(x: torch.Tensor) -> torch.Tensor:
    """float16, its largest finite value where x lies beyond (a weight group that large is not a model's)."""
    top = torch.finfo(torch.float16).max
    return x.clamp(-top, top).half()


def bits_of(weight_dtype: str) -> int:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES} or None, got {weight_dtype!r}")
    return 8 if weight_dtype == "int8" else 4


@torch.no_grad()
def quantize_model(model, weight_dtype: str) -> int:
    """Replace every linear layer's weight (and the output projection) by its quantized form, in
    place; returns the bytes the linear weights now take."""
    bits = bits_of(weight_dtype)
    if model.config.moe is not None:
        raise ParameterError("weight_dtype", f"weight_dtype={weight_dtype!r} does not go with a mixture of experts "
                             "yet (its experts' weights are stacked tensors, not linear layers)")  # fmt: skip
    if model.config.mamba is not None:
        raise ParameterError("weight_dtype", f"weight_dtype={weight_dtype!r} does not go with state-space layers "
                             "yet (their mixers are not quantized)")  # fmt: skip
    total = 0
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            qw = quantize(lin.weight, bits)
            del lin.weight  # the parameter goes; the module keeps the quantized weight as a plain attribute
            lin.weight = qw
            total += qw.nbytes
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.head_weight = quantize(head, 8)  # the logits are the most sensitive: 8 bits under int4 too
    total += model.head_weight.nbytes
    if model.lm_head is None:  # tied: look tokens up in the quantized rows, and drop the table
        model.embed_tokens = QuantizedEmbedding(model.head_weight, head.dtype)
    else:  # untied: the unquantized projection goes as the linears' weights do
        del model.lm_head.weight
        model.lm_head.weight = model.head_weight
    return total
