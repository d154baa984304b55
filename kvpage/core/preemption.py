"""Preemption: taking a running request's (or one sample's) blocks away so that others can grow.

Two ways, as in vLLM: swap (the blocks move to the CPU pool, swap.py, and come back as they were)
or recompute (the blocks are freed and the tokens computed again later; prompt blocks usually come
back as prefix-cache hits). `mode=None` swaps whenever there is swap space and the move fits, and
recomputes otherwise. The scheduler picks the victim and moves it between its queues; this object
decides how its blocks go and counts.
"""

from __future__ import annotations

from kvpage.core.kv_cache_manager import KVCacheManager
from kvpage.core.request import Request, Sequence
from kvpage.core.scheduler_output import SchedulerOutput


class Preemption:
    def __init__(self, kv: KVCacheManager, mode: str | None) -> None:
        if mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute', 'swap' or None, got {mode!r}")
        self.kv = kv
        self.mode = mode
        self.num_preemptions = 0
        self.num_swapped_out = 0

    def swapped_out(self, req: Request, seqs: list[Sequence], out: SchedulerOutput) -> bool:
        """Count a preemption of `seqs`, and move their blocks to the CPU pool when the mode says swap
        and it fits (blocks they share with sequences that stay are copied, and stay on the GPU too)."""
        req.num_preemptions += 1
        self.num_preemptions += 1
        if (self.mode or ("swap" if self.kv.has_swap_space else "recompute")) != "swap":
            return False
        pairs = self.kv.swap_out([s.key for s in seqs])
        if pairs is None:
            return False
        out.swap_out.extend(pairs)
        self.num_swapped_out += 1
        return True

    def release(self, seq: Sequence, *, written: bool = True) -> None:
        """Free the sequence's blocks (GPU or swapped), if it holds any. When its KV is `written` (no
        failed step), its cached blocks and its partly written last block stay hittable: its exact part
        only (`num_cacheable`: its plan's, seq_plan.py), and nothing while it
        waits on its lead (its computed count covers blocks the lead may not have recomputed yet)."""
        if not self.kv.has_sequence(seq.key):
            return
        if written and seq.depends_on is None:
            self.kv.free(seq.key, seq.token_ids, seq.num_cacheable)
        else:
            self.kv.free(seq.key)

    def drop(self, seq: Sequence) -> None:
        """Recompute: free the sequence's blocks, keep its tokens. Its cached blocks, the partly
        written last one included, serve its recompute if nothing reuses them first."""
        self.release(seq)
        seq.num_computed = 0
        seq.depends_on = None
        seq.plan.forget()

    def preempt(self, req: Request, out: SchedulerOutput) -> bool:
        """Preempt the whole request: True if it was swapped out, False if its blocks were freed."""
        if self.swapped_out(req, req.resident_sequences, out):
            return True
        for i, seq in enumerate(req.live_sequences):  # (a parked sample's swapped blocks go too)
            self.drop(seq)
            seq.parked = req.independent and i > 0  # samples come back one by one after their lead
        return False

    def park(self, req: Request, out: SchedulerOutput) -> bool:
        """Preempt the last running sample of an independent request; the others go on. True if
        its blocks were swapped out."""
        seq = req.resident_sequences[-1]
        seq.parked = True
        if self.swapped_out(req, [seq], out):
            return True
        self.drop(seq)
        return False
