"""The scheduler's intake: what enters the running batch each step after the running requests have
their tokens. Part of `Scheduler` (a base class: the state is the scheduler's own), in its order:

    swapped requests, oldest first (`_swap_in`), if nothing was preempted this step;
    then parked samples, oldest request first (`_resume_parked`): swapped back in, or admitted
        again (their prompt blocks are hits while a sibling holds them);
    then waiting requests, first come first served (`_admit`), if nothing is swapped out or parked,
        while the budget, `max_num_seqs` and the block watermark allow (the head of the queue waits
        a step while the shared tier's blocks it asked for are fetched: remote_fetch.py).

Each brought-back request runs in the same step when its next tokens need no block beyond what is free.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvpage.core.admission import AdmissionStatus
from kvpage.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvpage.core.kv_cache_manager import KVCacheManager
    from kvpage.core.scheduler_output import SchedulerOutput


class Intake:
    kv: KVCacheManager
    max_num_seqs: int
    running: list[Request]
    waiting: deque[Request]
    swapped: deque[Request]
    _in_flight: set[str]
    slots_by_chunk: bool
    # and the scheduler's _plan, _blocks_to_grow, _schedule_seq, _seats_for, _fail, num_running_seqs

    def _resume_parked(self, budget: int, out: SchedulerOutput) -> tuple[int, bool]:
        """Parked samples back, oldest request first, while they fit beside everyone running
        (swapped ones swapped in, freed ones admitted again: the blocks their siblings hold are hits).
        Returns the budget left and whether every parked sample is back. A sample waits while a
        sibling is still computing its prompt (it would recompute what the sibling is about to
        register as hits)."""
        all_back = True
        for req in list(self.running):
            for seq in [s for s in req.live_sequences if s.parked]:
                if budget <= 0 or self.num_running_seqs() >= self.max_num_seqs:
                    return budget, False
                if any(s.num_uncomputed > 1 for s in req.resident_sequences):
                    all_back = False
                    break
                keep = self.num_running_seqs() > 0
                if self.kv.has_sequence(seq.key):  # swapped out
                    if not self.kv.can_swap_in([seq.key], keep_watermark=keep):
                        return budget, False
                    pairs = self.kv.swap_in([seq.key])
                    if pairs is None:
                        return budget, False
                    out.swap_in.extend(pairs)
                else:
                    cached = req.use_prefix_cache
                    adm = self.kv.check_admission([seq.token_ids], req.cache_salt, use_prefix_cache=cached,
                                                  keep_watermark=keep)  # fmt: skip
                    if adm.status is AdmissionStatus.NEVER:
                        if req.resident_sequences:  # (they may run in this step: fail it once they end)
                            all_back = False
                            break
                        why = f"sample {seq.index}: {adm.reason}"
                        self._fail(req, f"request {req.request_id!r} can never fit: {why}", rejected=True)
                        break
                    if adm.status is AdmissionStatus.LATER:
                        return budget, False
                    out.copies.extend(self.kv.admit([seq.key], [seq.token_ids], adm))
                    seq.num_computed = adm.prefix.num_tokens if adm.prefix else 0
                seq.parked = False
                self._in_flight.add(req.request_id)
                n = min(seq.num_uncomputed, budget)
                if n > 0 and self._blocks_to_grow(req, [(seq, n)]) <= self.kv.num_free_blocks:
                    budget -= self._schedule_seq(req, seq, n, out)
        return budget, all_back

    def _swap_in(self, budget: int, out: SchedulerOutput) -> int:
        """Bring swapped requests back, oldest first, and run them in this step when their next tokens
        need no block beyond what is free."""
        while self.swapped:
            req = self.swapped[0]
            live = [s.key for s in req.resident_sequences]
            if not self.kv.can_swap_in(live, keep_watermark=self.num_running_seqs() > 0):
                return budget
            if not self._seats_for(req, len(live)):
                return budget
            pairs = self.kv.swap_in(live)
            if pairs is None:
                return budget
            out.swap_in.extend(pairs)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.swapped.popleft()
            self._in_flight.add(req.request_id)
            plan = self._plan(req, budget)
            if plan and self._blocks_to_grow(req, plan) <= self.kv.num_free_blocks:
                for seq, n in plan:
                    budget -= self._schedule_seq(req, seq, n, out)
        return budget

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        bs = self.kv.block_size
        while self.waiting and budget > 0:
            req = self.waiting[0]
            seqs = req.resident_sequences
            if not self._seats_for(req, len(seqs)):
                return
            tokens = [s.token_ids for s in seqs]
            plan = seqs[0].plan  # (the lead's: sample 0 may have ended before a recompute)
            held = plan.hold(self.kv, tokens[0], req.cache_salt)  # before admission allocates
            cap = req.eviction.admission_cap(bs)  # an evicting policy: slots (and hits) within its budget
            if cap is None and self.slots_by_chunk and len(tokens) == 1:  # its hits and the tokens it runs now
                hit = self.kv.find_cached_prefix(tokens[0], req.cache_salt) if req.use_prefix_cache else None
                cap = (hit.num_tokens if hit is not None else 0) + budget
            if cap is not None:
                tokens = [t[:cap] for t in tokens]
            adm = self.kv.check_admission(
                tokens, req.cache_salt, use_prefix_cache=req.use_prefix_cache, keep_watermark=bool(self.running)
            )
            if adm.status is not AdmissionStatus.NOW and plan.holds(held):
                # it does not fit beside what its plan holds: that gives way (a pool too small to
                # hold both must not stall it)
                held = plan.give_way(self.kv, held)
                adm = self.kv.check_admission(
                    tokens, req.cache_salt, use_prefix_cache=req.use_prefix_cache, keep_watermark=bool(self.running)
                )
            if adm.prefix is not None and adm.prefix.awaiting_fetch:
                return  # its blocks are fetched from the shared tier before the next step: it waits one
            if adm.status is AdmissionStatus.NEVER:
                self._fail(req, f"request {req.request_id!r} can never fit: {adm.reason}", rejected=True)
                continue
            if adm.status is AdmissionStatus.LATER:
                return  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            out.copies.extend(self.kv.admit([s.key for s in seqs], tokens, adm, req.eviction))
            lead = seqs[0]
            lead.num_computed = adm.prefix.num_tokens if adm.prefix else 0
            if req.num_cached_tokens is None:  # (what usage.prompt_tokens_details.cached_tokens reports)
                req.num_cached_tokens = lead.num_computed
            plan.admitted(self.kv, lead, seqs[1:], held, out)  # (with prompt logprobs too)
            for s, m in zip(seqs[1:], adm.shared_blocks[1:], strict=True):
                s.num_computed = m * bs
                s.depends_on = (lead.index, m * bs) if m * bs > lead.num_computed else None
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            for seq, n in self._plan(req, budget):
                n = min(n, self.kv.num_tokens(seq.key) - seq.num_computed)  # admitted within its cap
                if n > 0:
                    budget -= self._schedule_seq(req, seq, n, out)
