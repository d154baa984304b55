"""The scheduler: continuous batching over the KV-cache manager. Pure Python, no torch.

Each step fills a token budget (`max_num_batched_tokens`). There are no prefill and decode phases:
every sequence is given tokens so that its computed count catches up with its token count, which
covers a decode (1 token), a prompt chunk (chunked prefill) and a recompute after preemption alike.

    1. running requests, oldest first: their next tokens. When blocks run out, the most recently
       admitted request is preempted (swap to the CPU pool when the policy allows and it fits,
       else recompute: free its blocks, requeue it at the front of the waiting queue).
    2. swapped requests, oldest first, if nothing was preempted this step: swapped back in.
    3. waiting requests, first come first served, if nothing is swapped out: admitted while the
       budget, `max_num_seqs` and the block watermark allow; prefix-cache hits count as computed.

Preemption policy (`preemption_mode`): "recompute", "swap", or None = swap whenever a CPU pool
exists and holds the victim, else recompute. A request that can never fit fails alone.

The engine drives the rest through plain calls: `on_step_done` after the model ran, then per
sampled token `append_token`, `fork` (parallel samples, beams) and `finish_sequence`.
"""

from __future__ import annotations

from collections import deque

from kvpage.core.admission import AdmissionStatus
from kvpage.core.kv_cache_manager import CachedPrefix, KVCacheManager
from kvpage.core.request import Request, RequestStatus, Sequence
from kvpage.core.scheduler_output import ScheduledSequence, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        preemption_mode: str | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.failed: list[Request] = []  # failed alone since the last drain (the engine reports them)
        self.num_preemptions = 0
        self.num_swapped_out = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n > self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, more than max_model_len={self.max_model_len}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_running_seqs(self) -> int:
        return sum(len(r.live_sequences) for r in self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([])
        budget = self.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            plan = self._plan(req, budget)
            if not plan:
                i += 1
                continue
            need = sum(self.kv.num_blocks_needed(s.seq_id, n) for s, n in plan)
            while need > self.kv.pool.num_free and req.status is RequestStatus.RUNNING:
                self._preempt(self.running.pop(), out)  # the most recently admitted; maybe req itself
                preempted = True
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: every request after it is gone as well
            for seq, n in plan:
                budget -= self._allocate(req, seq, n, out)
            i += 1

        if not preempted:
            self._swap_in(out)
        if not preempted and not self.swapped:
            budget = self._admit(budget, out)
        return out

    def _plan(self, req: Request, budget: int) -> list[tuple[Sequence, int]]:
        """Tokens for each live sequence; decodes of a request go all together or not at all."""
        seqs = [s for s in req.live_sequences if s.num_uncomputed > 0]
        if all(s.num_uncomputed == 1 for s in seqs) and len(seqs) > budget:
            return []
        plan = []
        for s in seqs:
            n = min(s.num_uncomputed, budget)
            if n <= 0:
                break
            plan.append((s, n))
            budget -= n
        return plan

    def _allocate(self, req: Request, seq: Sequence, n: int, out: SchedulerOutput, prefix=None) -> int:
        start = seq.num_computed
        alloc = self.kv.allocate_slots(seq.seq_id, seq.token_ids[start : start + n], prefix)
        if alloc is None:  # the caller checked room first: this is a bookkeeping bug
            raise RuntimeError(f"no blocks for {seq.seq_id} after the scheduler made room")
        out.copies.extend(alloc.copies)
        if n:
            out.sequences.append(
                ScheduledSequence(
                    seq.seq_id,
                    seq.token_ids[start : start + n],
                    start,
                    self.kv.block_table(seq.seq_id),
                    return_logits=start + n == len(seq.token_ids),
                    prompt_logprobs=req.want_prompt_logprobs and start < seq.num_prompt_tokens,
                )
            )
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        req.num_preemptions += 1
        self.num_preemptions += 1
        live = [s.seq_id for s in req.live_sequences]
        mode = self.preemption_mode or ("swap" if self.kv.cpu_pool.num_total else "recompute")
        if mode == "swap":
            pairs = self.kv.swap_out(live)
            if pairs is not None:
                out.swap_out.extend(pairs)
                req.status = RequestStatus.SWAPPED
                self.swapped.appendleft(req)
                self.num_swapped_out += 1
                return
        for seq in req.live_sequences:  # recompute: drop the KV, keep the tokens
            self.kv.free(seq.seq_id)
            seq.num_computed = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _swap_in(self, out: SchedulerOutput) -> None:
        while self.swapped:
            req = self.swapped[0]
            live = [s.seq_id for s in req.live_sequences]
            need = self.kv.num_blocks_to_swap_in(live)
            free = self.kv.pool.num_free
            if need > free - self.kv.watermark_blocks and (self.running or need > free):
                return
            if self.running and self.num_running_seqs() + len(live) > self.max_num_seqs:
                return
            pairs = self.kv.swap_in(live)
            if pairs is None:
                return
            out.swap_in.extend(pairs)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.swapped.popleft()

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0:
            req = self.waiting[0]
            seqs = req.live_sequences
            if self.running and self.num_running_seqs() + len(seqs) > self.max_num_seqs:
                break
            prefixes: list[CachedPrefix | None] = [
                self.kv.find_cached_prefix(s.token_ids, req.cache_salt) if req.use_prefix_cache else None for s in seqs
            ]
            needed = 0
            for s, p in zip(seqs, prefixes, strict=True):
                adm = self.kv.check_admission(len(s.token_ids), p)
                if adm.status is AdmissionStatus.NEVER:
                    self._fail(req, f"request {req.request_id!r} can never fit: {adm.reason}")
                    break
                needed += adm.blocks_needed
            if req.status is RequestStatus.FINISHED:
                continue
            if needed > self.kv.pool.num_total:
                self._fail(req, f"request {req.request_id!r} can never fit: its {len(seqs)} sequences need "
                                f"{needed} blocks, the cache holds {self.kv.pool.num_total}")  # fmt: skip
                continue
            free = self.kv.pool.num_free - sum(
                1 for p in prefixes if p for b in p.block_ids if self.kv.pool.blocks[b].ref_count == 0
            )
            if needed > free - self.kv.watermark_blocks and (self.running or needed > free):
                break
            self.waiting.popleft()
            for s, p in zip(seqs, prefixes, strict=True):
                s.num_computed = p.num_tokens if p else 0
                n = min(s.num_uncomputed, budget)
                budget -= self._allocate(req, s, n, out, prefix=p or CachedPrefix([], [], 0, 0, req.cache_salt))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return budget

    def _fail(self, req: Request, reason: str) -> None:
        req.error = reason
        self.waiting.remove(req)
        for seq in req.live_sequences:
            seq.finish_reason = "abort"
            if self.kv.has_sequence(seq.seq_id):
                self.kv.free(seq.seq_id)
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]
        self.failed.append(req)

    # ------------------------------------------------------------------ after the model ran
    def on_step_done(self, out: SchedulerOutput) -> None:
        """The scheduled tokens' KV is written: advance the sequences, register full blocks."""
        for s in out.sequences:
            req = self.requests.get(s.seq_id.rsplit("#", 1)[0])
            seq = req.sequence(s.seq_id) if req else None
            if seq is None or seq.finished:
                continue
            seq.num_computed = s.seq_len
            self.kv.mark_computed(s.seq_id, seq.num_computed)

    def append_token(self, seq: Sequence, token_id: int) -> None:
        seq.token_ids.append(token_id)

    def fork(self, req: Request, parent: Sequence, index: int) -> Sequence:
        """A new sequence sharing every block of `parent` (call before appending new tokens)."""
        child = Sequence(f"{req.request_id}#{index}", index, list(parent.token_ids), parent.num_prompt_tokens,
                         parent.num_computed)  # fmt: skip
        self.kv.fork(parent.seq_id, child.seq_id)
        req.sequences.append(child)
        return child

    def finish_sequence(self, req: Request, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if self.kv.has_sequence(seq.seq_id):
            self.kv.free(seq.seq_id)
        if not req.live_sequences:
            self._retire(req)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.live_sequences:
            seq.finish_reason = "abort"
            if self.kv.has_sequence(seq.seq_id):
                self.kv.free(seq.seq_id)
        self._retire(req)
        return req

    def _retire(self, req: Request) -> None:
        queue = {RequestStatus.RUNNING: self.running, RequestStatus.WAITING: self.waiting,
                 RequestStatus.SWAPPED: self.swapped}.get(req.status)  # fmt: skip
        if queue is not None and req in queue:
            queue.remove(req)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
