"""Which part of the model a rank of a tensor-parallel group holds (Megatron's split, as vLLM does it).

    q/k/v projections   by heads: rank r holds query heads [r*H/N, (r+1)*H/N) and KV/N kv heads; when
                        N > KV the kv heads are replicated, rank r using kv head r // (N / KV)
    o_proj              row-parallel (its input columns, by query head), then an all-reduce
    gate/up projections column-parallel (output rows, by intermediate slice)
    down_proj           row-parallel (input columns), then an all-reduce
    embedding, lm_head, norms   replicated (rank 0 computes the logits; the others only the layers)

A rank's model is the plain model of its `local_config` (fewer heads, a narrower MLP) loaded from the
full checkpoint through `narrow`; nothing else in the model knows it is a shard but the all-reduces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpage.errors import ParameterError

if TYPE_CHECKING:
    from kvpage.models.config import ModelConfig


def check_split(n: int, heads: int, kv_heads: int, intermediate: int) -> None:
    """Refuse a split the model's shape does not allow, naming both numbers."""
    if heads % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's {heads} attention heads")
    if (kv_heads % n) if n <= kv_heads else (n % kv_heads):
        raise ValueError(f"tensor_parallel_size={n} and the model's {kv_heads} KV heads: one must divide the other")
    if intermediate % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's MLP width (intermediate_size "
                         f"{intermediate})")  # fmt: skip


def local_kv_heads(n: int, kv_heads: int) -> int:
    """KV heads a rank holds: KV/N, or one (replicated) when N > KV."""
    return max(1, kv_heads // n)


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    size: int

    def check(self, cfg: ModelConfig) -> None:
        if self.size > 1 and cfg.mamba is not None:
            raise ParameterError("tensor_parallel_size", f"tensor_parallel_size={self.size} does not go with "
                                 "state-space layers yet")  # fmt: skip
        if self.size > 1 and cfg.moe is not None:
            raise ParameterError("tensor_parallel_size", f"tensor_parallel_size={self.size} does not go with a mixture "
                                 "of experts yet (its experts are not split across ranks)")  # fmt: skip
        if self.size > 1 and cfg.parallel_block:
            raise ParameterError("tensor_parallel_size", f"tensor_parallel_size={self.size} does not go with "
                                 f"{cfg.architecture}'s parallel blocks yet")  # fmt: skip
        check_split(self.size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)

    def kv_replication(self, cfg: ModelConfig) -> int:
        """How many ranks hold each kv head (1 unless N > KV heads)."""
        return max(1, self.size // cfg.num_kv_heads)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        self.check(cfg)
        n = self.size
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=local_kv_heads(n, cfg.num_kv_heads),
                                   intermediate_size=cfg.intermediate_size // n)  # fmt: skip

    def _rows(self, part: str, cfg: ModelConfig) -> tuple[int, int]:
        """(start, length) of this rank's slice along a projection's sharded dimension."""
        local, d, r = self.local_config(cfg), cfg.head_dim, self.rank
        if part in ("q_proj", "o_proj"):
            return r * local.num_heads * d, local.num_heads * d
        if part in ("k_proj", "v_proj"):
            head = r * local.num_kv_heads if self.size <= cfg.num_kv_heads else r // self.kv_replication(cfg)
            return head * d, local.num_kv_heads * d
        return r * local.intermediate_size, local.intermediate_size  # gate_proj, up_proj, down_proj

    def narrow(self, name: str, tensor, cfg: ModelConfig):
        """This rank's slice of the Hugging Face-named weight `name` (the whole tensor if replicated)."""
        if self.size == 1:
            return tensor
        parts = name.split(".")
        part = parts[-2] if len(parts) >= 2 else ""
        if part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            return tensor.narrow(0, *self._rows(part, cfg))  # output rows (and the bias with them)
        if part in ("o_proj", "down_proj") and parts[-1] == "weight":
            return tensor.narrow(1, *self._rows(part, cfg))  # input columns
        return tensor


SINGLE = Shard(0, 1)
