"""Eviction policies for contexts longer than the KV budget: which whole blocks a sequence releases.

A policy is an object the core asks, never a name it tests: how long a prompt chunk may be
(`chunk_tokens`), how many slots a sequence holds before a step (`slots_upto`), how much of a
prompt admission may give slots and hits to (`admission_cap`), whether attention must sum its
softmax mass per block (`wants_mass`), whether positions are those inside the cache (`reposition`,
`unbounded`) and, after a step, where each block of the sequence goes (`place`: kept, demoted to a
lower precision of its `ladder`, or dropped). `NO_EVICTION` answers for requests that keep
everything. The per-sequence state (scores, sink copies, demoted blocks) lives in windows.py.

The policies work at block granularity on one sequence's block table; the KV-cache manager applies
their answer, leaving a hole in the table (tagged with the demoted copy's precision and block, if
any), and the attention backends see only the blocks that remain (windows.py: `attention_view`).

    StreamingLLM (Xiao et al., 2023): the first `sink_tokens` tokens ("attention sinks": most
        attention mass lands on them whatever they say) plus a window of the last `window_tokens`.
        Positions are those inside the cache, as the paper does: a sink key is seen from a query as
        if it sat just before the window, so no query ever sees a distance longer than the cache
        and generation runs past the model's trained context (the manager keeps the sink blocks
        rotated by the evicted length; kvpage/worker/kv_cache.py: `rotate_blocks`).
    H2O (Zhang et al., 2023): the `recent_tokens` most recent tokens plus `heavy_tokens` of "heavy
        hitters", the blocks that received the most attention so far (the attention backend sums
        each block's softmax mass over heads, queries and layers; the manager accumulates it).
        Positions stay the original ones (as in the paper), so H2O runs within the model's context.
    Demote (MiKV / ZipCache's direction: blocks demoted instead of dropped): H2O's ranking by
        attention mass, with a ladder below the heavy hitters: the best `hot_tokens` stay in the
        cache's precision, the next `int8_tokens` are kept in int8 (per token scales, as the int8
        cache), the next `int4_tokens` in int4 (KIVI's layout: keys per channel, values per token),
        the next `cpu_tokens` in int4 in host memory (the CPU tier rung: on a GPU it frees device
        memory; on a CPU device it is the same RAM, so it saves nothing there), the rest dropped.
        A block only ever moves down (a demoted copy cannot be made exact again); when a
        precision's pool is full, a block goes one rung lower. Positions as H2O's.

A block is evicted only when it is full and not the last: the window always keeps at least
`window_tokens` (`recent_tokens`) tokens, rounded up to whole blocks. Releasing a block drops this
sequence's reference only: a block other sequences share (prefix cache, forks, beams) stays theirs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpage.core.block import cdiv


class EvictionPolicy(Protocol):
    name: str
    evicts: bool  # False only for NO_EVICTION
    wants_mass: bool  # scored by the attention mass each block receives (the backends sum softmax)
    reposition: bool  # sink keys seen at cache positions (sink copies are kept rotated)
    unbounded: bool  # no distance longer than the cache: it may run past max_model_len

    def chunk_tokens(self, block_size: int) -> int | None: ...  # longest prompt chunk; None: no cap
    def admission_cap(self, block_size: int) -> int | None: ...  # tokens admitted with slots and hits
    def slots_upto(self, computed_after: int, num_tokens: int) -> int: ...  # slots held before a step
    def sink_blocks(self, block_size: int) -> int: ...
    def place(self, kept: Sequence[int], level: Mapping[int, int], num_tokens: int, block_size: int,
              scores: Sequence[float]) -> dict[int, int | None]: ...  # fmt: skip
    def describe(self) -> str: ...
    def budget_tokens(self, block_size: int) -> int | None: ...  # tokens held in the cache's own precision
    def window_blocks(self, block_size: int) -> int: ...  # blocks of its recent window (kept whatever the score)
    def quotas(self, block_size: int) -> tuple[int, ...]: ...  # blocks per level outside the window: own, rungs
    def demotes_to(self) -> tuple[str, ...]: ...  # the rungs of its ladder it has a quota for

    @property
    def ladder(self) -> tuple[str, ...]: ...  # the lower precisions a block may be demoted to, in order


def _dropping(policy, kept, level, num_tokens, block_size, scores) -> dict[int, int | None]:
    """`place` for a policy without a ladder: the blocks its `evict` answers are dropped."""
    return dict.fromkeys(policy.evict(kept, num_tokens, block_size, scores))


@dataclass(frozen=True, slots=True)
class NoEviction:
    """Keep every block: slots for all tokens at once, prompt chunks as long as the budget."""

    name = "none"
    evicts = False
    wants_mass = False
    reposition = False
    unbounded = False
    ladder = ()

    def chunk_tokens(self, block_size: int) -> int | None:
        return None

    def admission_cap(self, block_size: int) -> int | None:
        return None

    def slots_upto(self, computed_after: int, num_tokens: int) -> int:
        return num_tokens

    def sink_blocks(self, block_size: int) -> int:
        return 0

    def evict(self, kept: Sequence[int], num_tokens: int, block_size: int, scores: Sequence[float]) -> list[int]:
        return []

    def place(self, kept, level, num_tokens, block_size, scores) -> dict[int, int | None]:
        return {}

    def describe(self) -> str:
        return "none"

    def budget_tokens(self, block_size: int) -> int | None:
        return None

    def window_blocks(self, block_size: int) -> int:
        return 0

    def quotas(self, block_size: int) -> tuple[int, ...]:
        return ()

    def demotes_to(self) -> tuple[str, ...]:
        return ()


NO_EVICTION = NoEviction()


class _Bounded:
    """What the real policies answer alike: memory stays bounded, so a sequence holds slots only
    for what it computes next and is admitted with slots (and hits) for its budget only. Those
    that only drop answer `place` from their `evict`."""

    __slots__ = ()
    evicts = True
    ladder: tuple[str, ...] = ()

    def place(self, kept, level, num_tokens, block_size, scores) -> dict[int, int | None]:
        """{logical index: the level it goes to (1..len(ladder)), or None: dropped} for the blocks that move."""
        return _dropping(self, kept, level, num_tokens, block_size, scores)

    def slots_upto(self, computed_after: int, num_tokens: int) -> int:
        return computed_after

    def admission_cap(self, block_size: int) -> int | None:
        return self.budget_tokens(block_size)

    def budget_tokens(self, block_size: int) -> int:
        raise NotImplementedError

    def quotas(self, block_size: int) -> tuple[int, ...]:
        """Blocks per sequence at each level outside the window; () for a policy that only drops."""
        return ()

    def demotes_to(self) -> tuple[str, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class StreamingLLM(_Bounded):
    sink_tokens: int = 4
    window_tokens: int = 1020
    name = "streaming"
    wants_mass = False  # scores nothing: the attention backend need not sum its softmax
    reposition = True  # sink keys are seen at cache positions (the paper's choice)
    unbounded = True  # no distance longer than the cache: it may run past max_model_len

    def __post_init__(self) -> None:
        _positive_int("kv_eviction.sink_tokens", self.sink_tokens, 0)
        _positive_int("kv_eviction.window_tokens", self.window_tokens, 1)

    def budget_tokens(self, block_size: int) -> int:
        """Tokens a sequence holds before anything is evicted (sinks and window, in whole blocks)."""
        return (self.sink_blocks(block_size) + cdiv(self.window_tokens, block_size)) * block_size

    def sink_blocks(self, block_size: int) -> int:
        return cdiv(self.sink_tokens, block_size)

    def chunk_tokens(self, block_size: int) -> int:
        """The longest prompt chunk such a sequence runs in one step (the window, in whole blocks):
        each token of a chunk sees the sinks, the window and the chunk before it."""
        return cdiv(self.window_tokens, block_size) * block_size

    def evict(self, kept: Sequence[int], num_tokens: int, block_size: int, scores: Sequence[float]) -> list[int]:
        """Logical indices among `kept` (full, resident blocks) to release now."""
        sinks = self.sink_blocks(block_size)
        return [i for i in kept if i >= sinks and (i + 1) * block_size <= num_tokens - self.window_tokens]

    def describe(self) -> str:
        return f"streaming(sink_tokens={self.sink_tokens}, window_tokens={self.window_tokens})"

    def window_blocks(self, block_size: int) -> int:
        return cdiv(self.window_tokens, block_size)


@dataclass(frozen=True, slots=True)
class H2O(_Bounded):
    heavy_tokens: int = 512
    recent_tokens: int = 512
    name = "h2o"
    wants_mass = True  # scored by the attention mass each block receives (a torch path in the backends)
    reposition = False  # H2O keeps the original positions
    unbounded = False  # ... so it stays within the model's context

    def __post_init__(self) -> None:
        _positive_int("kv_eviction.heavy_tokens", self.heavy_tokens, 0)
        _positive_int("kv_eviction.recent_tokens", self.recent_tokens, 1)

    def budget_tokens(self, block_size: int) -> int:
        return (cdiv(self.heavy_tokens, block_size) + cdiv(self.recent_tokens, block_size)) * block_size

    def sink_blocks(self, block_size: int) -> int:
        return 0

    def chunk_tokens(self, block_size: int) -> int:
        return cdiv(self.recent_tokens, block_size) * block_size

    def evict(self, kept: Sequence[int], num_tokens: int, block_size: int, scores: Sequence[float]) -> list[int]:
        """The lowest-scored blocks outside the recent window, while more than `heavy_tokens` remain
        (ties: the older block goes first)."""
        old = [i for i in kept if (i + 1) * block_size <= num_tokens - self.recent_tokens]
        excess = len(old) - cdiv(self.heavy_tokens, block_size)
        if excess <= 0:
            return []
        return sorted(sorted(old, key=lambda i: (scores[i] if i < len(scores) else 0.0, i))[:excess])

    def describe(self) -> str:
        return f"h2o(heavy_tokens={self.heavy_tokens}, recent_tokens={self.recent_tokens})"

    def window_blocks(self, block_size: int) -> int:
        return cdiv(self.recent_tokens, block_size)


@dataclass(frozen=True, slots=True)
class Demote(_Bounded):
    hot_tokens: int = 256
    int8_tokens: int = 512
    int4_tokens: int = 1024
    recent_tokens: int = 256
    cpu_tokens: int = 0
    name = "demote"
    wants_mass = True  # ranked by attention mass, as H2O
    reposition = False
    unbounded = False
    ladder = ("int8", "int4", "cpu")  # levels 1, 2, 3; level 0 is the cache's own precision

    def __post_init__(self) -> None:
        for f in ("hot_tokens", "int8_tokens", "int4_tokens", "cpu_tokens"):
            _positive_int(f"kv_eviction.{f}", getattr(self, f), 0)
        _positive_int("kv_eviction.recent_tokens", self.recent_tokens, 1)

    def budget_tokens(self, block_size: int) -> int:
        """Tokens a sequence holds in the cache's own precision (the heavy hitters and the window)."""
        return (cdiv(self.hot_tokens, block_size) + cdiv(self.recent_tokens, block_size)) * block_size

    def quotas(self, block_size: int) -> tuple[int, ...]:
        """Blocks per sequence at each level outside the window: hot, int8, int4, cpu."""
        levels = (self.hot_tokens, self.int8_tokens, self.int4_tokens, self.cpu_tokens)
        return tuple(cdiv(t, block_size) for t in levels)

    def window_blocks(self, block_size: int) -> int:
        return cdiv(self.recent_tokens, block_size)

    def demotes_to(self) -> tuple[str, ...]:
        return tuple(p for p, t in zip(self.ladder, (self.int8_tokens, self.int4_tokens, self.cpu_tokens)) if t)

    def sink_blocks(self, block_size: int) -> int:
        return 0

    def chunk_tokens(self, block_size: int) -> int:
        return cdiv(self.recent_tokens, block_size) * block_size

    def place(self, kept, level, num_tokens, block_size, scores) -> dict[int, int | None]:
        """Blocks outside the recent window, best scored first (ties: the newer), each to the highest
        level at or below its own that has room left in the sequence's quotas; None past the last."""
        old = [i for i in kept if (i + 1) * block_size <= num_tokens - self.recent_tokens]
        room = list(self.quotas(block_size))
        moves: dict[int, int | None] = {}
        for i in sorted(old, key=lambda i: (-(scores[i] if i < len(scores) else 0.0), -i)):
            to = level.get(i, 0)
            while to < len(room) and room[to] == 0:
                to += 1
            if to < len(room):
                room[to] -= 1
            if to != level.get(i, 0):
                moves[i] = to if to < len(room) else None
        return moves

    def describe(self) -> str:
        return (f"demote(hot_tokens={self.hot_tokens}, int8_tokens={self.int8_tokens}, "
                f"int4_tokens={self.int4_tokens}, recent_tokens={self.recent_tokens}"
                + (f", cpu_tokens={self.cpu_tokens})" if self.cpu_tokens else ")"))  # fmt: skip


