"""What the scheduler hands the worker each step: plain ints and lists, no torch.

SchedulerOutput
  sequences: the tokens to compute for each sequence, where they go, what to return
  copies:    (src, dst) GPU block copies to perform first (copy-on-write)
  demotions: (src precision, src, dst precision, dst): blocks an eviction policy demoted to a lower
             precision after the last step ("hot": the cache's own pool), re-quantized, first of all
  offload:   (gpu, tier) copies of evicted prefix blocks into the CPU tier: after those
  fetched:   (tier, payload): blocks fetched from the shared tier (remote_tier.py) into the CPU tier: second
  restore:   (tier, gpu) copies of prefix hits on the CPU tier back into fresh GPU blocks: third
  swap_out:  (gpu, cpu) block copies, before the step; swap_in: (cpu, gpu) block copies
  rotations: (src, dst, positions): dst = src with its keys rotated by `positions` (StreamingLLM's
             sink blocks seen at cache positions), after every copy above
  slot_copies: (src slot, dst slot, length, shift): runs of slots copied from other cached KV
             (a prompt given in parts: seq_plan.py SegmentFill), keys rotated by `shift`, after the rotations
  write_through: (gpu, digest, token ids) blocks whose KV the step writes, sent to the shared tier
             after the forward
  failed:    requests the scheduler failed while planning (they never fit): (request_id, reason)

A sequence is named by `SeqKey(request_id, index)`: plain data, never a string to split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class SeqKey(NamedTuple):
    request_id: str
    index: int  # the sample's (or beam's) index within its request


@dataclass(slots=True)
class ScheduledSequence:
    seq_id: SeqKey
    token_ids: list[int]  # the new tokens to run this step (a prompt chunk, or one decode token)
    num_computed: int  # tokens of this sequence whose KV is already cached: position of token_ids[0]
    block_table: list[int]  # physical blocks covering num_computed + len(token_ids) tokens
    return_logits: bool = True  # logits of the last token (False for a prompt chunk that is not the last)
    prompt_logprobs: bool = False  # also return the log-probabilities over every position of this chunk
    # Eviction policies: the table holds only resident blocks and `num_evicted` tokens before the
    # window are missing from it (whole blocks); positions stay those of the sequence.
    num_evicted: int = 0
    want_mass: bool = False  # H2O: return the attention mass each block of the table received
    # These tokens' slots hold copied KV: the layers up to a check layer recompute all of them, the
    # later layers only this share, the tokens whose K/V deviated most from the copy (CacheBlend:
    # worker/selective.py). None: an ordinary run, computed in full.
    select_ratio: float | None = None
    # A decode of this sequence reads at most this many tokens' blocks in the layers that keep key
    # bounds, chosen by them (attention/key_bounds.py). None: every block.
    max_read_tokens: int | None = None
    # Demoted blocks (core/eviction/): attention also reads these, after the table's, (precision,
    # block id in that precision's pool); H2O's mass comes back for them after the table's entries.
    cold_blocks: list[tuple[str, int]] = field(default_factory=list)
    # A model of several KV-cache groups (core/kv_spec.py): the tables of the groups after the first,
    # each (resident blocks, tokens its window released before them); `block_table` is group 0's.
    group_tables: list[tuple[list[int], int]] = field(default_factory=list)

    @property
    def kv_len(self) -> int:
        """Keys attention sees at the last query: the sequence's tokens minus the evicted ones."""
        return self.seq_len - self.num_evicted

    @property
    def seq_len(self) -> int:
        return self.num_computed + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    sequences: list[ScheduledSequence]
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    offload: list[tuple[int, int]] = field(default_factory=list)
    restore: list[tuple[int, int]] = field(default_factory=list)
    fetched: list[tuple[int, bytes]] = field(default_factory=list)
    write_through: list[tuple[int, bytes, tuple[int, ...]]] = field(default_factory=list)
    rotations: list[tuple[int, int, int]] = field(default_factory=list)
    slot_copies: list[tuple[int, int, int, int]] = field(default_factory=list)
    demotions: list[tuple[str, int, str, int]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def has_work(self) -> bool:
        """Anything for the worker to do (model tokens or block copies)."""
        return bool(
            self.sequences or self.copies or self.swap_out or self.swap_in or self.offload or self.restore
            or self.fetched or self.write_through
            or self.rotations or self.slot_copies or self.demotions
        )  # fmt: skip
