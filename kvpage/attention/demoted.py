"""Reading a sequence's demoted blocks (core/eviction: Demote) in attention.

A demoting policy moves full blocks of a sequence's context to pools of lower precision ("int8",
"int4", "cpu": LayerKV.cold); the table keeps a hole where each was, and the step lists them per
sequence (ReadPlan.demoted: (precision, block id), in logical order). Every one of them precedes the
sequence's queries, so attention reads them unmasked, beside the table's keys; the reference
backend's explicit path (torch_ref.py) puts them first:

    keys   [ demoted d0 d1 | table t0 t1 t2 ... ]     visible: every demoted key, the table's by position

and gives back the mass each received through ReadPlan.add_mass, which keeps the reported order
(table, then demoted) in one place. Kernels never read demoted blocks: backend.read_path sends such a
sequence to the reference.
"""

from __future__ import annotations

import torch

from kvpage.attention.layer_kv import LayerKV, read_named_blocks
from kvpage.attention.read_plan import Demoted


def demoted_kv(kv: LayerKV, blocks: Demoted, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The demoted blocks' K and V, in the order listed, dequantized to `dtype`: [kv_heads, blocks x bs, d]
    each, on the layer's device (the "cpu" rung lives in host memory and is copied over)."""
    heads, d = kv.k.shape[1], kv.k.shape[3]
    k, v = read_named_blocks(kv.cold, blocks, kv.k.device)  # type: ignore[arg-type]
    return k.transpose(0, 1).reshape(heads, -1, d).to(dtype), v.transpose(0, 1).reshape(heads, -1, d).to(dtype)
