"""Eviction for contexts longer than the KV budget: the policies (policies.py) and the
per-sequence windows the KV-cache manager keeps for them (windows.py)."""

from kvpage.core.eviction.policies import (
    H2O,
    NO_EVICTION,
    Demote,
    EvictionPolicy,
    NoEviction,
    StreamingLLM,
    parse_eviction,
)
from kvpage.core.eviction.windows import EvictionWindows

__all__ = ["H2O", "NO_EVICTION", "Demote", "EvictionPolicy", "EvictionWindows", "NoEviction", "StreamingLLM",
           "parse_eviction"]  # fmt: skip
