"""The grammar engine behind structured outputs: xgrammar (chosen by measuring it beside llguidance on SmolLM2's
vocabulary: benchmarks/grammar_engines.py, docs/structured-outputs.md).

`StructuredOutputs` is the engine's one owner of this: `check` tells at once whether a constraint can be compiled
(its schema, regex or grammar read without the vocabulary: milliseconds; ParameterError naming the field if not);
`submit` compiles it for the vocabulary in one worker thread, cached by the constraint, so a request waits for its
grammar and the batch never does; `start` gives a request its matchers (matchers.py); `masks` fills the step's
bitmask for every constrained sequence at once.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvpage.errors import ParameterError
from kvpage.structured.matchers import RequestMatchers
from kvpage.structured.params import PREFIX, StructuredOutputsParams

CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)


class _XGrammarMatcher:
    """xgrammar's GrammarMatcher as matchers.Matcher."""

    __slots__ = ("m",)

    def __init__(self, m) -> None:
        self.m = m

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def copy(self) -> _XGrammarMatcher:
        return _XGrammarMatcher(self.m.fork())

    def forced_text(self) -> str:
        return self.m.find_jump_forward_string()

    @property
    def terminated(self) -> bool:
        return bool(self.m.is_terminated())


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None  # xgrammar's GrammarCompiler over the vocabulary (made on first use: ~0.5 s)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvpage-grammar")
        self._requests: dict[str, RequestMatchers] = {}

    # ------------------------------------------------------------------ compiling
    def check(self, spec: StructuredOutputsParams) -> None:
        """ParameterError naming the field unless the grammar engine can read the constraint."""
        _grammar(spec)

    def submitted(self, spec: StructuredOutputsParams) -> bool:
        """Whether the constraint is compiled already (a check would only repeat what compiling found)."""
        with self._lock:
            fut = self._cache.get(spec.key())
        return fut is not None and fut.done() and fut.exception() is None

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The constraint compiled for the vocabulary (a Future; at once if it is cached)."""
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: StructuredOutputsParams):
        return self._get_compiler().compile_grammar(_grammar(spec))

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                stops = list(self.tokenizer.eos_token_ids)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=stops)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    # ------------------------------------------------------------------ requests
    def start(self, request_id: str, compiled) -> None:
        import xgrammar as xgr

        self._requests[request_id] = RequestMatchers(lambda: _XGrammarMatcher(xgr.GrammarMatcher(compiled)))

    def matchers(self, request_id: str) -> RequestMatchers | None:
        return self._requests.get(request_id)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def allowed(self, matchers: list) -> torch.Tensor:
        """bool [len(matchers), vocab]: the tokens each matcher allows next (one bitmask filled for all)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row, m in enumerate(matchers):
            m.fill(bitmask, row)
        return unpack_bitmask(bitmask, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_BITS = torch.arange(8, dtype=torch.uint8)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab] from xgrammar's int32 bitmask (bit j of word w: token 32 w + j). Read byte by byte (the
    words' bytes in memory order, little-endian): 9x faster here than shifting each int32 word 32 ways."""
    if sys.byteorder != "little":
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten(1)[:, :vocab_size].bool()
    as_bytes = bitmask.contiguous().view(torch.uint8)
    return ((as_bytes.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, :vocab_size].bool()


def _grammar(spec: StructuredOutputsParams):
    """The constraint as xgrammar's Grammar (read without the vocabulary: milliseconds); ParameterError naming the
    field if it cannot be read. The one place that dispatches on the constraint's kind."""
    import xgrammar as xgr

    read = {
        "json": lambda: xgr.Grammar.from_json_schema(json.dumps(spec.schema), **_json_options(spec)),
        "json_object": lambda: (
            xgr.Grammar.from_json_schema('{"type": "object"}', **_json_options(spec, strict=False))
            if spec.disable_any_whitespace
            else xgr.Grammar.builtin_json_grammar()
        ),
        "regex": lambda: xgr.Grammar.from_regex(spec.regex),
        "choice": lambda: xgr.Grammar.from_regex("|".join(re.escape(c) for c in spec.choice)),
        # (EBNF / GBNF with `root ::= ...`, or Lark's syntax with a `start:` rule, as vLLM takes both)
        "grammar": lambda: (
            xgr.Grammar.from_ebnf(spec.grammar) if "::=" in spec.grammar else xgr.Grammar.from_lark(spec.grammar)
        ),
        "structural_tag": lambda: xgr.Grammar.from_structural_tag(spec.structural_tag),
    }[spec.kind]
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - the engine's many error types: all mean "cannot compile this"
        field = f"{PREFIX}.{spec.kind}"
        raise ParameterError(field, f"{field} cannot be compiled: {_first_line(e)}") from None


def _json_options(spec: StructuredOutputsParams, strict: bool = True) -> dict[str, Any]:
    """xgrammar's options for vLLM's: compact JSON (no free whitespace). (Strict mode, as vLLM runs xgrammar: no
    properties or items a schema does not name unless it allows them; off for json_object: any object.)"""
    out: dict[str, Any] = {"strict_mode": strict}
    if spec.disable_any_whitespace:
        out |= {"any_whitespace": False, "separators": (",", ":")}
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
