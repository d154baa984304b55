"""The answer to "can this request's blocks be allocated?": now, later, or never."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AdmissionStatus(enum.Enum):
    NOW = "now"  # enough free blocks, watermark kept
    LATER = "later"  # would fit once other sequences release blocks
    NEVER = "never"  # would not fit even in an empty pool; the request must be failed


@dataclass(slots=True, frozen=True)
class Admission:
    status: AdmissionStatus
    blocks_needed: int  # blocks to allocate (prefix-cache hits excluded)
    blocks_available: int  # free blocks that may be used now, watermark already held back
    reason: str | None = None  # set for NEVER: a sentence for the user

    @property
    def ok(self) -> bool:
        return self.status is AdmissionStatus.NOW
