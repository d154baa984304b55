"""The torch-free core: the KV-cache manager's components and the scheduler.

    block, block_pool, free_block_queue   blocks, ref counts, the LRU free queue
    block_table       one sequence's table: holes, slot mapping, growth arithmetic
    cache_key         the chain hash naming a full block's content
    prefix_cache      chain hash -> the block holding that content
    prefix_registry   lookups and registration with commit / discard
    cpu_tier          copies of evicted prefix blocks in CPU memory
    remote_tier       the tier shared by replicas in a key-value server (Redis), its checked records
    kv_events         what the cache holds, announced as it changes (vLLM's BlockStored / BlockRemoved)
    swap              the CPU pool preempted sequences move to
    eviction/         policies (StreamingLLM, H2O, none) and per-sequence windows
    admission         all block arithmetic: admit, grow, swap in, the watermark
    block_advisor     the block size for a length distribution (`kvpage blocks`, block_size="auto")
    invariants        InvariantError and the checks' composition
    kv_cache_manager  the facade the scheduler talks to
    preemption        swap or recompute, and the counts
    scheduler         continuous batching: schedule() -> SchedulerOutput, update_from_output() -> StepResult
    request, scheduler_output, step_update, cache_stats   the plain data that crosses those boundaries

Nothing here imports torch; a test enforces it.
"""

from kvpage.core.admission import Admission, AdmissionStatus
from kvpage.core.block import Block
from kvpage.core.block_pool import BlockPool
from kvpage.core.cache_key import CacheKey, hash_block
from kvpage.core.cache_stats import CacheStats
from kvpage.core.invariants import InvariantError
from kvpage.core.kv_cache_manager import CachedPrefix, KVCacheManager, SlotAllocation, StepBlocks
from kvpage.core.prefix_cache import PrefixCache
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
    "StepBlocks",
    "StepResult",
    "hash_block",
]
