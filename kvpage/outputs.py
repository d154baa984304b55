"""What the engine returns, with vLLM's names: RequestOutput, CompletionOutput, Logprob."""

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
