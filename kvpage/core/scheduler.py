"""The scheduler: continuous batching over the KV-cache manager. Pure Python, no torch.

One step, one way:

    schedule() -> SchedulerOutput -> (the worker runs it) -> update_from_output(out, updates) -> StepResult

`schedule` fills a token budget (`max_num_batched_tokens`). There are no prefill and decode phases:
every sequence is given tokens so that its computed count catches up with its token count, which
covers a decode (1 token), a prompt chunk (chunked prefill) and a recompute after preemption alike.

    1. running requests, oldest first: slots for their new tokens, then their next tokens. When
       blocks run out, the most recently admitted request is preempted (swap to the CPU pool when
       the policy allows and it fits, else recompute: free its blocks, requeue it at the front of
       the waiting queue). A request of independent parallel samples gives up one sample at a time
       (its last: "parked", swapped or freed) while more than one runs. A request that runs out of
       blocks with nothing else left to preempt can never go on: it fails alone.
    2. swapped requests, oldest first, if nothing was preempted this step: swapped back in; then
       parked samples, oldest request first: swapped back in, or admitted again (their prompt
       blocks are hits while a sibling holds them).
    3. waiting requests, first come first served, if nothing is swapped out or parked: admitted while the
       budget, `max_num_seqs` and the block watermark allow (`KVCacheManager.check_admission`
       decides, for all of a request's sequences at once). A request that could never fit fails
       alone and the queue goes on.
    (2 and 3 live in scheduler_intake.py.)

Blocks a step will fill are registered in the prefix cache as it is scheduled, so a request
admitted later in the same step shares them (the model writes each layer's K/V before attending).

A request's eviction policy (core/eviction/) answers how long its prompt chunks may be, how many
slots it holds before a step and how much of its prompt admission covers; the manager releases its
blocks after each step, so its memory stays bounded however long it grows.

`update_from_output` advances the computed counts, applies the engine's per-request decisions
(forks, tokens, finished sequences; see step_update.py) and answers with what finished or failed.
If the worker raised instead, `fail_step` fails the step's requests and forgets its registrations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from kvpage.core.kv_cache_manager import KVCacheManager
from kvpage.core.limits import StepLimits, never_fits
from kvpage.core.preemption import Preemption
from kvpage.core.request import Request, RequestStatus, Sequence
from kvpage.core.scheduler_intake import Intake
from kvpage.core.scheduler_invariants import check_scheduler
from kvpage.core.scheduler_output import ScheduledSequence, SchedulerOutput, SeqKey
from kvpage.core.step_update import RequestUpdate, StepResult, apply_update


class Scheduler(Intake):
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
        self.preemption = Preemption(kv, preemption_mode)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.limits = StepLimits(max_num_seqs, max_num_batched_tokens, max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._failed: dict[str, str] = {}  # failed alone since the last report
        self._in_flight: set[str] = set()  # requests the scheduled step touches
        # layers that release behind a window or a chunk (kv_spec.py): a sequence takes slots for the tokens
        # it runs, chunk by chunk, not its whole prompt at once (which every window's group would hold until
        # the prompt's last step released it), so a prompt longer than the pool's share runs too
        self.slots_by_chunk = any(spec.kind != "full" for spec in kv.specs)

    @property
    def preemption_mode(self) -> str | None:
        return self.preemption.mode

    @property
    def num_preemptions(self) -> int:
        return self.preemption.num_preemptions

    @property
    def num_swapped_out(self) -> int:
        return self.preemption.num_swapped_out

    # ------------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        """Queue a request. A duplicate id or an empty prompt raises ValueError; a request that can
        never be scheduled (too long, too wide) is accepted and reported failed by the next step."""
        if req.request_id in self.requests or req.request_id in self._failed:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.requests[req.request_id] = req
        reason = self.limits.unschedulable(req)
        if reason is not None:
            self._fail(req, f"request {req.request_id!r} can never be scheduled: {reason}", rejected=True)
        else:
            self.waiting.append(req)

    def reject(self, req: Request, reason: str) -> None:
        """Fail a request that never queued (a client's error found after it was added: a structured output
        that cannot be compiled); the next step reports it."""
        if req.request_id in self.requests or req.request_id in self._failed:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._fail(req, reason, rejected=True)

    def abort_request(self, request_id: str) -> Request | None:
        """End a request now; its blocks go back to the pool. Unknown ids return None."""
        self._failed.pop(request_id, None)
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.live_sequences:
            seq.finish_reason = "abort"
        self._retire(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._failed)

    def num_backlog_tokens(self) -> int:
        """Prompt tokens of the unfinished requests still to compute: the uncomputed part of those
        admitted, and of those waiting what the prefix cache would not serve them now (a replica's
        queue, as a fleet router weighs it against the blocks a request would find cached)."""
        total = 0
        for req in self.requests.values():
            if req.sequences:
                total += max(0, len(req.prompt_token_ids) - req.sequences[0].num_computed)
            elif req.use_prefix_cache:
                total += len(req.prompt_token_ids) - self.kv.find_cached_prefix(req.prompt_token_ids,
                                                                                req.cache_salt).num_tokens  # fmt: skip
            else:
                total += len(req.prompt_token_ids)
        return total

    def num_running_seqs(self) -> int:
        return sum(len(r.resident_sequences) for r in self.running)

    def _seats_for(self, req: Request, num_seqs: int) -> bool:
        """`max_num_seqs` lets a request of `num_seqs` live sequences (up to its width) join the running."""
        return not self.running or self.num_running_seqs() + max(num_seqs, req.width) <= self.max_num_seqs

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
            need = self._blocks_to_grow(req, plan)
            while plan and need > self.kv.num_free_blocks and req.status is RequestStatus.RUNNING:
                # the most recently admitted request that holds GPU blocks (maybe req itself); one whose
                # samples are all parked holds none: preempting it would free nothing
                holders = [r for r in self.running if r.resident_sequences]
                victim = holders[-1]
                if victim.independent and len(victim.resident_sequences) > 1:
                    if self.preemption.park(victim, out):  # one sample goes, its siblings run on
                        self._in_flight.add(victim.request_id)
                elif victim is req and len(holders) == 1:  # nothing else holds blocks: it can never go on
                    why = never_fits(req, need, self.kv.num_free_blocks, self.kv.num_total_blocks, self.kv.block_size)
                    self._fail(req, why, rejected=True)
                    break
                else:
                    self.running.remove(victim)
                    self._preempt(victim, out)
                preempted = True
                if victim is req and req.status is RequestStatus.RUNNING:
                    plan = self._plan(req, budget)
                    need = self._blocks_to_grow(req, plan)
            if req.status is not RequestStatus.RUNNING:
                break  # req itself is gone: every request after it is gone as well
            for seq, n in plan:
                budget -= self._schedule_seq(req, seq, n, out)
            i += 1

        if not preempted:
            budget = self._swap_in(budget, out)
        if not preempted and not self.swapped:
            budget, all_back = self._resume_parked(budget, out)
            if all_back:  # first come, first served: no newcomer overtakes a parked sample
                self._admit(budget, out)
        out.failed = list(self._failed.items())
        self._failed.clear()
        out.demotions = self.kv.take_demotions()
        tiers = self.kv.take_tier_transfers()
        out.offload, out.fetched, out.restore, out.write_through = (tiers.offload, tiers.fetched, tiers.restore,
                                                                     tiers.write_through)  # fmt: skip
        return out

    def _plan(self, req: Request, budget: int) -> list[tuple[Sequence, int]]:
        """Tokens for each live sequence; decodes of a request go all together or not at all."""
        seqs = [s for s in req.resident_sequences if s.num_uncomputed > 0]
        if all(s.num_uncomputed == 1 for s in seqs) and len(seqs) > budget:
            return []
        end: dict[int, int] = {}  # computed by the end of this step, for siblings waiting on their lead
        plan = []
        chunk = req.eviction.chunk_tokens(self.kv.block_size) or budget
        for s in seqs:
            if s.depends_on is not None:
                lead, upto = s.depends_on
                if end.get(lead, req.sequences[lead].num_computed) < upto:
                    continue  # the lead has not yet recomputed the blocks this sequence shares
            n = min(s.num_uncomputed, budget, chunk)
            if n <= 0:
                break
            plan.append((s, n))
            end[s.index] = s.num_computed + n
            budget -= n
        return plan

    def _slots(self, req: Request, seq: Sequence, n: int) -> int:
        """Slots `seq` holds before it runs `n` tokens: for all its tokens, or (an evicting policy,
        whose memory stays bounded; layers that release behind a window) for those it runs now."""
        if self.slots_by_chunk:
            return max(seq.num_computed + n, self.kv.num_tokens(seq.key))
        return req.eviction.slots_upto(seq.num_computed + n, len(seq.token_ids))

    def _blocks_to_grow(self, req: Request, plan: list[tuple[Sequence, int]]) -> int:
        """Blocks the planned sequences take to give their tokens a slot (and sink copies, if due)."""
        growth = [(s.key, max(0, self._slots(req, s, n) - self.kv.num_tokens(s.key))) for s, n in plan]
        return self.kv.num_blocks_to_grow(growth)

    def _schedule_seq(self, req: Request, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Slots for `seq`'s tokens (the caller made room), then its next `n` tokens: one entry per
        run its plan gives (seq_plan.py: a run may be of copied KV, marked so; every
        layer writes the step's K/V before any entry attends, so a later run sees an earlier one),
        each annotated by the plan. Returns the tokens scheduled."""
        runs = seq.plan.runs(seq, n)
        end = runs[-1][0] + runs[-1][1]
        step = self.kv.prepare_step(
            seq.key, seq.token_ids, seq.cacheable(end), self._slots(req, seq, end - seq.num_computed)
        )
        out.copies.extend(step.copies)
        out.rotations.extend(step.rotations)
        for start, m, copied in runs:
            entry = ScheduledSequence(
                seq.key,
                seq.token_ids[start : start + m],
                start,
                step.block_table,
                return_logits=start + m == len(seq.token_ids),
                prompt_logprobs=req.want_prompt_logprobs and start < seq.num_prompt_tokens and not copied,
                num_evicted=step.num_evicted,
                want_mass=req.eviction.wants_mass,
                cold_blocks=step.cold_blocks,
                group_tables=step.group_tables,
            )
            seq.plan.annotate(entry, seq, copied)  # (what its features tell the worker)
            out.sequences.append(entry)
        self._in_flight.add(req.request_id)
        return sum(m for _, m, _ in runs)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if self.preemption.preempt(req, out):
            self._in_flight.add(req.request_id)
            req.status = RequestStatus.SWAPPED
            self.swapped.appendleft(req)
        else:
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    # ------------------------------------------------------------------ after the worker ran
    def update_from_output(
        self,
        out: SchedulerOutput,
        updates: Mapping[str, RequestUpdate],
        attention_mass: Mapping[SeqKey, list[float]] | None = None,
    ) -> StepResult:
        """The step's KV is written: advance the computed counts, let eviction policies release
        blocks (H2O scores them by `attention_mass`, per entry of the step's table), apply the
        engine's decisions (forks, then tokens, then finished sequences) and say which requests
        finished or failed."""
        self._in_flight.clear()
        result = StepResult(failed=dict(out.failed))
        computed = {}  # (a sequence's runs come in order: its last one ends furthest)
        for s in out.sequences:
            req = self.requests.get(s.seq_id.request_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                req.sequences[s.seq_id.index].num_computed = s.seq_len
                computed[s.seq_id] = (s.seq_id, s.seq_len, attention_mass.get(s.seq_id) if attention_mass else None)
        self.kv.finish_step(list(computed.values()))
        for request_id, update in updates.items():
            req = self.requests.get(request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if update.error is None:
                try:
                    apply_update(req, update, self.kv)
                except (ValueError, IndexError, KeyError) as e:
                    update.error = f"request {request_id!r} failed: {e}"
            if update.error is not None:
                self._fail(req, update.error)
            elif not req.live_sequences:
                self._retire(req)
                result.finished.append(request_id)
        result.failed.update(self._failed)
        self._failed.clear()
        return result

    def fail_step(self, out: SchedulerOutput, reason: str) -> StepResult:
        """The worker raised while running `out`: every request the step touched fails (its KV may be
        half written), the blocks registered for the step are forgotten, everyone else goes on."""
        self.kv.fail_step()
        touched = self._in_flight | {s.seq_id.request_id for s in out.sequences}
        self._in_flight.clear()
        result = StepResult(failed=dict(out.failed))
        for request_id in touched:
            req = self.requests.get(request_id)
            if req is not None:
                self._fail(req, reason)
        result.failed.update(self._failed)
        self._failed.clear()
        return result

    # ------------------------------------------------------------------ endings
    def _fail(self, req: Request, reason: str, *, rejected: bool = False) -> None:
        """Fail `req` alone; `rejected`: the request itself can never run (a client's error), not a
        step that went wrong."""
        req.error, req.rejected = reason, rejected
        for seq in req.live_sequences:
            seq.finish_reason = "abort"
        self._retire(req)
        self._failed[req.request_id] = reason

    def _retire(self, req: Request) -> None:
        for seq in req.sequences:  # (a failed step's sequences keep nothing: their KV may be half written)
            self.preemption.release(seq, written=req.error is None)
        queue = {RequestStatus.RUNNING: self.running, RequestStatus.WAITING: self.waiting,
                 RequestStatus.SWAPPED: self.swapped}.get(req.status)  # fmt: skip
        if queue is not None and req in queue:
            queue.remove(req)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """The manager's own checks (chain digests against the requests' tokens included), and the
        scheduler's (scheduler_invariants.py)."""
        self.kv.check_invariants({s.key: s.token_ids for r in self.requests.values() for s in r.live_sequences})
        check_scheduler(self.kv, self.requests, self.running, self.waiting, self.swapped)
