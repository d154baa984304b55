"""`LayerKV`: one layer's paged KV cache as the attention backends read and write it.

K and V of every block, [num_blocks, num_kv_heads, block_size, head_dim], and, when the KV dtype
is quantized (int8 / fp8, see kv_quant.py), their scales, [num_blocks, num_kv_heads, block_size]
float32: one per token and kv head. The scales are indexed by block like the values, so whatever
moves a block (copy-on-write, swap) moves them too. So are the key bounds of a layer that keeps them
(a read budget, key_bounds.py): k_min / k_max [num_blocks, kv_heads, head_dim] float32.

A layer of an engine whose eviction policy demotes blocks (core/eviction: Demote) also carries the
same layer of each lower precision's pool in `cold` ({"int8": LayerKV, "int4": Int4KV}), so the
attention backend reads a sequence's demoted blocks beside its table's (demoted.py).
Every store answers `put` (write whole blocks from float32) and `dequantized` (read them back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.attention.kv_quant import STORAGE, dequantize, quantize
from kvpage.core.kv_bytes import QUANTIZED_KV_DTYPES


@dataclass(slots=True)
class LayerKV:
    """One layer's cache: K and V of every block, and their scales when quantized."""

    k: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, kv_heads, block_size] float32, quantized only
    v_scale: torch.Tensor | None = None
    kv_dtype: str = "auto"  # "auto" (values in the compute dtype), "int8" or "fp8"
    # per block and kv head, the elementwise min and max of its keys ([num_blocks, kv_heads, head_dim]
    # float32), kept where a read budget may choose blocks by them (key_bounds.py); None elsewhere
    k_min: torch.Tensor | None = None
    k_max: torch.Tensor | None = None
    # the pools of demoted blocks of this layer, by precision (core/eviction: Demote); None: none
    cold: dict | None = None
    # the keys a query reads, its own included (a sliding-window layer, core/kv_spec.py); 0: all. In a
    # table's coordinates too: the blocks the window released are whole leading ones (layer_window.py)
    window: int = 0
    # Gemma 2's attention logit soft-capping: scores = softcap * tanh(scores / softcap), before the mask; 0: none
    softcap: float = 0.0
    # a chunked layer (Llama 4): a query reads the keys of its own chunk of this many tokens; 0: none
    chunk: int = 0
    # gpt-oss: each query head's sink ([num_heads]), a logit in its softmax that no value answers (the
    # layer's weight: the model's layer hands it to its view as it runs); None: none
    sinks: torch.Tensor | None = None

    @property
    def shaped(self) -> bool:
        """The layer shapes its scores (a window, a chunk, a soft cap, sinks): only the reference attention
        reads it."""
        return bool(self.window or self.chunk or self.softcap) or self.sinks is not None

    @property
    def reach(self) -> int:
        """The most keys a query reads (its window, or its chunk); 0: every earlier one."""
        return self.window or self.chunk

    @property
    def local(self) -> bool:
        """A query reads a local span of keys (a window or its chunk), not every earlier one."""
        return bool(self.reach)

    def first_key(self, pos: torch.Tensor) -> torch.Tensor:
        """The first key position a query at each of `pos` reads (core/kv_spec.py's first_visible)."""
        if self.window:
            return (pos - self.window + 1).clamp(min=0)
        if self.chunk:
            return torch.div(pos, self.chunk, rounding_mode="floor") * self.chunk
        return torch.zeros_like(pos)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def bounded(self) -> bool:
        return self.k_min is not None

    def keep_bounds(self) -> None:
        """Allocate the key bounds (zeroed: a block's are computed when it is written)."""
        n, heads, _, d = self.k.shape
        self.k_min = torch.zeros(n, heads, d, dtype=torch.float32, device=self.k.device)
        self.k_max = torch.zeros(n, heads, d, dtype=torch.float32, device=self.k.device)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block, as raw bytes where torch cannot copy the dtype itself."""
        out = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])
        out += [self.k_min, self.k_max] if self.bounded else []
        return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in out]

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at these slots (the reference layout), float32 [len(slots), kv_heads, head_dim]."""
        bs = self.k.shape[2]
        b, o = slots // bs, slots % bs
        k, v = self.k[b, :, o], self.v[b, :, o]
        if self.quantized:
            return (dequantize(k, self.k_scale[b, :, o], torch.float32),
                    dequantize(v, self.v_scale[b, :, o], torch.float32))  # fmt: skip
        return k.float(), v.float()

    def dequantized(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks `ids`, float32 [n, kv_heads, block_size, head_dim] (reference layout)."""
        k, v = self.k[ids], self.v[ids]
        if self.quantized:
            return dequantize(k, self.k_scale[ids], torch.float32), dequantize(v, self.v_scale[ids], torch.float32)
        return k.float(), v.float()

    def put(self, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Blocks `ids` = k, v (float32 [n, kv_heads, block_size, head_dim]), quantized if the layer is."""
        if self.quantized:
            (self.k[ids], self.k_scale[ids]), (self.v[ids], self.v_scale[ids]) = (
                quantize(k, self.kv_dtype), quantize(v, self.kv_dtype))  # fmt: skip
        else:
            self.k[ids], self.v[ids] = k.to(self.k.dtype), v.to(self.v.dtype)

    @classmethod
    def allocate(cls, shape: tuple[int, ...], dtype: torch.dtype, kv_dtype: str, device, pin: bool = False) -> LayerKV:
        def zeros(s, d):
            return torch.zeros(s, dtype=d, device=device, pin_memory=pin)

        if kv_dtype not in QUANTIZED_KV_DTYPES:
            return cls(zeros(shape, dtype), zeros(shape, dtype))
        store = STORAGE[kv_dtype]
        return cls(zeros(shape, store), zeros(shape, store), zeros(shape[:3], torch.float32),
                   zeros(shape[:3], torch.float32), kv_dtype)  # fmt: skip


def read_named_blocks(stores: dict, blocks: list[tuple[str, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of blocks named (store, block id) across several stores ({"hot": LayerKV, "int8": ...}),
    dequantized to float32 [len(blocks), kv_heads, block_size, head_dim] on `device`, in the order
    named; each store is read once."""
    k = v = None
    for name in dict.fromkeys(p for p, _ in blocks):
        rows = [j for j, (p, _) in enumerate(blocks) if p == name]
        store = stores[name]
        ks, vs = store.dequantized(torch.tensor([blocks[j][1] for j in rows], dtype=torch.int64, device=store.k.device))
        if k is None:
            k = torch.empty(len(blocks), *ks.shape[1:], device=device)
            v = torch.empty_like(k)
        k[rows], v[rows] = ks.to(device), vs.to(device)
    return k, v  # type: ignore[return-value]
