"""`LLMEngine`: the step-level engine. add_request / step / abort_request / has_unfinished_requests.

One step, data flowing one way:

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> logits
    -> per request: sample (or a beam step); OutputProcessor: text, logprobs, stop checks
    -> RequestUpdate (forks, tokens, finished sequences) -> Scheduler.update_from_output()
    -> StepResult (finished, failed) -> RequestOutput for every request that advanced or ended

Sampling policy lives here; block policy in the scheduler and the KV-cache manager; text in the
output processor. Bad parameters raise ValueError in add_request; a step that still fails fails
only the requests it concerns (the whole batch if the model raised, else the one request).
"""

from __future__ import annotations

import logging
import random
import time

import torch

from kvpage.config import EngineConfig
from kvpage.core import CacheStats, KVCacheManager
from kvpage.core.request import Request, Sequence
from kvpage.core.scheduler import Scheduler
from kvpage.core.scheduler_output import SchedulerOutput
from kvpage.core.step_update import RequestUpdate, SeqUpdate, StepResult
from kvpage.engine.beam_search import BeamSearch
from kvpage.engine.kv_verifier import KVVerifyReport, verify_kv_cache
from kvpage.engine.output_processor import OutputProcessor, RequestState
from kvpage.models import choose_dtype, load_model, parse_dtype
from kvpage.models.batch_invariant import make_batch_invariant
from kvpage.outputs import RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams
from kvpage.worker.gpu_memory import profile_kv_budget
from kvpage.worker.kv_cache import KVCache, kv_dtype_name
from kvpage.worker.model_runner import ModelRunner, ModelRunnerOutput
from kvpage.worker.sampler import SamplingRow, sample

DEFAULT_KV_CACHE_MEMORY = 512 * 2**20
_log = logging.getLogger("kvpage")