_KINDS: dict[str, type] = {"streaming": StreamingLLM, "streamingllm": StreamingLLM, "h2o": H2O, "demote": Demote}


def parse_eviction(spec: Any, field_name: str = "kv_eviction") -> StreamingLLM | H2O | Demote | None:
    """A policy from a policy object, None / "none", a mapping {"policy": "streaming", "sink_tokens": 4,
    "window_tokens": 1020}, or a string "streaming", "streaming:sink_tokens=4,window_tokens=1020",
    "h2o:heavy_tokens=256,recent_tokens=256", "demote:hot_tokens=64,int8_tokens=128,int4_tokens=256,
    recent_tokens=256". ValueError naming the field otherwise."""
    if spec is None or isinstance(spec, StreamingLLM | H2O | Demote):
        return spec
    if isinstance(spec, NoEviction):
        return None
    if isinstance(spec, str):
        kind, _, rest = spec.strip().partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not re.fullmatch(r"-?\d+", value.strip()):
                raise ValueError(f"{field_name}: expected name=integer, got {item!r}")
            params[key.strip()] = int(value)
        spec = {"policy": kind, **params}
    if not isinstance(spec, dict):
        raise ValueError(f"{field_name} must be a policy name, a mapping or None; got {spec!r}")
    params = dict(spec)
    kind = params.pop("policy", None)
    if not isinstance(kind, str):
        raise ValueError(f"{field_name}.policy must be 'streaming', 'h2o', 'demote' or 'none'; got {kind!r}")
    if kind.lower() == "none":
        if params:
            raise ValueError(f"{field_name}: policy 'none' takes no parameters")
        return None
    cls = _KINDS.get(kind.lower())
    if cls is None:
        raise ValueError(f"{field_name}.policy must be 'streaming', 'h2o', 'demote' or 'none'; got {kind!r}")
    known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"{field_name}: unknown field(s) for {cls.name}: {', '.join(unknown)}")
    return cls(**params)


def _positive_int(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
