"""Request bodies of the OpenAI API that kvpage serves, validated by pydantic.

Types are strict where a wrong type would otherwise be coerced silently ("max_tokens": "10" is an
error, as it is for OpenAI). Every string must be valid Unicode (a lone surrogate such as "\\ud800"
is a 400 naming the field). Fields that OpenAI accepts but kvpage does not act on are ignored;
the README's API section lists both kinds, and vLLM's extensions. A request field none of these
models knows is ignored too, as vLLM ignores it, and named as vLLM names it: a warning in the log,
and (app.py) the response's x-kvpage-ignored-fields header.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from kvpage.sampling_params import MAX_LOGPROBS

log = logging.getLogger("kvpage.server")
MAX_N = 16
MAX_NAMED_FIELDS = 16  # an ignored-fields list is cut there (a body may hold thousands of keys)
Number = StrictFloat  # a JSON number: integers are taken (as floats), booleans and strings are not


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode ({e.reason} at index {e.start})") from None
    return s


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]

TOKEN_ID = {"type": "integer", "minimum": 0, "x-kvpage-token-id": True}  # openapi.py adds the vocabulary's maximum
NULL = {"type": "null"}


def _doc(description: str, *any_of: dict) -> dict:
    """A field's rules in the OpenAPI document, as the server checks them: in words, and as JSON Schema
    (`any_of`, replacing what pydantic derives from the type) where JSON Schema can say it."""
    extra = {"description": description}
    if any_of:
        extra["json_schema_extra"] = {"anyOf": list(any_of)}
    return extra


class _Request(BaseModel):
    """A request body: an unknown top-level field is ignored, listed in `ignored_fields` and logged."""

    model_config = ConfigDict(extra="ignore")
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _name_ignored(cls, data, handler):
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            ignored = sorted(str(k) for k in data if k not in known)
            if ignored:
                result._ignored = ignored
                more = f" and {len(ignored) - MAX_NAMED_FIELDS} more" if len(ignored) > MAX_NAMED_FIELDS else ""
                log.warning("The following fields were present in the request but ignored: %r%s",
                            ignored[:MAX_NAMED_FIELDS], more)  # fmt: skip
        return result

    @property
    def ignored_fields(self) -> list[str]:
        """The body's top-level fields that no field of this request is (sorted)."""
        return self._ignored


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema under `schema` (a name, as OpenAI requires)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Text = Field(max_length=64)
    description: Text | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: given exactly when type is json_schema")
        return self


