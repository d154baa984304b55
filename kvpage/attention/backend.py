"""The attention backend interface. A backend writes the new K/V into the paged cache and attends.

Backends are chosen by name and imported lazily, so a GPU kernel can be added (and its toolchain
imported) without the reference backend or the model changing.

The cache a backend is given is one layer's K (or V) of every block, head-major inside a block
(the layout kvpage/worker/kv_cache.py allocates; see kvpage/attention/torch_ref.py for why):

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    slot s = block_id * block_size + offset   ->   k_cache[block_id, :, offset, :]
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from kvpage.attention.metadata import AttentionMetadata

_BACKENDS = {"torch": "kvpage.attention.torch_ref:TorchReferenceBackend"}


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim], one layer
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def get_backend(name: str = "torch") -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
