"""The torch-free core: block pool, prefix cache, KV-cache manager and scheduler.

    block_pool      blocks, ref counts, the LRU free queue
    prefix_cache    chain hashes of full blocks -> the block holding that content
    kv_cache_manager  block tables of sequences; admission of a request's sequences (the one place
                    that arithmetic lives); fork, copy-on-write, swap
    scheduler       continuous batching: schedule() -> SchedulerOutput, update_from_output() -> StepResult
    request, scheduler_output, step_update   the plain data that crosses those boundaries

Nothing here imports torch; a test enforces it.
"""

from kvpage.core.admission import Admission, AdmissionStatus
from kvpage.core.block_pool import Block, BlockPool
from kvpage.core.cache_stats import CacheStats
from kvpage.core.kv_cache_manager import CachedPrefix, InvariantError, KVCacheManager, SlotAllocation
from kvpage.core.prefix_cache import CacheKey, PrefixCache, hash_block
from kvpage.core.request import Request, RequestStatus, Sequence
from kvpage.core.scheduler import Scheduler
from kvpage.core.scheduler_output import ScheduledSequence, SchedulerOutput, SeqKey
from kvpage.core.step_update import RequestUpdate, SeqUpdate, StepResult

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
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "SeqKey",
    "SeqUpdate",
    "Sequence",
    "SlotAllocation",
    "StepResult",
    "hash_block",
]
