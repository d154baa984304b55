"""The torch-free core: block pool, prefix cache and KV-cache manager (and, later, the scheduler).

Nothing here imports torch; a test enforces it.
"""

from kvpage.core.admission import Admission, AdmissionStatus
from kvpage.core.block_pool import Block, BlockPool
from kvpage.core.cache_stats import CacheStats
from kvpage.core.kv_cache_manager import CachedPrefix, InvariantError, KVCacheManager, SlotAllocation
from kvpage.core.prefix_cache import CacheKey, PrefixCache, hash_block

__all__ = [
    "Admission",
    "AdmissionStatus",
    "Block",
    "BlockPool",
    "CacheKey",
    "CacheStats",
    "CachedPrefix",
    "InvariantError",
    "KVCacheManager",
    "PrefixCache",
    "SlotAllocation",
    "hash_block",
]
