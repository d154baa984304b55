"""Prompts given as segments (documents, then the question), whose KV is reused wherever each stands.

    LLM.generate([{"segments": [doc_a, doc_b, question], "recompute_blocks": 1}])

The prompt is the segments' tokens, concatenated: the first segment is encoded as a prompt is (BOS
included, if the model adds one), the others as plain text. What the cache does with it is
core/segments.py's: a segment after the first copies its own cached KV (a prompt of just that
segment, at positions 0, 1, ...) with keys rotated to where it stands, and `recompute_blocks`
blocks at its start are computed again in the new context (0: naive reuse). With `recompute_ratio`
r > 0 (CacheBlend, worker/selective.py) the copied tokens are recomputed too: all of them in the
first layers, then the share r whose KV deviated most.

A segment's own KV must be cached first. `SegmentCompiler` holds a request back until it is: each
reused segment whose full blocks are not all resident is prefilled alone, as an internal request
of its own (one token, never returned), and the request enters the scheduler once they have ended.
Two requests that need the same segment wait on the same internal request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpage.core.request import Request
from kvpage.core.segments import segment_spans


@dataclass(frozen=True, slots=True)
class SegmentedPrompt:
    segments: tuple[str | tuple[int, ...], ...]  # texts, or token-id lists
    recompute_blocks: int = 1  # blocks at the start of each reused segment computed in the new context
    # CacheBlend's selective recompute of the rest (0: off): the share of the copied tokens whose KV
    # deviates most, recomputed in the new context (worker/selective.py)
    recompute_ratio: float = 0.0

    @classmethod
    def parse(cls, segments, recompute_blocks=1, recompute_ratio=0.0) -> SegmentedPrompt:
        """From user input; ValueError naming the field when it is malformed."""
        if not isinstance(segments, list | tuple) or len(segments) < 1:
            raise ValueError("segments must be a non-empty list of strings or of token-id lists")
        out: list[str | tuple[int, ...]] = []
        for i, s in enumerate(segments):
            if isinstance(s, str):
                if not s:
                    raise ValueError(f"segments[{i}] is empty")
                out.append(s)
            elif isinstance(s, list | tuple) and s and all(isinstance(t, int) and not isinstance(t, bool) for t in s):
                out.append(tuple(s))
            else:
                raise ValueError(f"segments[{i}] must be a non-empty string or a non-empty list of token ids")
        if isinstance(recompute_blocks, bool) or not isinstance(recompute_blocks, int) or recompute_blocks < 0:
            raise ValueError(f"recompute_blocks must be an integer >= 0, got {recompute_blocks!r}")
        if (
            isinstance(recompute_ratio, bool)
            or not isinstance(recompute_ratio, int | float)
            or not (0.0 <= recompute_ratio <= 1.0)
        ):
            raise ValueError(f"recompute_ratio must be a number in [0, 1], got {recompute_ratio!r}")
        return cls(tuple(out), recompute_blocks, float(recompute_ratio))

    def encode(self, tokenizer) -> list[list[int]]:
        """Each segment's token ids: the first as a prompt (special tokens added), the rest as text."""
        return [
            list(s) if not isinstance(s, str) else tokenizer.encode(s, add_special_tokens=i == 0)
            for i, s in enumerate(self.segments)
        ]


def prompt_of(token_lists: Sequence[list[int]]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """The prompt's token ids and each segment's (start, length) in it."""
    spans = segment_spans([len(t) for t in token_lists])
    return [t for ids in token_lists for t in ids], spans


class SegmentCompiler:
    """Requests held until their reused segments' own KV is cached, and the internal requests that
    prefill those segments alone."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Request, set[str]]] = {}  # request id -> (request, compiles it waits on)
        self._compiling: dict[tuple, str] = {}  # (salt, segment tokens) -> the internal request prefilling it
        self._keys: dict[str, tuple] = {}  # internal request id -> its key above

    def missing(self, token_lists: Sequence[list[int]], resident, block_size: int,
                recompute_blocks: int) -> list[int]:  # fmt: skip
        """Indices of the segments a request would reuse whose full blocks are not all resident
        (`resident(tokens)`: how many leading full blocks are), and that hold a block to reuse."""
        out = []
        for i, tokens in enumerate(token_lists[1:-1], 1):
            full = len(tokens) // block_size
            if full > recompute_blocks and resident(tokens) < full:
                out.append(i)
        return out

    def compiling(self, cache_salt: str | None, tokens: list[int]) -> str | None:
        """The internal request already prefilling this segment, if any."""
        return self._compiling.get((cache_salt, tuple(tokens)))

    def start(self, compile_id: str, cache_salt: str | None, tokens: list[int]) -> None:
        key = (cache_salt, tuple(tokens))
        self._compiling[key], self._keys[compile_id] = compile_id, key

    def hold(self, req: Request, compile_ids: set[str]) -> None:
        self._held[req.request_id] = (req, set(compile_ids))

    def is_internal(self, request_id: str) -> bool:
        return request_id in self._keys

    def held(self, request_id: str) -> bool:
        return request_id in self._held

    def ended(self, compile_id: str) -> list[Request]:
        """An internal request ended (finished or failed): the held requests it releases."""
        key = self._keys.pop(compile_id, None)
        if key is not None:
            self._compiling.pop(key, None)
        released = []
        for rid, (req, waits) in list(self._held.items()):
            waits.discard(compile_id)
            if not waits:
                del self._held[rid]
                released.append(req)
        return released

    def release(self, request_id: str) -> list[str]:
        """A held request is aborted: it waits no more. Returns the internal requests nobody else waits on."""
        _, waits = self._held.pop(request_id, (None, set()))
        still = {c for _, w in self._held.values() for c in w}
        return sorted(waits - still)
