"""GGUF weights kept at their own precision in the conversion cache, made float32 when loaded.

The cache file (safetensors) holds each tensor as the GGUF does: F32 as float32, F16 as float16,
BF16 as bfloat16, and a quantized type as its raw blocks, uint8 rows of `row_bytes` (the rows
already in Hugging Face order), the type's name listed in the file's metadata under TYPES_KEY.
Loading turns blocks into float32 with gguf.quants' own arithmetic, so the weights are bit for bit
those a dequantization at conversion gave (and 16-bit values widen exactly). Q8_0, Q4_0 and Q4_1
are done here in torch, with the same float32 multiply and add as gguf.quants; every other type
goes through gguf.quants.dequantize.

    Q8_0 block, 34 bytes:  d f16 | q0..q31 int8                                  w = q * d
    Q4_0 block, 18 bytes:  d f16 | 16 bytes: q0..q15 low nibbles, q16..q31 high  w = (q - 8) * d
    Q4_1 block, 20 bytes:  d f16 | m f16 | 16 bytes as Q4_0                      w = q * d + m
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

TYPES_KEY = "kvpage.gguf_types"  # metadata: {tensor name: GGUF type name} for tensors kept as blocks


def _scales(blocks: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The first `count` float16 values of each block, as float32 [n_blocks, 1] each."""
    halves = blocks.view(torch.float16)  # a block's bytes are even in number: [n_blocks, bytes / 2]
    return [halves[:, i : i + 1].float() for i in range(count)]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """float32 [n_blocks, 32]: each byte's low nibble in the first 16 columns, its high one in the last."""
    out = torch.empty(qs.shape[0], 2 * qs.shape[1])
    out[:, : qs.shape[1]] = qs & 0x0F
    out[:, qs.shape[1] :] = qs >> 4
    return out


# in place on a float32 buffer: the same float32 operations, in the same order, as gguf.quants
def _q8_0(b: torch.Tensor) -> torch.Tensor:
    (d,) = _scales(b, 1)
    return b.view(torch.int8)[:, 2:].float().mul_(d)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    (d,) = _scales(b, 1)
    return _nibbles(b[:, 2:]).sub_(8).mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _scales(b, 2)
    return _nibbles(b[:, 4:]).mul_(d).add_(m)


_TORCH = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1)}  # type: (bytes per block, decode)


def dequantize(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [rows, cols] from uint8 rows of `qtype` blocks [rows, row_bytes]."""
    if qtype in _TORCH:
        size, decode = _TORCH[qtype]
        return decode(rows.reshape(-1, size)).reshape(rows.shape[0], -1)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return torch.from_numpy(np.asarray(gguf_dequantize(rows.numpy(), GGMLQuantizationType[qtype]), dtype=np.float32))


def save(weights: dict[str, np.ndarray], types: dict[str, str], path: Path) -> None:
    """Write `weights` (float32, float16, or the uint8 rows of the type `types` names) to `path`."""
    from safetensors.torch import save_file

    tensors, kept = {}, {}
    for name, w in weights.items():
        t, qtype = torch.from_numpy(w), types.get(name)
        if qtype == "BF16":
            t = t.view(torch.bfloat16)  # two bytes per value: [rows, 2 * cols] uint8 -> [rows, cols]
        elif qtype is not None:
            kept[name] = qtype
        tensors[name] = t
    save_file(tensors, str(path), metadata={TYPES_KEY: json.dumps(kept)})


def load(path: Path) -> Mapping[str, torch.Tensor]:
    """A safetensors file's tensors; those kept as blocks come out float32, each when it is read (so
    a model's load holds one dequantized tensor at a time, not all of them)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        types = json.loads((f.metadata() or {}).get(TYPES_KEY, "{}"))
    return _Dequantized(tensors, types) if types else tensors


class _Dequantized(Mapping):
    def __init__(self, tensors: dict[str, torch.Tensor], types: dict[str, str]) -> None:
        self._tensors, self._types = tensors, types

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        return dequantize(t, self._types[name]) if name in self._types else t

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
