"""The attention backend interface. A backend writes the new K/V into the paged cache and attends.

Backends are chosen by name and imported lazily, so a GPU kernel can be added (and its toolchain
imported) without the reference backend or the model changing.

A backend owns its cache layout: `allocate_kv` makes one layer's `LayerKV` (layer_kv.py) the way
its kernels read it, and the KV cache (worker/kv_cache.py) asks it for every pool (device, swap,
CPU tier). What the rest of kvpage relies on is only this: block ids index dimension 0 of every
tensor of a LayerKV (copy-on-write, swap and the tier move whole blocks through `tensors()`), and
keys end in head_dim (StreamingLLM's sink rotation works on the last dimension). The reference
layout, head-major inside a block (see kvpage/attention/torch_ref.py for why), with scales when the
KV dtype is quantized (int8 / fp8: the backend quantizes when it writes, dequantizes when it reads):

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
    "triton": "kvpage.attention.triton_paged:TritonPagedBackend",
}


class AttentionBackend(Protocol):
    """What a backend provides. `allocate_kv` and `forward` are the whole contract the model and the
    KV cache use; `fuses_decode` tells the model runner whether a pure decode step may run in one
    compiled call instead (worker/fused_decode.py: only for the CPU kernels' layout and decode).

    The reference backend (torch_ref.py) implements `forward` as three steps a backend may override
    one by one, leaving the others to the shared fallback (subclass TorchReferenceBackend):

        write(k, v, kv, slots)                          the step's new K/V into their slots
        decodes(out, q, kv, meta, scale)                the first num_decodes queries, one token each
        prefill_chunk(out, q, k, v, kv, meta, i, scale) sequence i's chunk (its K/V already written)

    and the fallback handles what a fast kernel may decline: any path but DENSE (`read_path`), a cache
    dtype the kernel does not read (fp8), a chunk too long to run as decodes. The CPU backend
    overrides all three; the Triton backend `write`, `decodes` and `prefills`."""

    name: str
    fuses_decode: bool

    def allocate_kv(
        self,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str,  # the KV dtype: "auto" (dtype) / "int8" / "fp8"
        device: str | torch.device,
        pin: bool = False,
    ) -> LayerKV:
        """One layer's cache of `num_blocks` blocks, zeroed, in this backend's layout."""
        ...

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


# How a sequence is read in one layer (`read_path`), from the plainest to the most demanding.
DENSE = "dense"  # its table, every block: any backend's kernel
BOUNDED = "bounded"  # the blocks its read budget chooses by key bounds (key_bounds.py): the CPU kernels, the reference
WINDOWED = "windowed"  # its table, the keys behind the layer's sliding window masked, or soft-capped: the reference
MASS = "mass"  # its table, and the mass each block received (H2O): the reference
DEMOTED = "demoted"  # its table and its demoted blocks, explicitly (demoted.py): the reference
_RANK = {DENSE: 0, BOUNDED: 1, WINDOWED: 2, MASS: 3, DEMOTED: 4}


def read_path(meta: AttentionMetadata, i: int, bounded: bool, shaped: bool = False) -> str:
    """Which path reads sequence i in a layer (`bounded`: the layer keeps key bounds; `shaped`: it
    reads a window, or soft-caps its scores, LayerKV.shaped): the one place that decides it from what
    the layer is and what the step asks of attention (meta.reads). A window goes with no eviction policy
    nor read budget (compat.py)."""
    if shaped:
        return WINDOWED
    reads = meta.reads
    if reads.empty:
        return DENSE
    if reads.demoted_of(i):
        return DEMOTED
    if reads.wants_mass(i):
        return MASS
    if bounded and i < meta.num_decodes and reads.restricted(i, meta.seq_lens_list[i], meta.block_size):
        return BOUNDED
    return DENSE


def decodes_path(meta: AttentionMetadata, bounded: bool, shaped: bool = False) -> str:
    """The path a step's decodes take together (they are attended as one batch): the most demanding
    of theirs."""
    if shaped:
        return WINDOWED
    if meta.reads.empty:
        return DENSE
    return max((read_path(meta, i, bounded) for i in range(meta.num_decodes)), key=_RANK.__getitem__, default=DENSE)


def resolve_backend(name: str, device: str | torch.device = "cpu") -> str:
    """ "auto": the compiled CPU kernels on a CPU where they build (kvpage/ops), the Triton kernels on
    a CUDA device where triton imports, else the reference."""
    if name != "auto":
        return name
    device_type = torch.device(device).type
    if device_type == "cpu":
        from kvpage.ops import load

        if load():
            return "cpu"
    elif device_type == "cuda":
        from kvpage.attention.triton_paged import unavailable_reason

        if unavailable_reason(device) is None:
            return "triton"
    return "torch"


def get_backend(name: str = "torch", device: str | torch.device = "cpu") -> AttentionBackend:
    name = resolve_backend(name, device)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS) + ['auto']}")
    module, cls = _BACKENDS[name].split(":")
    backend = getattr(importlib.import_module(module), cls)
    return backend(device) if name == "triton" else backend()
