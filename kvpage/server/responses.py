"""The bodies the server answers with, as pydantic models: documentation for /openapi.json (they are
never used to build or filter an answer; tests validate real answers against them, extra keys refused).
OpenAI's fields, then vLLM's extensions (always present in non-streamed answers, null when not asked)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Strict):
    cached_tokens: int  # prompt tokens served from the prefix cache (OpenAI's; vLLM's prompt tokens details)


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Strict):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Strict):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None] | None


class CompletionChoice(_Strict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(_Strict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Strict):
    content: list[TokenLogprob] | None


class ChatMessageOut(_Strict):
    role: str
    content: str | None


class ChatChoice(_Strict):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Strict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = None
    prompt_token_ids: list[int] | None = None


class ModelCard(_Strict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Strict):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Strict):
    prompt: str


class Health(_Strict):
    status: str
    error: str | None = None


class Version(_Strict):
    version: str


class ServerLoad(_Strict):
    server_load: int


RESPONSES = {  # path -> the model of its 200 answer (streams: text/event-stream of the chunks)
    "/v1/completions": CompletionResponse,
    "/v1/chat/completions": ChatCompletionResponse,
    "/v1/models": ModelList,
    "/tokenize": TokenizeResponse,
    "/detokenize": DetokenizeResponse,
    "/health": Health,
    "/version": Version,
    "/load": ServerLoad,
}
