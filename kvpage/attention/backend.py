"""The attention backend interface. A backend writes the new K/V into the paged cache and attends.

Backends are chosen by name and imported lazily, so a GPU kernel can be added (and its toolchain
imported) without the reference backend or the model changing.

The cache a backend is given is one layer's `LayerKV` (layer_kv.py): K and V of every block,
head-major inside a block (see kvpage/attention/torch_ref.py for why), and their scales when the KV
dtype is quantized (int8 / fp8: the backend quantizes when it writes, dequantizes when it reads):

    kv.k, kv.v: [num_blocks, num_kv_heads, block_size, head_dim]; kv.k_scale, kv.v_scale: [.., block_size]
    slot s = block_id * block_size + offset   ->   kv.k[block_id, :, offset, :]
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from kvpage.attention.layer_kv import LayerKV
from kvpage.attention.metadata import AttentionMetadata

_BACKENDS = {
    "torch": "kvpage.attention.torch_ref:TorchReferenceBackend",
    "cpu": "kvpage.attention.cpu_paged:CpuPagedBackend",
}


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv: LayerKV,  # one layer's cache
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def resolve_backend(name: str, device: str | torch.device = "cpu") -> str:
    """ "auto": the compiled CPU kernels on a CPU where they build (kvpage/ops), else the reference."""
    if name != "auto":
        return name
    if torch.device(device).type == "cpu":
        from kvpage.ops import load

        if load():
            return "cpu"
    return "torch"


def get_backend(name: str = "torch", device: str | torch.device = "cpu") -> AttentionBackend:
    name = resolve_backend(name, device)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS) + ['auto']}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
