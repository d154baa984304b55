"""Building an engine from its config: the dtype chosen, the model loaded, the KV pool sized (on
CUDA after a profiling forward; beside it, for a demoting kv_eviction, a pool per lower precision),
max_model_len checked against it, and every component made.

`LLMEngine` (llm_engine.py) takes the parts and only steps; nothing here runs a request.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvpage import compat
from kvpage.config import EngineConfig
from kvpage.core import KVCacheManager
from kvpage.core.remote_tier import RemoteTier
from kvpage.core.scheduler import Scheduler
from kvpage.kvstore import open_store
from kvpage.models import choose_dtype, load_model, parse_dtype
from kvpage.models.batch_invariant import make_batch_invariant
from kvpage.models.config import ModelConfig
from kvpage.models.loader import weights_fingerprint
from kvpage.models.tokenizer import Tokenizer
from kvpage.worker.gpu_memory import profile_kv_budget
from kvpage.worker.kv_cache import KVCache, kv_dtype_name
from kvpage.worker.model_runner import ModelRunner
from kvpage.worker.selective import CacheBlend
from kvpage.worker.step_hooks import AttentionMass, ReadBudgetCount, StepHook, WriteThrough

DEFAULT_KV_CACHE_MEMORY = 512 * 2**20


@dataclass(slots=True)
class EngineParts:
    dtype_name: str  # "auto" resolved
    dtype_reason: str
    kernels: str  # what runs attention and the per-layer math, for the start-up line
    model_config: ModelConfig
    tokenizer: Tokenizer
    kv_dtype_name: str
    bytes_per_block: int
    kv_pool_note: str  # how the pool was sized on CUDA ("" otherwise)
    max_model_len: int
    kv_manager: KVCacheManager
    kv_cache: KVCache
    runner: ModelRunner
    scheduler: Scheduler
    remote: RemoteTier | None = None  # the shared KV tier (--remote-kv)


def describe_kernels(chosen: str, asked: str) -> str:
    """What runs the attention and per-layer math, for the start-up line."""
    if chosen == "cpu":
        return "compiled CPU kernels"
    if chosen == "triton":
        from kvpage.attention.triton_paged import interpreted

        return "Triton kernels" + (" (in Triton's interpreter)" if interpreted() else "")
    if asked == "auto":
        from kvpage.ops import unavailable_reason

        why = unavailable_reason()
        return f"torch reference ({why})" if why else "torch reference (not a CPU device)"
    return "torch reference"


def build_engine(config: EngineConfig) -> EngineParts:
    """Every part of an engine. Under tensor parallelism (kvpage/distributed) this process is rank 0:
    the other ranks are started (or joined) first, and its runner broadcasts each step to them."""
    if config.tensor_parallel_size == 1:
        return _build(config, None)
    from kvpage.distributed.launch import start_group
    from kvpage.distributed.rank_runner import RankZeroRunner

    _check_split(config)
    group, ranks = start_group(config)
    try:
        parts = _build(config, group)
    except BaseException:
        with contextlib.suppress(Exception):  # (ranks that failed with this one have left already)
            group.broadcast(("stop",))  # ranks past their build wait for steps: none will come
        ranks.stop()
        group.close()
        raise
    parts.runner = RankZeroRunner(parts.runner, group, ranks)
    return parts


def _check_split(config: EngineConfig) -> None:
    """Refuse a size the model's heads do not allow before any rank is started (the model's shape from
    its config.json or GGUF header; a model that cannot be read so is checked when each rank loads it)."""
    from kvpage.tools.kv_estimate import resolve_shape

    try:
        shape = resolve_shape(config.model)
    except Exception:  # noqa: BLE001 - not readable without loading: the ranks' load checks it
        return
    if shape.dims is not None:
        shape.per_rank(config.tensor_parallel_size)


@dataclass(slots=True)
class ShardParts:
    """What every rank builds alike: its shard of the model, its KV cache, its runner."""

    loaded: object  # LoadedModel (its .config the whole model's, .model.config this rank's)
    dtype_name: str
    dtype_reason: str
    dtype: torch.dtype
    per_block: int  # this rank's bytes per block
    num_blocks: int  # the same on every rank: the minimum over them
    note: str
    cold: dict
    num_cpu_blocks: int
    num_tier_blocks: int
    kv_cache: KVCache
    runner: ModelRunner
    remote: RemoteTier | None  # the shared tier (rank 0's), or None


def build_shard(config: EngineConfig, group=None) -> ShardParts:
    """The model (this rank's shard of it), the KV pools sized and the runner; the same on every rank
    but for the memory each holds: the block count is the minimum over the ranks, as vLLM does."""
    from kvpage.distributed.shard import SINGLE, Shard

    shard = Shard(group.rank, group.size) if group is not None else SINGLE
    dtype_name, dtype_reason = choose_dtype(config.dtype, config.device)
    dtype = parse_dtype(dtype_name)
    bounds = config.kv_read_budget is not None  # the key bounds a read budget chooses blocks by
    try:
        loaded = load_model(config.model, dtype=dtype, device=config.device, backend=config.attention_backend,
                            weight_dtype=config.weight_dtype, shard=shard, comm=group)  # fmt: skip
        compat.check(config.setup(**compat.model_facts(loaded.config.layer_specs)))  # what the model brings
        if config.deterministic:
            make_batch_invariant(loaded.model)
        local = loaded.model.config  # this rank's heads: its KV is 1/N of the whole (times any replication)
        per_block = KVCache.bytes_per_block(local, config.block_size, dtype, config.kv_cache_dtype, bounds)
        num_blocks, note = _num_blocks(config, loaded, dtype, per_block)
    except Exception:
        if group is not None:
            group.min(0)  # the other ranks fail with this one, not at a collective it never reaches
        raise
    if group is not None:
        num_blocks = group.min(num_blocks)
        if num_blocks == 0:
            raise RuntimeError("another rank of the tensor-parallel group could not build its shard (its log says why)")
    backend = loaded.model.attention_backend
    num_blocks, cold = _demoted_pools(config, local, per_block, num_blocks)
    num_cpu_blocks = int(config.swap_space) // per_block
    num_tier_blocks = int(config.cpu_offload_memory) // per_block
    kv_cache = KVCache(local, num_blocks, config.block_size, dtype, config.device, num_cpu_blocks,
                       config.kv_cache_dtype, num_tier_blocks, backend=backend, key_bounds=bounds,
                       cold_blocks=cold)  # fmt: skip
    rank0 = group is None or group.rank == 0
    remote = _remote_tier(config, loaded, dtype_name, kv_cache) if config.remote_kv and rank0 else None
    runner = ModelRunner(loaded.model, kv_cache, config.device, _step_hooks(config, local, group, kv_cache, remote),
                         group=group, computes_logits=rank0)  # fmt: skip
    return ShardParts(loaded, dtype_name, dtype_reason, dtype, per_block, num_blocks, note, cold, num_cpu_blocks,
                      num_tier_blocks, kv_cache, runner, remote)  # fmt: skip


def _step_hooks(config: EngineConfig, local, group, kv_cache: KVCache, remote) -> list[StepHook]:
    """What the features add around each forward (worker/step_hooks.py): H2O's mass and CacheBlend
    may be asked by any request; a read budget's counts and the write-through only when configured."""
    hooks: list[StepHook] = [AttentionMass(local.num_layers, local.num_heads, group), CacheBlend(local.num_layers)]
    if config.kv_read_budget is not None:
        hooks.append(ReadBudgetCount())
    if remote is not None:
        hooks.append(WriteThrough(remote, kv_cache))
    return hooks


def _build(config: EngineConfig, group) -> EngineParts:
    shard = build_shard(config, group)
    loaded, dtype, kv_cache = shard.loaded, shard.dtype, shard.kv_cache
    if loaded.tokenizer is None:
        raise ValueError(f"model {config.model!r} has no tokenizer; kvpage needs one to serve text")
    backend = loaded.model.attention_backend
    kernels = describe_kernels(backend.name, config.attention_backend)
    if config.weight_dtype:
        kernels += f"; {config.weight_dtype} weights"
    if config.deterministic:
        kernels += "; deterministic (batch-invariant kernels)"
    if config.kv_cache_dtype != "auto":
        torch_path = config.kv_cache_dtype == "fp8" and backend.name != "torch"
        kernels += f"; {config.kv_cache_dtype} KV cache" + (" (attention on the torch path)" if torch_path else "")
    if group is not None:
        kernels += f"; tensor parallel over {group.size} ranks ({group.backend})"
    block_size, per_block, num_blocks, cold = config.block_size, shard.per_block, shard.num_blocks, shard.cold
    num_cpu_blocks, num_tier_blocks = shard.num_cpu_blocks, shard.num_tier_blocks
    windowed = loaded.config.layer_spec.kind != "full"
    max_model_len = _max_model_len(config, loaded.config.max_position_embeddings, num_blocks, block_size, windowed)
    remote = shard.remote
    kv_manager = KVCacheManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                                enable_prefix_caching=config.enable_prefix_caching, watermark=config.watermark,
                                bytes_per_block=per_block, num_tier_blocks=num_tier_blocks,
                                remote=remote, cold_blocks=cold, layer_spec=loaded.config.layer_spec,
                                group_specs=[g.spec for g in loaded.config.kv_groups])  # fmt: skip
    scheduler = Scheduler(kv_manager, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                          preemption_mode=config.preemption_mode)  # fmt: skip
    runner = shard.runner
    return EngineParts(shard.dtype_name, shard.dtype_reason, kernels, loaded.config, loaded.tokenizer,
                       kv_dtype_name(config.kv_cache_dtype, dtype), per_block, shard.note, max_model_len, kv_manager,
                       kv_cache, runner, scheduler, remote)  # fmt: skip


