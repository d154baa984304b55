"""Baselines kept only to be measured against: generation with no KV cache, and a static contiguous cache."""

from kvpage.baselines.generation import NoCacheGenerator, StaticCacheGenerator

__all__ = ["NoCacheGenerator", "StaticCacheGenerator"]
