"""`LLMEngine`: the step-level engine. add_request / step / abort_request / has_unfinished_requests.

One step:

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> logits
    -> Scheduler.on_step_done()  (KV written: full blocks become prefix-cache hits)
    -> per request: sample (or a beam-search step), fork for n > 1, append, detokenize, stop checks
    -> RequestOutput for every request that advanced or finished

Sampling policy lives here; block policy lives in the scheduler and the KV-cache manager.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from kvpage.config import EngineConfig
from kvpage.core import CacheStats, KVCacheManager
from kvpage.core.request import Request, Sequence
from kvpage.core.scheduler import Scheduler
from kvpage.engine.beam_search import BeamSearch
from kvpage.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from kvpage.models import load_model, parse_dtype
from kvpage.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams
from kvpage.worker.kv_cache import KVCache
from kvpage.worker.model_runner import ModelRunner, ModelRunnerOutput
from kvpage.worker.sampler import SampledToken, SamplingRow, sample

DEFAULT_KV_CACHE_MEMORY = 512 * 2**20


@dataclass(slots=True)
class _SeqState:
    detok: IncrementalDetokenizer
    generator: torch.Generator
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class _RequestState:
    request: Request
    params: SamplingParams | BeamSearchParams
    prompt: str | None
    seed: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    seqs: dict[int, _SeqState] = field(default_factory=dict)  # by sequence index
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    beam: BeamSearch | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    itl: list[float] = field(default_factory=list)  # inter-token latencies not yet reported


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        dtype = parse_dtype(config.dtype)
        loaded = load_model(config.model, dtype=dtype, device=config.device, backend=config.attention_backend)
        if loaded.tokenizer is None:
            raise ValueError(f"model {config.model!r} has no tokenizer; kvpage needs one to serve text")
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        block_size = config.block_size
        per_block = KVCache.bytes_per_block(loaded.config, block_size, dtype)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            memory = config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
            num_blocks = int(memory) // per_block
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory={memory} bytes holds no block of {per_block} bytes")
        num_cpu_blocks = int(config.swap_space) // per_block
        capacity = num_blocks * block_size
        context = loaded.config.max_position_embeddings
        max_model_len = config.max_model_len or min(context, capacity)
        if max_model_len > context:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length {context}")
        if max_model_len > capacity:
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
        )
        self.kv_cache = KVCache(loaded.config, num_blocks, block_size, dtype, config.device, num_cpu_blocks)
        self.runner = ModelRunner(loaded.model, self.kv_cache, config.device)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=config.preemption_mode,
        )
        self._states: dict[str, _RequestState] = {}
        self._arrivals = 0
        self._rng = random.Random(config.seed)
        self.num_prompt_tokens = 0  # counters read by /metrics
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.timings = {"schedule": 0.0, "execute": 0.0, "sample": 0.0}

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
        want_plp = not is_beam and params.prompt_logprobs is not None
        req = Request(
            request_id,
            ids,
            self._arrivals,
            cache_salt=cache_salt,
            use_prefix_cache=not want_plp,
            want_prompt_logprobs=want_plp,
        )
        self._arrivals += 1
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        extra_stops = set() if is_beam else set(params.stop_token_ids or ())
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        st = _RequestState(
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
            limit = max(1, min(st.max_tokens, self.max_model_len - len(ids)))
            st.beam = BeamSearch(params.beam_width, params.length_penalty, limit, st.stop_token_ids)
        self._new_seq_state(st, 0)
        try:
            self.scheduler.add_request(req)
        except ValueError as e:  # too long for max_model_len: fails alone, reported by the next step
            req.error = str(e)
            req.sequences[0].finish_reason = "abort"
            self.scheduler.failed.append(req)
        self._states[request_id] = st
        self.num_prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks go back to the pool. Unknown ids are ignored."""
        st = self._states.pop(request_id, None)
        if st is not None:
            self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def cache_stats(self) -> CacheStats:
        return self.kv_manager.stats()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        advanced: dict[str, _RequestState] = {}
        for req in self.scheduler.failed:
            st = self._states.get(req.request_id)
            if st is not None:
                advanced[req.request_id] = st
        self.scheduler.failed.clear()
        if sched.sequences or sched.swap_in or sched.swap_out or sched.copies:
            run = self.runner.execute(sched)
        else:
            run = ModelRunnerOutput([], torch.empty(0), {})
        t2 = time.perf_counter()
        self.scheduler.on_step_done(sched)
        self._collect_prompt_logprobs(sched, run)
        by_request: dict[str, list[tuple[Sequence, int]]] = {}
        for row, seq_id in enumerate(run.seq_ids):
            req_id = seq_id.rsplit("#", 1)[0]
            st = self._states.get(req_id)
            if st is None:
                continue
            seq = st.request.sequence(seq_id)
            if seq is not None and not seq.finished:
                by_request.setdefault(req_id, []).append((seq, row))
        now = time.monotonic()
        for req_id, seq_rows in by_request.items():
            st = self._states[req_id]
            if st.beam is not None:
                self._beam_step(st, seq_rows, run.logits)
            else:
                self._sample_step(st, seq_rows, run.logits)
            advanced[req_id] = st
            if st.first_token_time is None:
                st.first_token_time = now
            elif st.last_token_time is not None:
                st.itl.append(now - st.last_token_time)
            st.last_token_time = now
        outputs = [self._make_output(st) for st in advanced.values()]
        for out in outputs:
            if out.finished:
                self._states.pop(out.request_id, None)
        t3 = time.perf_counter()
        self.num_steps += 1
        self.timings["schedule"] += t1 - t0
        self.timings["execute"] += t2 - t1
        self.timings["sample"] += t3 - t2
        return outputs

    # ------------------------------------------------------------------ sampling
    def _sample_step(self, st: _RequestState, seq_rows: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        params: SamplingParams = st.params  # type: ignore[assignment]
        req = st.request
        targets = list(seq_rows)
        if params.n > 1 and len(req.sequences) == 1 and not req.sequences[0].output_token_ids:
            parent, row = seq_rows[0]
            for index in range(1, params.n):  # the samples share every prompt block (copy-on-write)
                child = self.scheduler.fork(req, parent, index)
                self._new_seq_state(st, index)
                targets.append((child, row))
        rows = [self._sampling_row(st, seq, row) for seq, row in targets]
        sampled = sample(logits, rows)
        for (seq, _), tok in zip(targets, sampled, strict=True):
            self._accept(st, seq, tok)

    def _sampling_row(self, st: _RequestState, seq: Sequence, row: int) -> SamplingRow:
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
            generator=st.seqs[seq.index].generator,
            num_logprobs=p.logprobs,
        )

    def _accept(self, st: _RequestState, seq: Sequence, tok: SampledToken) -> None:
        """Append a sampled token to a sequence, detokenize it and decide whether the sequence stops."""
        ss = st.seqs[seq.index]
        self.scheduler.append_token(seq, tok.token_id)
        self.num_generation_tokens += 1
        if tok.logprob is not None:
            ss.cumulative_logprob += tok.logprob
            if ss.logprobs is not None:
                ss.logprobs.append(self._position_logprobs(tok.token_id, tok.logprob, tok.rank, tok.top))
        delta = ss.detok.add(tok.token_id)
        params = st.params
        n_out = len(seq.output_token_ids)
        if tok.token_id in st.stop_token_ids:
            eos = tok.token_id in self.tokenizer.eos_token_ids and tok.token_id not in (params.stop_token_ids or ())
            self.scheduler.finish_sequence(st.request, seq, "stop", None if eos else tok.token_id)
            return
        stops = getattr(params, "stop", None)
        if stops and delta and n_out >= getattr(params, "min_tokens", 0):
            hit = find_stop_string(ss.detok.text, len(delta), stops)
            if hit is not None:
                start, stop = hit
                keep = start + len(stop) if params.include_stop_str_in_output else start
                ss.detok.text = ss.detok.text[:keep]
                self.scheduler.finish_sequence(st.request, seq, "stop", stop)
                return
        if n_out >= st.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self.scheduler.finish_sequence(st.request, seq, "length")

    def _beam_step(self, st: _RequestState, seq_rows: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        beam = st.beam
        assert beam is not None
        for seq, row in seq_rows:
            beam.set_logits(seq, logits[row])
        if not beam.ready(st.request.live_sequences):
            return  # some beams are still catching up (after a recompute): wait for them
        plan = beam.step(st.request.live_sequences)
        req = st.request
        # forks first (while every parent still holds its blocks), then appends, then frees
        new_seqs = [
            (parent if index == parent.index else self.scheduler.fork(req, parent, index), token)
            for parent, token, index in plan.continue_
        ]
        keep = {seq.index for seq, _ in new_seqs}
        for seq in list(req.live_sequences):  # pruned beams (all of them once done): blocks go back now
            if seq.index not in keep:
                self.scheduler.finish_sequence(req, seq, "stop" if plan.done else "abort")
        for seq, token in new_seqs:
            self.scheduler.append_token(seq, token)
            self.num_generation_tokens += 1

    # ------------------------------------------------------------------ outputs
    def _new_seq_state(self, st: _RequestState, index: int) -> None:
        g = torch.Generator().manual_seed((st.seed * 1_000_003 + index) % 2**63)
        params = st.params
        skip = getattr(params, "skip_special_tokens", True)
        want_lp = getattr(params, "logprobs", None) is not None
        st.seqs[index] = _SeqState(
            IncrementalDetokenizer(self.tokenizer, st.request.prompt_token_ids, skip), g, [] if want_lp else None
        )

    def _position_logprobs(self, token: int, logprob: float, rank: int | None, top) -> PositionLogprobs:
        decode = self.tokenizer.decode
        out = {token: Logprob(logprob, rank, decode([token], skip_special_tokens=False))}
        for i, (t, lp) in enumerate(top or []):
            if t not in out:
                out[t] = Logprob(lp, i + 1, decode([t], skip_special_tokens=False))
        return out

    def _collect_prompt_logprobs(self, sched, run: ModelRunnerOutput) -> None:
        for s in sched.sequences:
            lp = run.prompt_logprobs.get(s.seq_id)
            st = self._states.get(s.seq_id.rsplit("#", 1)[0])
            if lp is None or st is None or st.prompt_logprobs is None:
                continue
            prompt = st.request.prompt_token_ids
            k = st.params.prompt_logprobs or 0
            # row i predicts the token at position num_computed + i + 1
            for i in range(lp.shape[0]):
                pos = s.num_computed + i + 1
                if pos >= len(prompt) or pos < len(st.prompt_logprobs):
                    continue  # past the prompt, or already collected before a recompute
                row = lp[i]
                tok = prompt[pos]
                top = torch.topk(row, k) if k else None
                st.prompt_logprobs.append(
                    self._position_logprobs(
                        tok,
                        float(row[tok]),
                        int((row > row[tok]).sum()) + 1,
                        list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else None,
                    )
                )

    def _make_output(self, st: _RequestState) -> RequestOutput:
        req = st.request
        if st.beam is not None:
            outs = st.beam.outputs(self.tokenizer, req)
        else:
            outs = []
            hold = max((len(s) for s in getattr(st.params, "stop", None) or []), default=1) - 1
            for seq in sorted(req.sequences, key=lambda s: s.index):
                ss = st.seqs[seq.index]
                text = ss.detok.text
                if not seq.finished and hold:
                    text = text[: max(0, len(text) - hold)]  # a stop string may still be forming
                outs.append(
                    CompletionOutput(
                        index=seq.index,
                        text=text,
                        token_ids=list(seq.output_token_ids),
                        cumulative_logprob=ss.cumulative_logprob if ss.logprobs is not None else None,
                        logprobs=ss.logprobs,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
        metrics = {"arrival_time": st.arrival_time, "first_token_time": st.first_token_time,
                   "num_preemptions": req.num_preemptions, "inter_token_latencies": st.itl}  # fmt: skip
        st.itl = []
        finished = req.finished or req.error is not None
        return RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=st.prompt_logprobs,
            outputs=outs,
            finished=finished,
            error=req.error,
            metrics=metrics,
        )