def _remote_tier(config: EngineConfig, loaded, dtype_name: str, kv_cache: KVCache) -> RemoteTier:
    """The shared tier, in the namespace of everything that makes two replicas' blocks interchangeable."""
    namespace = "|".join((f"weights={weights_fingerprint(loaded.source)}", f"dtype={dtype_name}",
                          f"weight_dtype={config.weight_dtype or 'none'}", f"kv={config.kv_cache_dtype}",
                          f"block_size={config.block_size}", f"layout={kv_cache.layout()}"))  # fmt: skip
    return RemoteTier(open_store(config.remote_kv), namespace)  # type: ignore[arg-type]


def _num_blocks(config: EngineConfig, loaded, dtype: torch.dtype, per_block: int) -> tuple[int, str]:
    """The GPU pool's blocks: as asked, or what the memory holds (on CUDA without a size: profiled)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, ""
    note = ""
    memory = config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
    if config.kv_cache_memory is None and torch.device(config.device).type == "cuda":
        memory, note = profile_kv_budget(
            loaded.model, loaded.model.config, config.device, dtype, config.block_size, config.max_num_batched_tokens,
            config.max_num_seqs, config.kv_cache_dtype, config.gpu_memory_utilization,
        )  # fmt: skip
    num_blocks = int(memory) // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={memory} bytes holds no block of {per_block} bytes")
    if note:
        note += f" = {num_blocks} blocks of {config.block_size} tokens ({per_block} bytes each)"
    return num_blocks, note


def _demoted_pools(config: EngineConfig, cfg: ModelConfig, per_block: int, num_blocks: int) -> tuple[int, dict]:
    """The pools of a demoting kv_eviction (core/eviction: Demote): the memory is shared out as whole
    sequences' worth, each its hot blocks (heavy hitters, window and the block being filled) and its
    quota of each lower precision; the CPU-tier rung ("cpu") is host memory, outside the budget. With
    num_kv_blocks the hot pool is as asked and the others are sized beside it for as many sequences.
    Returns (hot blocks, {precision: blocks}), a rung without a quota left out."""
    policy, bs = config.kv_eviction, config.block_size
    if not policy.ladder:
        return num_blocks, {}
    hot, *lower = policy.quotas(bs)
    hot += policy.window_blocks(bs) + 1
    quota = {p: q for p, q in zip(policy.ladder, lower, strict=True) if q}
    on_device = {p: KVCache.demoted_bytes_per_block(cfg, bs, p) for p in quota if p != "cpu"}
    if config.num_kv_blocks is not None:
        units = max(1, num_blocks // hot)
        return num_blocks, {p: units * q for p, q in quota.items()}
    memory = num_blocks * per_block
    units = memory // (hot * per_block + sum(quota[p] * c for p, c in on_device.items()))
    if units < 1:
        raise ValueError(f"kv_cache_memory={memory} bytes holds not one sequence's worth of {policy.describe()}")
    cold = {p: units * q for p, q in quota.items()}
    return (memory - sum(cold[p] * c for p, c in on_device.items())) // per_block, cold


def _max_model_len(config: EngineConfig, context: int, num_blocks: int, block_size: int, windowed: bool) -> int:
    """`windowed`: the layers read a window, so a sequence holds its window's blocks, whatever its length
    (a prompt still needs its blocks at once: one longer than the pool fails alone)."""
    capacity = num_blocks * block_size
    max_model_len = config.max_model_len or (context if windowed else min(context, capacity))
    if max_model_len > context:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length {context}")
    if max_model_len > capacity and not config.kv_eviction.evicts and not windowed:  # (within their budget)
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the KV cache's capacity of {capacity} tokens "
            f"({num_blocks} blocks of {block_size}); raise kv_cache_memory / num_kv_blocks or lower max_model_len"
        )
    return max_model_len
