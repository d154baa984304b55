"""`LLMEngine`: the step-level engine. add_request / step / abort_request / has_unfinished_requests.

One step, data flowing one way:

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> logits
    -> per request: sample (or a beam step); OutputProcessor: text, logprobs, stop checks
    -> RequestUpdate (forks, tokens, finished sequences) -> Scheduler.update_from_output()
    -> StepResult (finished, failed) -> RequestOutput for every request that advanced or ended

Building (the model, the sized cache, every component) is builder.py's; sampling the sampler's
(worker/sampler.py); block policy the scheduler's and the KV-cache manager's; text the output
processor's. Bad parameters raise ValueError in add_request; a step that still fails fails
only the requests it concerns (the whole batch if the model raised, else the one request).
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from kvpage import compat
from kvpage.attention.key_bounds import check_budget
from kvpage.config import EngineConfig
from kvpage.core import CacheStats
from kvpage.core.kv_events import KVEventLog
from kvpage.core.request import Request, Sequence
from kvpage.core.scheduler_output import SchedulerOutput
from kvpage.core.seq_plan import plan_of
from kvpage.core.step_update import RequestUpdate, SeqUpdate, StepResult
from kvpage.engine.beam_search import BeamSearch
from kvpage.engine.builder import build_engine
from kvpage.engine.engine_stats import EngineStats, StepTokens
from kvpage.engine.kv_verifier import KVVerifyReport, verify_kv_cache
from kvpage.engine.output_processor import OutputProcessor, RequestState
from kvpage.engine.segment_prompts import SegmentCompiler, SegmentedPrompt, prompt_of
from kvpage.errors import TensorParallelFailure
from kvpage.outputs import RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams, parse_kv_eviction
from kvpage.structured.grammars import StructuredOutputs
from kvpage.structured.jump_forward import forced_tokens
from kvpage.worker.model_runner import ModelRunnerOutput
from kvpage.worker.sampler import SampledToken, Sampler
from kvpage.worker.step_hooks import ReadBudgetCount

_log = logging.getLogger("kvpage")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine(config)  # the model loaded, the cache sized, every component built (builder.py)
        self.dtype_name, self.dtype_reason, self.kernels = parts.dtype_name, parts.dtype_reason, parts.kernels
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.kv_dtype_name, self.bytes_per_block, self.kv_pool_note = (
            parts.kv_dtype_name,
            parts.bytes_per_block,
            parts.kv_pool_note,
        )
        self.max_model_len = max_model_len = parts.max_model_len
        self.kv_manager, self.kv_cache, self.runner, self.scheduler = (
            parts.kv_manager,
            parts.kv_cache,
            parts.runner,
            parts.scheduler,
        )
        self.remote = parts.remote  # the shared KV tier (--remote-kv), or None
        self._check_read_budget()
        self.outputs = OutputProcessor(self.tokenizer, max_model_len)
        self.segments = SegmentCompiler()  # prompts of segments held until their segments' KV is cached
        self.sampler = Sampler()  # the generators of every sample, their rows, the draws
        # structured outputs: grammars compiled in a worker thread, each constrained sequence's matcher, the masks
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
        self._compiling: dict[str, tuple[Request, Future, set[str]]] = {}  # requests waiting for their grammar
        self._states: dict[str, RequestState] = {}
        self._arrivals = 0
        self._rng = random.Random(config.seed)
        self.num_prompt_tokens = 0  # counters read by /metrics
        self.num_segment_prefill_tokens = 0  # of those, the internal prefills of segments (segment_prompts.py)
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.step_tokens = StepTokens()  # tokens per step (/metrics' iteration_tokens_total)
        self.timings = {"schedule": 0.0, "execute": 0.0, "sample": 0.0}
        self.num_kv_verified_blocks = 0  # counted by verify_kv_cache, read by /metrics
        self.num_kv_mismatches = 0  # (a periodic check that could not run counts as one)
        self.snapshot = self._stats()  # replaced, never changed, after each step (engine_stats.py)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | SegmentedPrompt,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Bad parameters raise ValueError here, before any block is taken; a
        request that cannot fit the cache is accepted and ends with an error output instead. A
        `SegmentedPrompt` reuses each segment's own cached KV where it stands (segment_prompts.py)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise ValueError(f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids, token_lists, spans = self._encode(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        is_beam = isinstance(params, BeamSearchParams)
        width = params.beam_width if is_beam else params.n
        self._check_params(params, ids, is_beam, width)
        own = parse_kv_eviction(params.kv_eviction)  # (parsed in SamplingParams already: a type check)
        eviction = self.config.kv_eviction if own is None else own
        recompute = prompt.recompute_blocks if isinstance(prompt, SegmentedPrompt) else 1
        ratio = prompt.recompute_ratio if isinstance(prompt, SegmentedPrompt) else 0.0
        budget = self.config.kv_read_budget if params.kv_read_budget is None else params.kv_read_budget
        pools = bool(self.kv_manager.eviction.cold)
        compat.check(self.config.setup(eviction=eviction, demote_pools=pools, read_budget=budget or 0,
                                       segments=bool(spans), recompute_ratio=ratio,
                                       **compat.model_facts(self.model_config.layer_specs)))  # fmt: skip
        if budget:
            check_budget(budget, self.kv_cache.block_size)
        want_plp = not is_beam and params.prompt_logprobs is not None
        req = Request(request_id, ids, self._arrivals, cache_salt=cache_salt, use_prefix_cache=not want_plp,
                      want_prompt_logprobs=want_plp, width=width, eviction=eviction,
                      independent=not is_beam and width > 1 and not eviction.evicts,
                      plan=plan_of(spans, recompute, ratio, budget or None))  # fmt: skip
        self._arrivals += 1
        st = self._request_state(req, params, text, is_beam, want_plp)
        waits = self._compile_segments(request_id, token_lists, cache_salt, recompute) if spans else set()
        constraint = params.structured_outputs
        if constraint is not None:  # (checked at once unless compiled already; compiled in a worker thread)
            if not self.structured.submitted(constraint):
                self.structured.check(constraint)
            self._compiling[request_id] = (req, self.structured.submit(constraint), waits)
        elif waits:
            self.segments.hold(req, waits)  # it enters the scheduler once its segments are cached
        else:
            self.scheduler.add_request(req)  # one that can never be scheduled is reported by the next step
        self._states[request_id] = st
        self.num_prompt_tokens += len(ids)
        self.snapshot = self._stats()

    def _encode(self, prompt) -> tuple[str | None, list[int], list[list[int]], tuple[tuple[int, int], ...]]:
        """(text, token ids, the segments' token lists, the segments' spans) of a prompt."""
        if isinstance(prompt, SegmentedPrompt):
            token_lists = prompt.encode(self.tokenizer)
            ids, spans = prompt_of(token_lists)
            text = "".join(prompt.segments) if all(isinstance(g, str) for g in prompt.segments) else None  # type: ignore[arg-type]
            return text, ids, token_lists, spans
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        return text, ids, [], ()

    def _check_params(self, params, ids: list[int], is_beam: bool, width: int) -> None:
        """What only this engine can check: token ids against its vocabulary, the width against its limits."""
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.check_width("beam_width" if is_beam else "n", width)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name, None)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {k}")
        for name in ("stop_token_ids", "logit_bias"):
            outside = [t for t in (getattr(params, name, None) or ()) if t >= vocab]
            if outside:
                raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab})")

    def _request_state(self, req: Request, params, text: str | None, is_beam: bool, want_plp: bool) -> RequestState:
        """The output side of a new request: its stops, token limit, seed (and beam search)."""
        n = len(req.prompt_token_ids)
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        extra_stops = set() if is_beam else set(params.stop_token_ids or ())
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        st = RequestState(
            request=req,
            params=params,
            prompt=text,
            seed=params.seed if not is_beam and params.seed is not None else self._rng.getrandbits(62),
            max_tokens=max(1, max_tokens),
            stop_token_ids=frozenset(eos | extra_stops),
            prompt_logprobs=[None] if want_plp else None,
            arrival_time=time.monotonic(),
        )
        if is_beam:
            limit = st.max_tokens if req.unbounded else max(1, min(st.max_tokens, self.max_model_len - n))
            st.beam = BeamSearch(params.beam_width, params.length_penalty, limit, st.stop_token_ids)
        self.outputs.new_seq_state(st, 0)
        return st

    def _compile_segments(self, request_id: str, token_lists: list[list[int]], cache_salt: str | None,
                          recompute_blocks: int) -> set[str]:  # fmt: skip
        """The internal requests (started here, or already running) that prefill the request's
        reused segments alone, so that their own KV is cached before it runs (segment_prompts.py)."""
        kv = self.kv_manager
        if not kv.enable_prefix_caching:
            return set()
        waits = set()
        for i in self.segments.missing(token_lists, lambda t: kv.num_resident_blocks(t, cache_salt),
                                       kv.block_size, recompute_blocks):  # fmt: skip
            cid = self.segments.compiling(cache_salt, token_lists[i])
            if cid is None:
                cid = f"{request_id}\x00segment {i}"
                # (greedy, seeded: it draws nothing from the engine's generator, so the seeds of
                # later unseeded requests stay what they would be without it)
                self.add_request(cid, token_lists[i], SamplingParams(max_tokens=1, temperature=0.0, seed=0),
                                 cache_salt=cache_salt)  # fmt: skip
                self.segments.start(cid, cache_salt, token_lists[i])
                self.num_segment_prefill_tokens += len(token_lists[i])
            waits.add(cid)
        return waits

    def _check_read_budget(self) -> None:
        """The engine's own budget, once the block size is known (a request's is checked as it comes)."""
        if self.config.kv_read_budget:
            check_budget(self.config.kv_read_budget, self.kv_cache.block_size)

    def check_width(self, name: str, width: int) -> None:
        """ParameterError (naming `name`) unless `width` sequences of one request can run in the same step."""
        self.scheduler.limits.check_width(name, width)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks go back to the pool. Unknown ids are ignored."""
        if self._states.pop(request_id, None) is not None:
            if self._compiling.pop(request_id, None) is None:
                self.scheduler.abort_request(request_id)
            self.sampler.forget(request_id)
            self.structured.forget(request_id)
            for req in self.segments.ended(request_id) if self.segments.is_internal(request_id) else []:
                self.scheduler.add_request(req)  # (a segment's own prefill, aborted: who waited on it goes on)
            for cid in self.segments.release(request_id):  # its segments' prefills nobody else waits on
                self.abort_request(cid)
            self.snapshot = self._stats()

    def has_request(self, request_id: str) -> bool:
        """Whether the request is still running (queued, running or swapped out)."""
        return request_id in self._states

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def add_step_hook(self, hook) -> None:
        """A StepHook (kvpage/worker/step_hooks.py) called by the model runner around every forward."""
        self.runner.add_hook(hook)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's; False (nothing changes) while requests are unfinished."""
        return not self._states and self.kv_manager.reset_prefix_cache()

    def cache_stats(self) -> CacheStats:
        return self.kv_manager.stats()

    def request_summaries(self) -> list[dict]:
        """Every unfinished request as plain data, oldest first (the dashboard lists them). Between steps."""
        out = []
        for rid, st in self._states.items():
            r = st.request
            kind = "beam" if st.beam is not None else "samples" if r.width > 1 else "single"
            out.append({"request_id": rid, "status": r.status.value, "kind": kind, "width": r.width,
                        "prompt_tokens": len(r.prompt_token_ids), "cached_tokens": r.num_cached_tokens,
                        "live_sequences": len(r.live_sequences), "preemptions": r.num_preemptions})  # fmt: skip
        return out

    @property
    def kv_events(self) -> KVEventLog:
        """What the KV cache stored and removed, numbered per step (core/kv_events.py); any thread reads it."""
        return self.kv_manager.events

    def _stats(self) -> EngineStats:
        sched = self.scheduler
        budget = self.runner.hook(ReadBudgetCount)
        read, context = (budget.blocks["read"], budget.blocks["context"]) if budget is not None else (0, 0)
        return EngineStats(self.num_steps, self.kv_manager.stats(), len(sched.running), len(sched.waiting),
                           len(sched.swapped), sched.num_preemptions, self.num_prompt_tokens,
                           self.num_generation_tokens, self.num_kv_verified_blocks, self.num_kv_mismatches,
                           self.step_tokens.frozen(), read, context)  # fmt: skip

    def verify_kv_cache(self, sample: int = 4, seed: int = 0) -> KVVerifyReport:
        """Check the blocks in use (finite, in range) and, in deterministic mode, recompute `sample`
        cached prefix chains and compare them bit for bit (engine/kv_verifier.py). Between steps only."""
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
            raise ValueError(f"sample must be an integer >= 0, got {sample!r}")
        if sample and self.config.deterministic and self.config.tensor_parallel_size > 1:
            raise ValueError("a recompute check runs the model on rank 0 alone: sample must be 0 under tensor "
                             "parallelism")  # fmt: skip
        report = verify_kv_cache(self, sample, seed)
        self.num_kv_verified_blocks += report.blocks_checked
        self.num_kv_mismatches += len(report.mismatches)
        for m in report.mismatches:
            _log.warning("KV cache check: %s", m)
        return report

    def close(self) -> None:
        """Release what outlives the object: the grammar thread, a tensor-parallel group's other ranks (stopped
        by pid)."""
        self.structured.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ one step
    def _admit_compiled(self) -> None:
        """Requests whose grammar is compiled go on (to the scheduler, or to wait for their segments); one whose
        grammar cannot be compiled fails alone. With nothing else to run, the step waits for a grammar (briefly:
        the server's commands keep coming)."""
        if not self._compiling:
            return
        if not self.scheduler.has_unfinished():
            wait([f for _, f, _ in self._compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        for rid, (req, fut, waits) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            if fut.exception() is not None:
                self.scheduler.reject(req, f"request {rid!r} failed: {fut.exception()}")
                continue
            self.structured.start(rid, fut.result())
            if waits:
                self.segments.hold(req, waits)
            else:
                self.scheduler.add_request(req)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._admit_compiled()
        self.kv_manager.fetch_remote()  # what the last schedule asked of the shared tier, before this one
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        self._note_scheduled(sched)
        generated = self.num_generation_tokens
        try:
            run = self.runner.execute(sched) if sched.has_work else ModelRunnerOutput([], torch.empty(0))
        except TensorParallelFailure:  # the ranks are out of step: nothing can run on them
            raise
        except Exception as e:  # noqa: BLE001 - the batch fails, the engine goes on
            result = self.scheduler.fail_step(sched, f"the model step failed: {type(e).__name__}: {e}")
            return self._finish_step(result, {}, (t0, t1, time.perf_counter()))
        t2 = time.perf_counter()
        updates, advanced = self._process(sched, run)
        result = self.scheduler.update_from_output(sched, updates, run.attention_mass)
        if sched.sequences:  # vLLM's iteration tokens: prompt (or recomputed) tokens computed, plus those sampled
            self.step_tokens.observe(self._prompt_tokens_of(sched) + self.num_generation_tokens - generated)
        return self._finish_step(result, advanced, (t0, t1, t2))

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        """When each request first ran (its queue time ends), for /metrics."""
        now = time.monotonic()
        for s in sched.sequences:
            st = self._states.get(s.seq_id.request_id)
            if st is not None and st.first_scheduled_time is None:
                st.first_scheduled_time = now

    def _prompt_tokens_of(self, sched: SchedulerOutput) -> int:
        """The step's tokens that are not a decode's input (that one was counted when it was sampled)."""
        n = 0
        for s in sched.sequences:
            st = self._states.get(s.seq_id.request_id)
            seqs = st.request.sequences if st is not None else []
            prompt = seqs[s.seq_id.index].num_prompt_tokens if s.seq_id.index < len(seqs) else 0
            n += 0 if len(s.token_ids) == 1 and s.num_computed >= prompt else len(s.token_ids)
        return n

    def _process(self, sched: SchedulerOutput, run: ModelRunnerOutput):
        """The engine's decisions for every request that produced logits: sample or beam-step, then
        text and stop checks. A request whose processing raises fails alone."""
        errors: dict[str, str] = {}
        for s in sched.sequences:
            lp = run.prompt_logprobs.get((s.seq_id, s.num_computed))
            st = self._states.get(s.seq_id.request_id)
            if lp is not None and st is not None:
                try:
                    self.outputs.collect_prompt_logprobs(st, s.num_computed, lp)
                except Exception as e:  # noqa: BLE001 - this request fails alone
                    errors[st.request.request_id] = f"prompt logprobs failed: {type(e).__name__}: {e}"
        rows: dict[str, list[tuple[Sequence, int]]] = {}
        for row, key in enumerate(run.seq_ids):
            st = self._states.get(key.request_id)
            if st is not None:
                rows.setdefault(key.request_id, []).append((st.request.sequences[key.index], row))
        targets = {rid: self._targets(self._states[rid], seq_rows) for rid, seq_rows in rows.items()}
        masks = self._masks(targets, errors)  # every constrained row's allowed tokens, one bitmask for the step
        updates: dict[str, RequestUpdate] = {}
        advanced: dict[str, RequestState] = {}
        now = time.monotonic()
        for request_id, seq_rows in rows.items():
            st = self._states[request_id]
            advanced[request_id] = st
            update = RequestUpdate(request_id)
            try:
                if request_id in errors:
                    raise RuntimeError(errors.pop(request_id))
                if st.beam is not None:
                    self._beam_step(st, seq_rows, run.logits, update, masks.get(request_id))
                else:
                    self._sample_step(st, targets[request_id], run.logits, update, masks.get(request_id))
            except Exception as e:  # noqa: BLE001 - this request fails alone
                update = RequestUpdate(request_id, error=f"request {request_id!r} failed: {type(e).__name__}: {e}")
            updates[request_id] = update
            if update.sequences:
                self.outputs.note_token_time(st, now)
                self.num_generation_tokens += sum((u.token_id is not None) + len(u.forced) for u in update.sequences)
        for request_id, reason in errors.items():  # prompt chunks that returned no logits yet
            updates[request_id] = RequestUpdate(request_id, error=f"request {request_id!r} failed: {reason}")
            advanced[request_id] = self._states[request_id]
        return updates, advanced

    def _finish_step(self, result: StepResult, advanced: dict[str, RequestState], times) -> list[RequestOutput]:
        t0, t1, t2 = times
        for request_id in [*result.finished, *result.failed]:
            st = self._states.get(request_id)
            if st is not None:
                advanced[request_id] = st
        outputs = []
        for st in advanced.values():
            out = self.outputs.make_output(st)
            internal = self.segments.is_internal(out.request_id)
            if out.finished:
                self._states.pop(out.request_id, None)
                self.sampler.forget(out.request_id)
                self.structured.forget(out.request_id)
                if internal:  # a segment's own prefill: the requests waiting on it go to the scheduler
                    for req in self.segments.ended(out.request_id):
                        self.scheduler.add_request(req)
            if not internal:
                outputs.append(out)
        t3 = time.perf_counter()
        self.num_steps += 1
        if self.config.verify_kv_every and self.num_steps % self.config.verify_kv_every == 0:
            try:  # a check that cannot run must not stop the engine: it is logged and counted
                self.verify_kv_cache(seed=self.num_steps)
            except Exception:  # noqa: BLE001
                self.num_kv_mismatches += 1
                _log.exception("KV cache check could not run")
        self.timings["schedule"] += t1 - t0
        self.timings["execute"] += t2 - t1
        self.timings["sample"] += t3 - t2
        self.snapshot = self._stats()
        return outputs

    # ------------------------------------------------------------------ sampling
    @staticmethod
    def _targets(st: RequestState, seq_rows) -> list[tuple[int, int | None, Sequence, int]]:
        """What a sampling request draws this step: (index, parent index or None, the sequence whose tokens it
        continues, logits row); on its first token, n > 1 samples all continue the prompt's sequence."""
        targets = [(seq.index, None, seq, row) for seq, row in seq_rows]
        req, n = st.request, getattr(st.params, "n", 1)
        if st.beam is None and n > 1 and len(req.sequences) == 1 and not req.sequences[0].output_token_ids:
            parent, row = seq_rows[0]
            targets += [(index, parent.index, parent, row) for index in range(1, n)]
        return targets

    def _masks(self, targets: dict[str, list], errors: dict[str, str]) -> dict[str, torch.Tensor]:
        """request id -> bool [its targets (or beams), vocab]: the tokens each constrained sequence may take
        next, every matcher first brought to its sequence's tokens, one bitmask filled for the whole step. A
        request whose tokens its grammar refuses fails alone (in `errors`)."""
        wanted, spans = [], {}
        for request_id, its_targets in targets.items():
            matchers = self.structured.matchers(request_id)
            if matchers is None or request_id in errors:
                continue
            try:
                got = matchers.sync(
                    [(index, seq.token_ids[seq.num_prompt_tokens :]) for index, _, seq, _ in its_targets]
                )
            except ValueError as e:
                errors[request_id] = str(e)
                continue
            spans[request_id] = (len(wanted), len(got))
            wanted += got
        if not wanted:
            return {}
        allowed = self.structured.allowed(wanted)
        return {rid: allowed[a : a + k] for rid, (a, k) in spans.items()}

    def _sample_step(self, st: RequestState, targets, logits: torch.Tensor, update: RequestUpdate,
                     allowed: torch.Tensor | None = None) -> None:  # fmt: skip
        """Sample each of `targets` (`_targets`: the sequences it draws for this step)."""
        params: SamplingParams = st.params  # type: ignore[assignment]
        req = st.request
        for index, parent, _, _ in targets:
            if parent is not None:  # the samples share every prompt block (copy-on-write)
                self.outputs.new_seq_state(st, index)
        rows = [self.sampler.row(req.request_id, st.seed, index, params, seq.token_ids, seq.num_prompt_tokens,
                                 st.stop_token_ids, row) for index, _, seq, row in targets]  # fmt: skip
        matchers = self.structured.matchers(req.request_id)
        outs = [list(seq.token_ids[seq.num_prompt_tokens :]) for _, _, seq, _ in targets]
        if allowed is not None:  # each sample's mask on its row
            for r, mask in zip(rows, allowed, strict=True):
                r.allowed = mask
        sampled = self.sampler.sample(logits, rows)
        done = matchers.sync([(t[0], out + [tok.token_id]) for t, out, tok in zip(targets, outs, sampled)]) \
            if matchers is not None else [None] * len(targets)  # fmt: skip
        jump = self.config.jump_forward and params.logprobs is None  # (a forced token has no logprob of its own)
        for (index, parent, seq, _), tok, m in zip(targets, sampled, done, strict=True):
            reason, stop = self.outputs.accept(st, index, seq.token_ids, seq.num_prompt_tokens, tok)
            if reason is None and m is not None and m.terminated:  # (its stop token, taken though ignore_eos)
                reason = "stop"
            forced: list[int] = []
            found = forced_tokens(m, tok.token_id, self.tokenizer) if jump and reason is None and m is not None else []
            if found:  # each through the output's checks (the sequence's tokens copied only then)
                tokens = [*seq.token_ids, tok.token_id]
                for t in found:
                    forced.append(t)
                    reason, stop = self.outputs.accept(st, index, tokens, seq.num_prompt_tokens, SampledToken(t))
                    tokens.append(t)
                    if reason is not None:
                        break
            update.sequences.append(SeqUpdate(index, tok.token_id, parent, reason, stop, tuple(forced)))

    def _beam_step(self, st: RequestState, seq_rows, logits: torch.Tensor, update: RequestUpdate,
                   allowed: torch.Tensor | None = None) -> None:  # fmt: skip
        beam = st.beam
        assert beam is not None
        req = st.request
        masks = list(allowed) if allowed is not None else [None] * len(seq_rows)
        for (seq, row), mask in zip(seq_rows, masks, strict=True):
            beam.set_logits(seq, logits[row] if mask is None else logits[row].masked_fill(~mask, float("-inf")))
        if not beam.ready(req.live_sequences):
            return  # some beams are still catching up (after a recompute): wait for them
        plan = beam.step(req.live_sequences)
        # the scheduler forks first (while every parent still holds its blocks), then appends, then frees
        keep = set()
        for parent, token, index in plan.continue_:
            update.sequences.append(SeqUpdate(index, token, None if index == parent.index else parent.index))
            keep.add(index)
        for seq in req.live_sequences:  # pruned beams (all of them once done): blocks go back now
            if seq.index not in keep:
                update.sequences.append(SeqUpdate(seq.index, None, None, "stop" if plan.done else "abort"))
