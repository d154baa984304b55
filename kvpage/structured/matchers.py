"""Each constrained sequence's grammar matcher, kept equal to the sequence's tokens, and the step's masks.

A matcher is a function of the tokens it has accepted, so it is never moved with a sequence: before a step reads a
sequence's mask, `sync` makes the sequence's matcher hold exactly the sequence's output tokens. It keeps the
matcher that holds a prefix of them (the common case: the one token sampled last step is added), else copies the
request's matcher holding the longest prefix (a sample forked from its parent, a beam continuing another) and feeds
the rest, else starts from the grammar. So forks, beams, preemption by recompute or swap, aborts and prefix-cache
hits need nothing of their own: the output tokens alone say where each matcher stands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class Matcher(Protocol):
    """What a grammar engine's matcher does (grammars.py adapts one)."""

    def accept(self, token: int) -> bool: ...  # False: the grammar does not allow it (the matcher is unchanged)
    def fill(self, bitmask: Any, row: int) -> None: ...  # row `row` of the bitmask: the tokens allowed next
    def copy(self) -> Matcher: ...
    def forced_text(self) -> str: ...  # the text the grammar allows as the only continuation ("" if none)
    @property
    def terminated(self) -> bool: ...  # the grammar is complete and a stop token was accepted


@dataclass(slots=True)
class _Held:
    matcher: Matcher
    tokens: list[int] = field(default_factory=list)  # the tokens it accepted, in order


class RequestMatchers:
    """The matchers of one request's sequences (by sequence index), made from its compiled grammar."""

    def __init__(self, new_matcher) -> None:
        self._new = new_matcher  # () -> a Matcher at the grammar's start
        self._held: dict[int, _Held] = {}

    def sync(self, wanted: Sequence[tuple[int, Sequence[int]]]) -> list[Matcher]:
        """For each (sequence index, its output tokens), a matcher holding exactly those tokens. Each starts from
        the matcher (as the step began) that holds the longest prefix of them: used in place where no other
        sequence starts from it, copied where several do (samples forked from one parent, beams continuing one
        beam), made new where none does. A token the grammar refuses raises ValueError (only a token its mask
        forbade could be one)."""
        before = list(self._held.items())
        starts = [max(((i, h) for i, h in before if list(tokens[: len(h.tokens)]) == h.tokens),
                      key=lambda ih: len(ih[1].tokens), default=None) for _, tokens in wanted]  # fmt: skip
        uses: dict[int, int] = {}
        for start in starts:
            if start is not None:
                uses[start[0]] = uses.get(start[0], 0) + 1
        held: dict[int, _Held] = {i: h for i, h in before if i not in uses}  # (those no sequence starts from)
        out = []
        for (index, tokens), start in zip(wanted, starts, strict=True):
            if start is None:
                h = _Held(self._new())
            elif uses[start[0]] == 1:
                h = start[1]
            else:
                h = _Held(start[1].matcher.copy(), list(start[1].tokens))
            for t in list(tokens)[len(h.tokens) :]:
                if not h.matcher.accept(t):
                    raise ValueError(f"token {t} is not allowed by the request's structured output constraint")
                h.tokens.append(t)
            held[index] = h
            out.append(h.matcher)
        self._held = held
        return out
