"""`kvpage core-demo`: the paged KV-cache core at work on synthetic requests (no model, no torch).

Four requests share a system prompt (prefix caching); one is forked into three parallel samples
(copy-on-write); every sequence decodes 12 tokens; two requests finish; a new request finds the
system prompt in the prefix cache; then everything finishes. After each stage the block tables, a
map of the pool and the cache statistics are printed, and the manager's invariants are checked.
"""

from __future__ import annotations

import random

from kvpage.core import CacheStats, KVCacheManager

SYSTEM_PROMPT = list(range(100, 126))  # 26 tokens every request starts with


def pool_map(mgr: KVCacheManager) -> str:
    """One character per physical block: '.' free, 'c' free but cached (a future hit),
    '1'-'9' the reference count of a used block ('+' for ten or more)."""
    chars = []
    for b in mgr.pool.blocks:
        if b.ref_count == 0:
            chars.append("c" if b.cache_key is not None else ".")
        else:
            chars.append(str(b.ref_count) if b.ref_count < 10 else "+")
    return "".join(chars)


def format_tables(mgr: KVCacheManager) -> str:
    lines = []
    for seq_id in mgr.seq_ids():
        n = mgr.num_tokens(seq_id)
        lines.append(f"  {seq_id:<12} {n:>3} tokens  blocks {mgr.block_table(seq_id)}")
    return "\n".join(lines) or "  (no sequences)"


def format_stats(s: CacheStats, max_len: int) -> str:
    contiguous = (s.num_seqs + s.num_swapped_seqs) * max_len
    return "\n".join(
        [
            f"  blocks      total {s.total_blocks}  used {s.used_blocks}  free {s.free_blocks}  "
            f"cached {s.cached_blocks}  shared {s.shared_blocks}  logical {s.logical_blocks}",
            f"  tokens      stored {s.stored_tokens} in {s.allocated_slots} slots  waste {s.waste:.1%}",
            f"  prefix      {s.prefix_hit_tokens}/{s.prefix_query_tokens} prompt tokens from cache "
            f"({s.prefix_hit_rate:.1%})  shared/used {s.shared_of_used:.1%}",
            f"  contiguous  a cache pre-allocated to max_len={max_len} would reserve {contiguous} slots "
            f"for these {s.num_seqs + s.num_swapped_seqs} sequences; paged uses {s.allocated_slots}",
        ]
    )


def show(title: str, mgr: KVCacheManager, max_len: int) -> None:
    print(f"\n== {title}")
    print(format_tables(mgr))
    print(f"  pool map    [{pool_map(mgr)}]")
    print(format_stats(mgr.stats(), max_len))
    mgr.check_invariants()


def run_demo(block_size: int = 8, num_blocks: int = 40, max_len: int = 128, seed: int = 0) -> KVCacheManager:
    rng = random.Random(seed)
    mgr = KVCacheManager(num_blocks, block_size, num_cpu_blocks=16, watermark=0.0)
    print(f"kvpage core demo: {num_blocks} blocks of {block_size} token slots, prefix caching on")
    print("pool map legend: '.' free  'c' free but cached  digit = reference count of a used block")

    prompts = {f"req-{i}": SYSTEM_PROMPT + [rng.randrange(1000, 2000) for _ in range(5 + 3 * i)] for i in range(4)}
    tokens = {seq_id: list(prompt) for seq_id, prompt in prompts.items()}  # the requests own their tokens
    for seq_id, prompt in prompts.items():
        prefix = mgr.find_cached_prefix(prompt)
        if mgr.allocate_slots(seq_id, len(prompt) - prefix.num_tokens, prefix) is None:
            raise RuntimeError("demo pool too small")
        mgr.cache_blocks(seq_id, prompt, len(prompt))  # the model writes the prompt's KV in this step
        mgr.commit()
    show("after prefill: four requests share the system prompt's blocks", mgr, max_len)

    samples = [f"req-1/s{j}" for j in range(1, 3)]
    for child in samples:
        mgr.fork("req-1", child)
        tokens[child] = list(tokens["req-1"])
    show("req-1 forked into 3 parallel samples (every block shared, nothing copied)", mgr, max_len)

    copies = []
    for _ in range(12):  # decode: one token per sequence per step
        for seq_id in mgr.seq_ids():
            tokens[seq_id].append(rng.randrange(1000, 2000))
            alloc = mgr.allocate_slots(seq_id, 1)
            if alloc is None:
                raise RuntimeError("demo pool too small")
            copies += alloc.copies
            mgr.cache_blocks(seq_id, tokens[seq_id], mgr.num_tokens(seq_id))
        mgr.commit()
    show(f"after 12 decode steps: copy-on-write copied {len(copies)} shared partial blocks {copies}", mgr, max_len)

    for seq_id in ("req-0", "req-2"):
        mgr.free(seq_id)
    show("req-0 and req-2 finished: their private blocks are free, full ones stay cached", mgr, max_len)

    prompt = SYSTEM_PROMPT + [7, 7, 7]
    prefix = mgr.find_cached_prefix(prompt)
    print(
        f"\na new request with the same system prompt finds {prefix.num_tokens} of its {len(prompt)} "
        f"tokens cached in blocks {prefix.block_ids}"
    )

    for seq_id in mgr.seq_ids():
        mgr.free(seq_id)
    show("everything finished", mgr, max_len)
    return mgr
