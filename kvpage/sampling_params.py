"""`SamplingParams` and `BeamSearchParams`, with vLLM's names. Every value is checked when the object
is made; a wrong or unknown field raises ValueError naming it, before any block is taken."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from kvpage.core.eviction import NO_EVICTION, EvictionPolicy, parse_eviction
from kvpage.errors import ParameterError
from kvpage.structured.params import StructuredOutputsParams, parse_structured_outputs

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: at most this many top log-probabilities per position


def _check_unknown(cls, kwargs: dict[str, Any], public_name: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown {public_name} field(s): {', '.join(unknown)}")


def _int(name: str, v: Any, lo: int | None = None, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
        raise ParameterError(
            _field(name), f"{name} must be an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}"
        )


def _float(name: str, v: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> None:
    """A finite number (NaN fails every comparison, so it is rejected before the bounds); with `lo`,
    also in [lo, hi], or (lo, hi] when `lo_open`; `hi` None: no upper bound."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise ParameterError(_field(name), f"{name} must be a number, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ParameterError(_field(name), f"{name} must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (lo_open and v == lo) or (hi is not None and v > hi)):
        bound = f"in {'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f"{'>' if lo_open else '>='} {lo}"
        raise ParameterError(_field(name), f"{name} must be {bound}, got {v!r}")


@dataclass(slots=True, kw_only=True)
class _SamplingFields:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top log-probabilities returned per generated token
    prompt_logprobs: int | None = None  # top log-probabilities returned per prompt token
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    # StreamingLLM / H2O for this request (core/eviction/): a policy, a mapping, a spec string such
    # as "streaming:sink_tokens=4,window_tokens=1020", or "none"; None: the engine's kv_eviction.
    # Parsed once, here: afterwards it is an EvictionPolicy (NO_EVICTION for "none") or None.
    kv_eviction: EvictionPolicy | Any = None
    # Tokens each decode step may read of the cache, the blocks chosen by their keys' bounds (Quest;
    # kvpage/attention/key_bounds.py): None, the engine's kv_read_budget; 0, every block.
    kv_read_budget: int | None = None
    # the output constrained to a JSON schema, a regex, a choice or a grammar (kvpage/structured/): the params
    # object or a mapping of its fields (vLLM's names); parsed here
    structured_outputs: StructuredOutputsParams | Any = None


class SamplingParams(_SamplingFields):
    __slots__ = ()

    def __init__(self, **kwargs: Any) -> None:
        _check_unknown(_SamplingFields, kwargs, "SamplingParams")
        super().__init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        _int("n", self.n, 1)
        _float("temperature", self.temperature, 0.0)
        _float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _int("top_k", self.top_k, -1)
        _float("min_p", self.min_p, 0.0, 1.0)
        _int("seed", self.seed, allow_none=True)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ParameterError("seed", f"seed must fit in a signed 64-bit integer, got {self.seed}")
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        _int("max_tokens", self.max_tokens, 1, allow_none=True)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (
            not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise ParameterError("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)
        ):
            raise ParameterError(
                "stop_token_ids", f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _int(name, value, 0, allow_none=True)
            if value is not None and value > MAX_LOGPROBS:
                raise ParameterError(_field(name), f"{name} must be <= {MAX_LOGPROBS}, got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParameterError(
                    "logit_bias", f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}"
                )
            for tok, bias in self.logit_bias.items():
                _int("logit_bias token id", tok, 0)
                _float(f"logit_bias[{tok}]", bias, -100.0, 100.0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(_field(name), f"{name} must be true or false, got {getattr(self, name)!r}")
        self.kv_eviction = parse_kv_eviction(self.kv_eviction)
        _int("kv_read_budget", self.kv_read_budget, 0, allow_none=True)
        self.structured_outputs = parse_structured_outputs(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def __repr__(self) -> str:
        changed = {f.name: getattr(self, f.name) for f in fields(_SamplingFields) if getattr(self, f.name) != f.default}
        return f"SamplingParams({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


@dataclass(slots=True, kw_only=True)
class _BeamFields:
    beam_width: int = 4
    max_tokens: int = 16
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    kv_eviction: EvictionPolicy | Any = None  # as SamplingParams.kv_eviction
    kv_read_budget: int | None = None  # as SamplingParams.kv_read_budget
    structured_outputs: StructuredOutputsParams | Any = None  # as SamplingParams.structured_outputs: every beam


class BeamSearchParams(_BeamFields):
    """Beam search as in transformers' generate(num_beams=beam_width, do_sample=False): see
    kvpage/engine/beam_search.py for the exact rules (length penalty, early stopping)."""

    __slots__ = ()

    def __init__(self, **kwargs: Any) -> None:
        _check_unknown(_BeamFields, kwargs, "BeamSearchParams")
        super().__init__(**kwargs)
        _int("beam_width", self.beam_width, 1)
        _int("max_tokens", self.max_tokens, 1)
        _float("length_penalty", self.length_penalty)
        if self.temperature != 0.0:
            raise ParameterError(
                "temperature", "temperature must be 0 for beam search (only deterministic beam search is supported)"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ParameterError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        self.kv_eviction = parse_kv_eviction(self.kv_eviction)
        _int("kv_read_budget", self.kv_read_budget, 0, allow_none=True)
        self.structured_outputs = parse_structured_outputs(self.structured_outputs)


def parse_kv_eviction(spec: Any) -> EvictionPolicy | None:
    """A request's `kv_eviction` as a policy: None stays None (the engine's choice applies), "none"
    is NO_EVICTION (it overrides an engine-wide policy). ValueError naming the field otherwise."""
    if spec is None:
        return None
    return parse_eviction(spec) or NO_EVICTION


def _field(name: str) -> str:
    """The request field a check's name is about: "logit_bias[3]" and "logit_bias token id" are logit_bias's."""
    return re.split(r"[\[ ]", name, maxsplit=1)[0]
