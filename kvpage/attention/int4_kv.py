"""`Int4KV`: one layer's pool of blocks demoted to int4 (core/eviction: Demote), KIVI's layout.

Keys are quantized per channel over the block's tokens, values per token over head_dim, both
asymmetric (a float16 scale and minimum each; the levels are chosen against those rounded values):

    K: q[t, c] = round((k[t, c] - min_c) / scale_c), scale_c = (max_c - min_c) / 15, over the block's t
    V: q[t, c] = round((v[t, c] - min_t) / scale_t), scale_t = (max_t - min_t) / 15, over the token's c

Why this split (KIVI, arXiv 2402.02750): keys have outlier channels, values do not; benchmarks/
kv_quant_schemes.py measured int4 per token at +18% perplexity on SmolLM2 and this layout at +4.1%.
Per channel needs the whole block, which a demotion has: only full blocks are demoted. Two levels
share a byte (the even channel in the low nibble). Per block, layer and kv head: bs x d bytes of
values plus 2 x d (K) + 2 x bs (V) float16 parameters; for SmolLM2's 16 x 64 a third of bfloat16's.

    k, v:         [num_blocks, kv_heads, block_size, head_dim // 2] uint8
    k_scale/k_min [num_blocks, kv_heads, head_dim] float16;  v_scale/v_min [num_blocks, kv_heads, block_size]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = 15.0


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 -> (levels 0..15 uint8, float16 scale, float16 min), reduced over `dim`."""
    lo = x.amin(dim).half()
    scale = ((x.amax(dim) - lo.float()) / LEVELS).clamp_min(1e-6).half()
    q = torch.round((x - lo.float().unsqueeze(dim)) / scale.float().unsqueeze(dim)).clamp_(0, LEVELS)
    return q.to(torch.uint8), scale, lo


def _pack(q: torch.Tensor) -> torch.Tensor:
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack(p: torch.Tensor) -> torch.Tensor:
    return torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)


@dataclass(slots=True)
class Int4KV:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    k_min: torch.Tensor
    v_scale: torch.Tensor
    v_min: torch.Tensor

    @classmethod
    def allocate(cls, num_blocks: int, kv_heads: int, block_size: int, head_dim: int, device,
                 pin: bool = False) -> Int4KV:  # fmt: skip
        if head_dim % 2:
            raise ValueError(f"an int4 pool needs an even head_dim, got {head_dim}")

        def zeros(*shape, dtype=torch.float16):
            return torch.zeros(num_blocks, kv_heads, *shape, dtype=dtype, device=device, pin_memory=pin)

        half = head_dim // 2
        return cls(zeros(block_size, half, dtype=torch.uint8), zeros(block_size, half, dtype=torch.uint8),
                   zeros(head_dim), zeros(head_dim), zeros(block_size), zeros(block_size))  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.k_min, self.v_scale, self.v_min]

    def put(self, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Blocks `ids` = k, v (float32 [n, kv_heads, block_size, head_dim], every slot written; from
        any device: the CPU-tier rung's pool is in host memory)."""
        ids, k, v = (t.to(self.k.device) for t in (ids, k, v))
        qk, self.k_scale[ids], self.k_min[ids] = _quantize(k.float(), 2)  # per channel, over the tokens
        qv, self.v_scale[ids], self.v_min[ids] = _quantize(v.float(), 3)  # per token, over the channels
        self.k[ids], self.v[ids] = _pack(qk), _pack(qv)

    def dequantized(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks `ids`, float32 [n, kv_heads, block_size, head_dim], on the pool's device."""
        ids = ids.to(self.k.device)
        k = _unpack(self.k[ids]).float() * self.k_scale[ids].float()[:, :, None] + self.k_min[ids].float()[:, :, None]
        v = _unpack(self.v[ids]).float() * self.v_scale[ids].float()[..., None] + self.v_min[ids].float()[..., None]
        return k, v