class _Common(_Request):
    model: Text | None = Field(None, description="the served model's name; left out: the served model (vLLM's)")
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    stop: Text | list[Text] | None = Field(None, **_doc(
        "up to 4 non-empty strings", {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}, NULL))  # fmt: skip
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI's and vLLM's
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[Text, Number] | None = Field(None, **_doc(
        "token id of the vocabulary (as a decimal string) -> bias in [-100, 100]; not with use_beam_search",
        {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
         "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}, NULL))  # fmt: skip
    stream: StrictBool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: Text | None = None
    # vLLM's extensions
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = Field(None, **_doc(
        "token ids of the vocabulary", {"type": "array", "items": TOKEN_ID}, NULL))  # fmt: skip
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="not with use_beam_search")
    use_beam_search: StrictBool = False  # n is the beam width
    length_penalty: Number = 1.0
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool | None = None  # logprobs name tokens "token_id:N" (default: the server's)
    cache_salt: Text | None = Field(None, min_length=1)
    # kvpage's extension: this request's eviction policy (core/eviction/), e.g. {"policy": "streaming",
    # "sink_tokens": 4, "window_tokens": 1020} or "h2o:heavy_tokens=256,recent_tokens=256" or "none"
    kv_eviction: Text | dict[Text, Text | StrictInt] | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs (one of them)
    response_format: ResponseFormat | None = Field(None, description="text, json_object, or json_schema with a schema")
    guided_json: Text | dict | None = Field(None, description="vLLM's: a JSON schema the output follows")
    guided_regex: Text | None = Field(None, description="vLLM's: a regex the output matches")
    guided_choice: list[Text] | None = Field(None, description="vLLM's: the output is one of these strings")
    guided_grammar: Text | None = Field(None, description="vLLM's: an EBNF grammar (start rule `root`)")
    structured_outputs: dict | None = Field(None, description=(
        "vLLM's: one of json, regex, choice, grammar, json_object (and disable_any_whitespace)"))  # fmt: skip
    kv_read_budget: StrictInt | None = Field(None, ge=0, description=(
        "kvpage's: tokens each decode step may read of the KV cache past the first layers, the blocks "
        "chosen by their keys' bounds (Quest); 0 reads every block; default: the server's --kv-read-budget. "
        "Needs a server started with --kv-read-budget"))  # fmt: skip

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        if isinstance(v, list) and any(not s for s in v) or v == "":
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        out = {}
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
            out[int(key)] = float(bias)
        return out

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self


PROMPT_RULES = (
    "never empty (no empty text, no empty list), token ids of the vocabulary, at most "
    "--max-prompts-per-request prompts; its tokens plus max_tokens within the context (max_model_len)"
)


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]] | None = Field(None, **_doc(
        "a text, texts, token ids or lists of token ids (or give segments instead): " + PROMPT_RULES,
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": TOKEN_ID, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": TOKEN_ID, "minItems": 1}, "minItems": 1}))  # fmt: skip
    # kvpage's: one prompt given as segments (documents, then the question), each segment's own KV
    # reused wherever it stands (engine/segment_prompts.py)
    segments: list[Text | list[StrictInt]] | None = Field(None, **_doc(
        "kvpage's: instead of prompt, one prompt as segments (texts or token-id lists, concatenated): each "
        "segment after the first reuses its own cached KV where it stands, recomputing recompute_blocks "
        "blocks at its start; not with kv_eviction",
        {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "string", "minLength": 1}, {"type": "array", "items": TOKEN_ID, "minItems": 1}]}}))  # fmt: skip
    recompute_blocks: StrictInt = Field(1, ge=0, le=1024, description="kvpage's: with segments, the blocks "
                                        "at the start of each reused segment computed in the new context")  # fmt: skip
    recompute_ratio: Number = Field(0.0, ge=0.0, le=1.0, description="kvpage's: with segments, CacheBlend's "
                                   "selective recompute: the share of the reused tokens whose KV deviates most, "
                                   "recomputed in the new context (0: off)")  # fmt: skip
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=5, description="not with use_beam_search")
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.segments is None):
            raise ValueError("prompt: give either prompt or segments")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[Text, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: dict

    @field_validator("function")
    @classmethod
    def _name(cls, v):
        if not isinstance(v.get("name"), str):
            raise ValueError("function.name: the name of one of the tools")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, as an answer gave them
    tool_call_id: Text | None = None  # a tool message: the call it answers
    name: Text | None = None

    def template_dict(self) -> dict:
        """The message as chat templates read it: tool calls' arguments as objects (Hugging Face's convention)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(ValueError):  # (not JSON: left as the client sent it)
                        fn["arguments"] = json.loads(fn["arguments"])
                calls.append({**c, "function": fn})
            out["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:  # [{"type": "text", "text": ...}]
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(_valid_unicode(part["text"]))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: prefill the assistant's reply (continue_final_message with add_generation_prompt false), and
    # echo the final message's content before what is generated when it is the reply's role
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = Field(False, description="only with add_generation_prompt: false")
    echo: StrictBool = False
    max_tokens: StrictInt | None = Field(None, ge=1, description="the prompt's tokens plus it within the context")
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = Field(False, description="not with use_beam_search")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="only with logprobs: true")
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "none, auto (the default with tools; needs a server started with --tool-call-parser), required, or "
        "a named function; only with tools"))  # fmt: skip
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _tools(self):
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: When using `tool_choice`, `tools` must be set.")  # (vLLM's words)
        if not self.tools:
            self.tool_choice = "none"  # (as vLLM's: with no tools, nothing to call)
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function["name"] not in names:
                raise ValueError(f"tool_choice: {self.tool_choice.function['name']!r} is not one of the tools")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named: how the answer may call the tools."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true with add_generation_prompt (set it false)")
        return self

    @property
    def reply_role(self) -> str:
        """The role of the message the answer is: a new assistant turn, or the final message's own."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echoed(self) -> str:
        """The text `echo` puts before the generated text: the final message's, if it is the reply's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.reply_role else ""


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize: a prompt, or chat messages with the chat template applied."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = Field(False, description="only with add_generation_prompt: false")
    return_token_strs: StrictBool = Field(False, description="each token's piece of the vocabulary, as vLLM's")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true with add_generation_prompt (set it false)")
        return self


class DetokenizeRequest(_Request):
    """vLLM's POST /detokenize."""

    model: Text | None = None
    tokens: list[StrictInt] = Field(description="token ids of the vocabulary", json_schema_extra={"items": TOKEN_ID})


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: every 4xx and 5xx the server sends."""

    error: ErrorDetail
