"""Output processing: what a request has produced, as text and log-probabilities, and when it stops.

The engine samples; this module turns each sampled token into text (`tokenizers`' DecodeStream,
which never emits half a UTF-8 character), records log-probabilities, decides whether the sequence
stops (a stop token, a stop string that may span tokens, max_tokens, the context length), and
builds the `RequestOutput`s. It reads the scheduler's requests and never changes them: its
decisions travel to the scheduler as plain `SeqUpdate`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tokenizers.decoders import DecodeStream

from kvpage.core.request import Request, Sequence
from kvpage.engine.beam_search import BeamSearch
from kvpage.models.tokenizer import Tokenizer
from kvpage.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams
from kvpage.worker.sampler import SampledToken

_CONTEXT = 6  # prompt tokens fed to a new decode stream, so the first output token decodes right


@dataclass(slots=True)
class SeqState:
    stream: DecodeStream
    logprobs: list[PositionLogprobs] | None
    text: str = ""
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class RequestState:
    request: Request  # the scheduler's record: read here, written only by the scheduler
    params: SamplingParams | BeamSearchParams
    prompt: str | None
    seed: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    seqs: dict[int, SeqState] = field(default_factory=dict)  # by sequence index
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    beam: BeamSearch | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # the first step that ran it (its queue time ends)
    first_token_time: float | None = None
    last_token_time: float | None = None
    itl: list[float] = field(default_factory=list)  # inter-token latencies not yet reported


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the newest `num_new_chars` characters of `text`
    (so one that spans token boundaries is found once its last part arrives): (start, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start_search = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start_search)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def new_seq_state(self, st: RequestState, index: int) -> SeqState:
        params = st.params
        skip = getattr(params, "skip_special_tokens", True)
        want_lp = getattr(params, "logprobs", None) is not None
        stream = DecodeStream(ids=st.request.prompt_token_ids[-_CONTEXT:], skip_special_tokens=skip)
        ss = SeqState(stream, [] if want_lp else None)
        st.seqs[index] = ss
        return ss

    # ------------------------------------------------------------------ one sampled token
    def accept(self, st: RequestState, index: int, tokens_before: list[int], num_prompt: int, tok: SampledToken):
        """Record `tok` for sequence `index` (whose tokens were `tokens_before`): text and logprobs.
        Returns (finish_reason, stop_reason), both None while the sequence goes on."""
        ss = st.seqs[index]
        if tok.logprob is not None:
            ss.cumulative_logprob += tok.logprob
            if ss.logprobs is not None:
                ss.logprobs.append(self.position_logprobs(tok.token_id, tok.logprob, tok.rank, tok.top))
        delta = ss.stream.step(self.tokenizer.backend, tok.token_id) or ""
        ss.text += delta
        params = st.params
        n_out = len(tokens_before) + 1 - num_prompt
        if tok.token_id in st.stop_token_ids:
            eos = tok.token_id in self.tokenizer.eos_token_ids and tok.token_id not in (params.stop_token_ids or ())
            return "stop", None if eos else tok.token_id
        stops = getattr(params, "stop", None)
        if stops and delta and n_out >= getattr(params, "min_tokens", 0):
            hit = find_stop_string(ss.text, len(delta), stops)
            if hit is not None:
                start, stop = hit
                ss.text = ss.text[: start + len(stop) if params.include_stop_str_in_output else start]
                return "stop", stop
        full = len(tokens_before) + 1 >= self.max_model_len and not st.request.unbounded  # StreamingLLM runs on
        if n_out >= st.max_tokens or full:
            return "length", None
        return None, None

    def position_logprobs(self, token: int, logprob: float, rank: int | None, top) -> PositionLogprobs:
        decode = self.tokenizer.decode
        out = {token: Logprob(logprob, rank, decode([token], skip_special_tokens=False))}
        for i, (t, lp) in enumerate(top or []):
            if t not in out:
                out[t] = Logprob(lp, i + 1, decode([t], skip_special_tokens=False))
        return out

    def collect_prompt_logprobs(self, st: RequestState, num_computed: int, lp: torch.Tensor) -> None:
        """Rows of a prompt chunk's log-softmax that starts at position `num_computed`."""
        if st.prompt_logprobs is None:
            return
        prompt = st.request.prompt_token_ids
        k = st.params.prompt_logprobs or 0  # type: ignore[union-attr]
        for i in range(lp.shape[0]):  # row i predicts the token at position num_computed + i + 1
            pos = num_computed + i + 1
            if pos >= len(prompt) or pos < len(st.prompt_logprobs):
                continue  # past the prompt, or already collected before a recompute
            while len(st.prompt_logprobs) < pos:  # positions a prompt of segments copied: none computed
                st.prompt_logprobs.append(None)
            row = lp[i]
            tok = prompt[pos]
            top = torch.topk(row, k) if k else None
            st.prompt_logprobs.append(
                self.position_logprobs(
                    tok,
                    float(row[tok]),
                    int((row > row[tok]).sum()) + 1,
                    list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else None,
                )
            )

    # ------------------------------------------------------------------ outputs
    def note_token_time(self, st: RequestState, now: float) -> None:
        if st.first_token_time is None:
            st.first_token_time = now
        elif st.last_token_time is not None:
            st.itl.append(now - st.last_token_time)
        st.last_token_time = now

    def make_output(self, st: RequestState) -> RequestOutput:
        req = st.request
        if st.beam is not None:
            outs = st.beam.outputs(self.tokenizer, req)
        else:
            outs = []
            hold = max((len(s) for s in getattr(st.params, "stop", None) or []), default=1) - 1
            for seq in req.sequences:
                outs.append(self._completion(st, seq, hold))
        metrics = {"arrival_time": st.arrival_time, "first_scheduled_time": st.first_scheduled_time,
                   "first_token_time": st.first_token_time, "last_token_time": st.last_token_time,
                   "num_preemptions": req.num_preemptions, "inter_token_latencies": st.itl,
                   "n": getattr(st.params, "n", None) or getattr(st.params, "beam_width", 1),
                   "max_tokens": st.max_tokens}  # fmt: skip
        st.itl = []
        return RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=st.prompt_logprobs,
            outputs=outs,
            finished=req.finished or req.error is not None,
            error=req.error,
            rejected=req.rejected,
            num_cached_tokens=req.num_cached_tokens or 0,
            metrics=metrics,
        )

    def _completion(self, st: RequestState, seq: Sequence, hold: int) -> CompletionOutput:
        ss = st.seqs[seq.index]
        text = ss.text
        if not seq.finished and hold:
            text = text[: max(0, len(text) - hold)]  # a stop string may still be forming
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=ss.cumulative_logprob if ss.logprobs is not None else None,
            logprobs=ss.logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
