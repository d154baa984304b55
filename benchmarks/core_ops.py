"""How fast is the block core, and does one operation's cost grow with the pool or the live sequences?

For pools of 1k, 10k and 100k blocks holding 10 to 10,000 live sequences, time each operation:
  allocate  a new 20-token sequence, no prefix hit (2 blocks)
  append    one decode token to a live sequence (crosses a block boundary 1 time in 16)
  hit       a new sequence whose first 2 blocks come from the prefix cache (lookup + allocate)
  fork      a live sequence into a new one (shares its 2-3 blocks)
  free      a 2-block sequence
Prints operations per second (best of --repeat runs); flat columns mean O(1) per operation.
Writes benchmarks/results/core_ops.json and appends a section to benchmarks/RESULTS.md.

    python benchmarks/core_ops.py [--ops 2000] [--no-results]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time

from _report import append_results, parse, write_json

from kvpage.core import KVCacheManager

BS = 16
POOLS = [1_000, 10_000, 100_000]
LIVE = [10, 100, 1_000, 10_000]


def bench(num_blocks: int, num_live: int, ops: int) -> dict[str, float]:
    mgr = KVCacheManager(num_blocks, BS, watermark=0.0)
    uid = itertools.count(10_000_000)
    shared = list(range(2 * BS))  # the prefix every "hit" request shares
    for i in range(num_live):
        prompt = shared + [next(uid) for _ in range(4)] if i % 2 else [next(uid) for _ in range(20)]
        p = mgr.find_cached_prefix(prompt)
        mgr.allocate_slots(f"live{i}", len(prompt) - p.num_tokens, p)
        mgr.cache_blocks(f"live{i}", prompt, len(prompt))
        mgr.commit()
    live = [f"live{i}" for i in range(num_live)]
    n = min(ops, (mgr.pool.num_free - 8) // 3)
    out: dict[str, float] = {}

    def timed(name, fn, ids):
        gc.disable()  # as timeit does: a collection in the middle of one cell is noise
        t0 = time.perf_counter()
        for x in ids:
            fn(x)
        out[name] = len(ids) / (time.perf_counter() - t0)
        gc.enable()

    new = [f"new{i}" for i in range(n)]
    timed("allocate", lambda s: mgr.allocate_slots(s, 20), new)
    timed("free", mgr.free, new)

    hit_prompts = {s: shared + [next(uid)] for s in new}

    def hit(s):
        p = mgr.find_cached_prefix(hit_prompts[s])
        mgr.allocate_slots(s, len(hit_prompts[s]) - p.num_tokens, p)

    timed("hit", hit, new)
    for s in new:
        mgr.free(s)

    children = [(live[i % num_live], f"child{i}") for i in range(n)]
    timed("fork", lambda pc: mgr.fork(*pc), children)
    for _, c in children:
        mgr.free(c)

    targets = [live[i % num_live] for i in range(n)]
    timed("append", lambda s: mgr.allocate_slots(s, 1), targets)
    mgr.check_invariants()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=2000, help="operations timed per cell (default 2000)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per cell; the best is reported (default 5)")
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parse(ap, None, __file__)
    rows = []
    names = ["allocate", "append", "hit", "fork", "free"]
    header = "| pool blocks | live seqs | " + " | ".join(f"{n} (ops/s)" for n in names) + " |"
    lines = [header, "|" + "---|" * (2 + len(names))]
    for num_blocks in POOLS:
        for num_live in LIVE:
            if num_live * 3 > num_blocks * 0.6:
                continue
            runs = [bench(num_blocks, num_live, args.ops) for _ in range(args.repeat)]
            r = {n: max(run[n] for run in runs) for n in names}  # best of the repeats
            rows.append({"num_blocks": num_blocks, "num_live": num_live, **r})
            lines.append(f"| {num_blocks:,} | {num_live:,} | " + " | ".join(f"{r[n]:,.0f}" for n in names) + " |")
            print(lines[-1], flush=True)
    spread = {n: max(r[n] for r in rows) / min(r[n] for r in rows) for n in names}
    summary = "max/min ops/s over all cells: " + ", ".join(f"{n} {spread[n]:.2f}x" for n in names)
    print("\n".join([header, lines[1]] + lines[2:]))
    print(summary)
    write_json("core_ops", {"rows": rows, "spread": spread})
    if not args.no_results:
        body = (
            "Operations per second of the block core (16-token blocks). A flat column means the cost of one "
            "operation does not grow with the pool or the number of live sequences.\n\n"
            + "\n".join(lines)
            + f"\n\n{summary}\n"
        )
        append_results("Core operations (benchmarks/core_ops.py)", body)


if __name__ == "__main__":
    main()
