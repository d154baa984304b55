"""The physical KV cache: per layer, K and V tensors of every block, on the device and on the CPU.

Layout per layer: [num_blocks, num_kv_heads, block_size, head_dim] (head-major inside a block, so
one head's blocks gather into contiguous matrices; see attention/torch_ref.py). Token t of a
sequence is at cache[block_table[t // B], :, t % B, :]. Repeated K/V heads of grouped-query
attention are never stored: a cache holds num_kv_heads heads only.
"""

from __future__ import annotations

import torch

from kvpage.models.config import ModelConfig


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        num_cpu_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        cpu_shape = (num_cpu_blocks, *shape[1:])
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        pin = torch.device(device).type == "cuda"
        self.cpu_layers = [
            (torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin), torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin))
            for _ in range(cfg.num_layers)
        ]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block src -> device block dst, every layer."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.layers[0][0].device)
        for k, v in self.layers:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs."""
        self._transfer(self.layers, self.cpu_layers, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, device block) pairs."""
        self._transfer(self.cpu_layers, self.layers, pairs)

    @staticmethod
    def _index(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
        return src, dst

    @classmethod
    def _transfer(cls, src_layers, dst_layers, pairs) -> None:
        if not pairs:
            return
        src, _ = cls._index(pairs, src_layers[0][0].device)
        _, dst = cls._index(pairs, dst_layers[0][0].device)
        for (sk, sv), (dk, dv) in zip(src_layers, dst_layers, strict=True):
            dk.index_copy_(0, dst, sk.index_select(0, src).to(dk.device))
            dv.index_copy_(0, dst, sv.index_select(0, src).to(dv.device))
