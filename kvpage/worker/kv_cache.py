"""The physical KV cache: per layer, a `LayerKV` of every block, on the device and on the CPU.

Layout per layer: [num_blocks, num_kv_heads, block_size, head_dim] (head-major inside a block, so
one head's blocks gather into contiguous matrices; see attention/torch_ref.py). Token t of a
sequence is at cache[block_table[t // B], :, t % B, :]. Repeated K/V heads of grouped-query
attention are never stored: a cache holds num_kv_heads heads only.

With a quantized KV dtype ("int8", "fp8"; kvpage/worker/kv_quant.py) each layer also holds the
scales, [num_blocks, num_kv_heads, block_size] float32 for K and for V: they belong to the block,
so copy-on-write, swap and every other move of a block carry them with it, bit for bit.
"""

from __future__ import annotations

import torch

from kvpage.attention.layer_kv import LayerKV
from kvpage.core.kv_bytes import kv_bytes_per_block
from kvpage.models.config import ModelConfig


def kv_dtype_name(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The KV dtype a cache stores: the model's dtype for "auto", else the quantized one asked for."""
    if kv_cache_dtype == "auto":
        return str(dtype).removeprefix("torch.")
    return kv_cache_dtype


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        num_cpu_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        num_tier_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.kind = kv_cache_dtype
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        cpu_shape = (num_cpu_blocks, *shape[1:])
        self.layers = [LayerKV.allocate(shape, dtype, kv_cache_dtype, device) for _ in range(cfg.num_layers)]
        pin = torch.device(device).type == "cuda"
        self.cpu_layers = [
            LayerKV.allocate(cpu_shape, dtype, kv_cache_dtype, "cpu", pin) for _ in range(cfg.num_layers)
        ]
        tier_shape = (num_tier_blocks, *shape[1:])  # the CPU tier of the prefix cache
        self.tier_layers = [
            LayerKV.allocate(tier_shape, dtype, kv_cache_dtype, "cpu", pin) for _ in range(cfg.num_layers)
        ]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        name = kv_dtype_name(kv_cache_dtype, dtype)
        return kv_bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, name, block_size)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block src -> device block dst, every layer (scales included)."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.layers[0].k.device)
        for layer in self.layers:
            for t in layer.tensors():
                t.index_copy_(0, dst, t.index_select(0, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs."""
        self._transfer(self.layers, self.cpu_layers, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, device block) pairs."""
        self._transfer(self.cpu_layers, self.layers, pairs)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, tier block) pairs: evicted prefix blocks kept in the CPU tier."""
        self._transfer(self.layers, self.tier_layers, pairs)

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """(tier block, device block) pairs: CPU-tier prefix hits brought back."""
        self._transfer(self.tier_layers, self.layers, pairs)

    @staticmethod
    def _index(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
        return src, dst

    @classmethod
    def _transfer(cls, src_layers, dst_layers, pairs) -> None:
        if not pairs:
            return
        src, _ = cls._index(pairs, src_layers[0].k.device)
        _, dst = cls._index(pairs, dst_layers[0].k.device)
        for s_layer, d_layer in zip(src_layers, dst_layers, strict=True):
            for s, d in zip(s_layer.tensors(), d_layer.tensors(), strict=True):
                d.index_copy_(0, dst, s.index_select(0, src).to(d.device))
