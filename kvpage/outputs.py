"""What the engine returns, with vLLM's names: RequestOutput, CompletionOutput, Logprob, and for
`LLM.beam_search` BeamSearchOutput (a RequestOutput that also carries vLLM's `.sequences`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One position: token id -> Logprob (the chosen token, plus the top-k alternatives)
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the request failed alone (e.g. it can never fit)
    rejected: bool = False  # the error is the request's own: it can never run here (a 400, not a 500)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's; OpenAI's cached_tokens)
    metrics: dict = field(default_factory=dict)


@dataclass(slots=True)
class BeamSearchSequence:
    """One final beam as vLLM's offline `LLM.beam_search` gives it: `tokens` are the prompt's then the
    generated ones (the EOS included), `text` decodes all of them (special tokens kept), `logprobs`
    has one entry per generated token."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput(RequestOutput):
    """A beam search's RequestOutput (its `outputs` are the beams, best first, generated part only)
    with vLLM's `sequences`: the same beams in the same order as BeamSearchSequences."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
