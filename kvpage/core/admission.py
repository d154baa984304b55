"""The answer to "can this request's sequences get their blocks?": now, later, or never — and how.

A request enters the cache as a group: its lead sequence (the first live one) takes the longest
cached prefix of its tokens, and every other sequence (parallel samples or beams brought back after
a recompute) shares the lead's leading full blocks as far as their tokens agree:

    lead   [h0][h1][l2][l3.]       h = prefix-cache hit, l = new block of the lead
    sib 1  [h0][h1][l2][s3][s4.]   shares 3 blocks with the lead, owns 2
    sib 2  [h0][h1][t2.]           shares 2, owns 1

`blocks_needed` counts the new blocks of all of them together; it is the only admission arithmetic
in kvpage (the scheduler asks, never recounts).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpage.core.kv_cache_manager import CachedPrefix


class AdmissionStatus(enum.Enum):
    NOW = "now"  # enough free blocks, watermark kept
    LATER = "later"  # would fit once other sequences release blocks
    NEVER = "never"  # would not fit even in an empty pool; the request must be failed


@dataclass(slots=True)
class Admission:
    status: AdmissionStatus
    blocks_needed: int  # new blocks for the whole group (hits and blocks shared with the lead excluded)
    blocks_available: int  # free blocks that may be used now, watermark already held back
    reason: str | None = None  # set for NEVER: a sentence for the user
    prefix: CachedPrefix | None = None  # the lead's hits, valid until the pool changes
    shared_blocks: list[int] = field(default_factory=list)  # per sequence: leading blocks shared with the lead

    @property
    def ok(self) -> bool:
        return self.status is AdmissionStatus.NOW