def describe_kernels(chosen: str, asked: str) -> str:
    """What runs the attention and per-layer math, for the start-up line."""
    if chosen == "cpu":
        return "compiled CPU kernels"
    if chosen == "triton":
        from kvpage.attention.triton_paged import interpreted

        return "Triton kernels" + (" (in Triton's interpreter)" if interpreted() else "")
    if asked == "auto":
        from kvpage.ops import unavailable_reason

        why = unavailable_reason()
        return f"torch reference ({why})" if why else "torch reference (not a CPU device)"
    return "torch reference"


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.dtype_name, self.dtype_reason = choose_dtype(config.dtype, config.device)  # "auto" resolved here
        dtype = parse_dtype(self.dtype_name)
        loaded = load_model(config.model, dtype=dtype, device=config.device, backend=config.attention_backend,
                            weight_dtype=config.weight_dtype)  # fmt: skip
        if loaded.tokenizer is None:
            raise ValueError(f"model {config.model!r} has no tokenizer; kvpage needs one to serve text")
        if config.deterministic:
            make_batch_invariant(loaded.model)
        self.model_config = loaded.config
        self.kernels = describe_kernels(loaded.model.attention_backend.name, config.attention_backend)
        if config.weight_dtype:
            self.kernels += f"; {config.weight_dtype} weights"
        if config.deterministic:
            self.kernels += "; deterministic (batch-invariant kernels)"
        if config.kv_cache_dtype != "auto":
            torch_path = config.kv_cache_dtype == "fp8" and self.kernels != "torch reference"
            self.kernels += f"; {config.kv_cache_dtype} KV cache" + (
                " (attention on the torch path)" if torch_path else ""
            )
        self.tokenizer = loaded.tokenizer
        block_size = config.block_size
        per_block = KVCache.bytes_per_block(loaded.config, block_size, dtype, config.kv_cache_dtype)
        self.kv_dtype_name = kv_dtype_name(config.kv_cache_dtype, dtype)
        self.bytes_per_block = per_block
        self.kv_pool_note = ""
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            memory = config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
            if config.kv_cache_memory is None and torch.device(config.device).type == "cuda":
                memory, self.kv_pool_note = profile_kv_budget(
                    loaded.model, loaded.config, config.device, dtype, block_size, config.max_num_batched_tokens,
                    config.max_num_seqs, config.kv_cache_dtype, config.gpu_memory_utilization,
                )  # fmt: skip
            num_blocks = int(memory) // per_block
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory={memory} bytes holds no block of {per_block} bytes")
            if self.kv_pool_note:
                self.kv_pool_note += f" = {num_blocks} blocks of {block_size} tokens ({per_block} bytes each)"
        num_cpu_blocks = int(config.swap_space) // per_block
        num_tier_blocks = int(config.cpu_offload_memory) // per_block
        capacity = num_blocks * block_size
        context = loaded.config.max_position_embeddings
        max_model_len = config.max_model_len or min(context, capacity)
        if max_model_len > context:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length {context}")
        if max_model_len > capacity and not config.kv_eviction.evicts:  # (evicting requests stay within their budget)
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the KV cache's capacity of {capacity} tokens "
                f"({num_blocks} blocks of {block_size}); raise kv_cache_memory / num_kv_blocks or lower max_model_len"
            )
        self.max_model_len = max_model_len
        self.kv_manager = KVCacheManager(
            num_blocks,
            block_size,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark=config.watermark,
            bytes_per_block=per_block,
            num_tier_blocks=num_tier_blocks,
        )
        self.kv_cache = KVCache(loaded.config, num_blocks, block_size, dtype, config.device, num_cpu_blocks,
                                config.kv_cache_dtype, num_tier_blocks,
                                backend=loaded.model.attention_backend)  # fmt: skip
        self.runner = ModelRunner(loaded.model, self.kv_cache, config.device)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=config.preemption_mode,
        )
        self.outputs = OutputProcessor(self.tokenizer, max_model_len)
        self._states: dict[str, RequestState] = {}
        self._arrivals = 0
        self._rng = random.Random(config.seed)
        self.num_prompt_tokens = 0  # counters read by /metrics
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.timings = {"schedule": 0.0, "execute": 0.0, "sample": 0.0}
        self.num_kv_verified_blocks = 0  # counted by verify_kv_cache, read by /metrics
        self.num_kv_mismatches = 0  # (a periodic check that could not run counts as one)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Bad parameters raise ValueError here, before any block is taken; a
        request that cannot fit the cache is accepted and ends with an error output instead."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise ValueError(f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        is_beam = isinstance(params, BeamSearchParams)
        width = params.beam_width if is_beam else params.n
        self.check_width("beam_width" if is_beam else "n", width)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name, None)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {k}")
        bad_stops = [t for t in (getattr(params, "stop_token_ids", None) or ()) if t >= vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids: token id {bad_stops[0]} is outside the vocabulary [0, {vocab})")
        bad_bias = [t for t in (getattr(params, "logit_bias", None) or ()) if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias: token id {bad_bias[0]} is outside the vocabulary [0, {vocab})")
        want_plp = not is_beam and params.prompt_logprobs is not None
        eviction = self.config.kv_eviction if params.kv_eviction is None else params.kv_eviction
        if self.config.deterministic and eviction.wants_mass:
            raise ValueError(
                "kv_eviction: h2o does not go with deterministic=True (its attention mass takes the torch path)"
            )
        req = Request(request_id, ids, self._arrivals, cache_salt=cache_salt, use_prefix_cache=not want_plp,
                      want_prompt_logprobs=want_plp, width=width, eviction=eviction,
                      independent=not is_beam and width > 1 and not eviction.evicts)  # fmt: skip
        self._arrivals += 1
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        extra_stops = set() if is_beam else set(params.stop_token_ids or ())
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
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
            limit = st.max_tokens if req.unbounded else max(1, min(st.max_tokens, self.max_model_len - len(ids)))
            st.beam = BeamSearch(params.beam_width, params.length_penalty, limit, st.stop_token_ids)
        self.outputs.new_seq_state(st, 0)
        self.scheduler.add_request(req)  # one that can never be scheduled is reported by the next step
        self._states[request_id] = st
        self.num_prompt_tokens += len(ids)

    def check_width(self, name: str, width: int) -> None:
        """ValueError unless `width` sequences of one request can run in the same step."""
        cfg = self.config
        limits = (("max_num_seqs", cfg.max_num_seqs), ("max_num_batched_tokens", cfg.max_num_batched_tokens))
        for limit_name, limit in limits:
            if width > limit:
                raise ValueError(
                    f"{name}={width}: its {width} sequences run in the same step, but {limit_name}={limit}"
                )

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks go back to the pool. Unknown ids are ignored."""
        if self._states.pop(request_id, None) is not None:
            self.scheduler.abort_request(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether the request is still running (queued, running or swapped out)."""
        return request_id in self._states

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's; False (nothing changes) while requests are unfinished."""
        return not self._states and self.kv_manager.reset_prefix_cache()

    def cache_stats(self) -> CacheStats:
        return self.kv_manager.stats()

    def verify_kv_cache(self, sample: int = 4, seed: int = 0) -> KVVerifyReport:
        """Check the blocks in use (finite, in range) and, in deterministic mode, recompute `sample`
        cached prefix chains and compare them bit for bit (engine/kv_verifier.py). Between steps only."""
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
            raise ValueError(f"sample must be an integer >= 0, got {sample!r}")
        report = verify_kv_cache(self, sample, seed)
        self.num_kv_verified_blocks += report.blocks_checked
        self.num_kv_mismatches += len(report.mismatches)
        for m in report.mismatches:
            _log.warning("KV cache check: %s", m)
        return report

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        try:
            run = self.runner.execute(sched) if sched.has_work else ModelRunnerOutput([], torch.empty(0))
        except Exception as e:  # noqa: BLE001 - the batch fails, the engine goes on
            result = self.scheduler.fail_step(sched, f"the model step failed: {type(e).__name__}: {e}")
            return self._finish_step(result, {}, (t0, t1, time.perf_counter()))
        t2 = time.perf_counter()
        updates, advanced = self._process(sched, run)
        result = self.scheduler.update_from_output(sched, updates, run.attention_mass)
        return self._finish_step(result, advanced, (t0, t1, t2))

    def _process(self, sched: SchedulerOutput, run: ModelRunnerOutput):
        """The engine's decisions for every request that produced logits: sample or beam-step, then
        text and stop checks. A request whose processing raises fails alone."""
        errors: dict[str, str] = {}
        for s in sched.sequences:
            lp = run.prompt_logprobs.get(s.seq_id)
            st = self._states.get(s.seq_id.request_id)  # type: ignore[attr-defined]
            if lp is not None and st is not None:
                try:
                    self.outputs.collect_prompt_logprobs(st, s.num_computed, lp)
                except Exception as e:  # noqa: BLE001 - this request fails alone
                    errors[st.request.request_id] = f"prompt logprobs failed: {type(e).__name__}: {e}"
        rows: dict[str, list[tuple[Sequence, int]]] = {}
        for row, key in enumerate(run.seq_ids):
            st = self._states.get(key.request_id)  # type: ignore[attr-defined]
            if st is not None:
                rows.setdefault(key.request_id, []).append((st.request.sequences[key.index], row))  # type: ignore[attr-defined]
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
                    self._beam_step(st, seq_rows, run.logits, update)
                else:
                    self._sample_step(st, seq_rows, run.logits, update)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                update = RequestUpdate(request_id, error=f"request {request_id!r} failed: {type(e).__name__}: {e}")
            updates[request_id] = update
            if update.sequences:
                self.outputs.note_token_time(st, now)
                self.num_generation_tokens += sum(u.token_id is not None for u in update.sequences)
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
        outputs = [self.outputs.make_output(st) for st in advanced.values()]
        for out in outputs:
            if out.finished:
                self._states.pop(out.request_id, None)
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
        return outputs

    # ------------------------------------------------------------------ sampling
    def _sample_step(self, st: RequestState, seq_rows, logits: torch.Tensor, update: RequestUpdate) -> None:
        params: SamplingParams = st.params  # type: ignore[assignment]
        req = st.request
        # (index, parent index or None, the sequence whose tokens it continues, logits row)
        targets = [(seq.index, None, seq, row) for seq, row in seq_rows]
        if params.n > 1 and len(req.sequences) == 1 and not req.sequences[0].output_token_ids:
            parent, row = seq_rows[0]
            for index in range(1, params.n):  # the samples share every prompt block (copy-on-write)
                self.outputs.new_seq_state(st, index)
                targets.append((index, parent.index, parent, row))
        rows = [self._sampling_row(st, index, seq, row) for index, _, seq, row in targets]
        for (index, parent, seq, _), tok in zip(targets, sample(logits, rows), strict=True):
            reason, stop = self.outputs.accept(st, index, seq.token_ids, seq.num_prompt_tokens, tok)
            update.sequences.append(SeqUpdate(index, tok.token_id, parent, reason, stop))

    def _sampling_row(self, st: RequestState, index: int, seq: Sequence, row: int) -> SamplingRow:
        p: SamplingParams = st.params  # type: ignore[assignment]
        out_ids = seq.output_token_ids
        return SamplingRow(
            logits_row=row,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens] if p.repetition_penalty != 1.0 else [],
            output_token_ids=out_ids,
            banned_token_ids=sorted(st.stop_token_ids) if len(out_ids) < p.min_tokens else [],
            generator=st.seqs[index].generator,
            num_logprobs=p.logprobs,
            logit_bias=p.logit_bias,
        )

    def _beam_step(self, st: RequestState, seq_rows, logits: torch.Tensor, update: RequestUpdate) -> None:
        beam = st.beam
        assert beam is not None
        req = st.request
        for seq, row in seq_rows:
            beam.set_logits(seq, logits[row])
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
