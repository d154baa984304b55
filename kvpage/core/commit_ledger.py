"""What the step being scheduled added to the prefix cache, until it ran (commit) or failed (discard).

    uncommitted   blocks registered for the step: hittable in the same step (every layer writes
                  the step's K/V before any sequence attends), forgotten if the step fails
    written       keys the step writes through to the shared tier (announced at commit)
    pinned        sources of the step's partial-hit copies, referenced until it ends

One owner (prefix_registry.py) fills it; `end` empties it and hands back the pins to release.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.core.block import Block
from kvpage.core.cache_key import CacheKey


@dataclass(slots=True)
class CommitLedger:
    uncommitted: list[Block] = field(default_factory=list)
    written: list[CacheKey] = field(default_factory=list)
    pinned: list[Block] = field(default_factory=list)

    def unwritten_ids(self) -> set[int]:
        """Blocks whose KV the step being scheduled writes: never the source of a copy in that step."""
        return {b.block_id for b in self.uncommitted}

    def is_unwritten(self, block: Block) -> bool:
        return any(b is block for b in self.uncommitted)

    def end(self) -> list[Block]:
        """The step ended: empty the ledger; returns the pins to release."""
        pins = self.pinned
        self.uncommitted, self.written, self.pinned = [], [], []
        return pins
