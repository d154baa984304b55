"""Block-size advice from the lengths a deployment actually sees (`kvpage blocks`, `block_size="auto"`).

The seed documents' rule of thumb is block_size = max(64, 2 ** floor(log2(avg_seq_len / 4))), and
their range 64-256: small blocks cost management (a block-table entry, a gather and a pool entry
each), large ones waste the tail of every sequence's last block and share prefixes only in whole
blocks. The advisor prices both sides in token slots, for each power-of-two block size:

    cost = slots allocated                          (tokens + the empty tail of each last block)
         - slots saved by sharing a common prefix   (only its whole blocks are shared)
         + block_cost x blocks                      (the per-block cost, in slot equivalents)

and picks the cheapest size within [min_block_size, max_block_size] (64-256 by default, the seed's).
For one length L the optimum is near sqrt(2 x block_cost x L) (waste ~ bs/2 per sequence against
block_cost x L/bs), where the seed's rule says L/4.

BLOCK_COST is 0 because that is what benchmarks/block_size.py measures on the CPUs here: from 8 to
256 tokens per block a decode step got no faster as blocks grew (in two runs, 47-57 ms at 8 against
47-75 at 64 and 80-85 at 256, 16 x 512 tokens), and one KV budget's throughput was best at 16 and
at 32 (RESULTS.md). So within the range the advice is the least memory (waste and unshared prefix);
the range itself stands for the GPU kernels the seeds are about, where a block is a unit of a
thread block's work. Leave it with --min-block-size and give a per-block cost with --block-cost.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvpage.core.block import cdiv

BLOCK_COST = 0  # token slots one block's management is worth, as measured here (see the module docstring)


@dataclass(slots=True, frozen=True)
class BlockChoice:
    block_size: int
    blocks: int  # blocks to hold every sequence at once, a shared prefix stored once
    slots: int  # slots allocated without sharing
    waste: float  # slots holding no token / slots
    shared_slots: int  # slots a shared prefix saves (whole blocks only)
    cost: float  # slots - shared_slots + block_cost * blocks


@dataclass(slots=True, frozen=True)
class Advice:
    seed_rule: int
    table: list[BlockChoice]
    best: BlockChoice
    average_length: float
    block_cost: float
    min_block_size: int
    max_block_size: int


def seed_rule(avg_len: float) -> int:
    return max(64, 2 ** math.floor(math.log2(max(avg_len, 1) / 4))) if avg_len >= 4 else 64


def simulate(histogram: dict[int, int], block_size: int, block_cost: float = BLOCK_COST, shared_prefix: int = 0,
             shared_count: int = 0) -> BlockChoice:  # fmt: skip
    blocks = sum(count * cdiv(length, block_size) for length, count in histogram.items())
    tokens = sum(length * count for length, count in histogram.items())
    slots = blocks * block_size
    shared_blocks = (shared_prefix // block_size) * max(shared_count - 1, 0)
    stored = blocks - shared_blocks
    return BlockChoice(block_size, stored, slots, (slots - tokens) / slots if slots else 0.0,
                       shared_blocks * block_size, stored * block_size + block_cost * stored)  # fmt: skip


def advise(histogram: dict[int, int], min_block_size: int = 64, max_block_size: int = 256, *,
           block_cost: float = BLOCK_COST, shared_prefix: int = 0, shared_count: int = 0) -> Advice:  # fmt: skip
    """The table over powers of two 1..max_block_size and the cheapest size within [min, max].
    `shared_prefix` tokens are common to `shared_count` of the sequences (a system prompt)."""
    if not histogram or any(n < 1 or c < 0 for n, c in histogram.items()) or not sum(histogram.values()):
        raise ValueError("lengths must be positive integers with positive counts")
    for name, v in (("min_block_size", min_block_size), ("max_block_size", max_block_size)):
        if v < 1 or v > 1024 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two in [1, 1024], got {v}")
    if min_block_size > max_block_size:
        raise ValueError(f"min_block_size ({min_block_size}) must not exceed max_block_size ({max_block_size})")
    if block_cost < 0 or shared_prefix < 0 or shared_count < 0:
        raise ValueError("block_cost, shared_prefix and shared_count must be >= 0")
    total = sum(histogram.values())
    avg = sum(n * c for n, c in histogram.items()) / total
    sizes = [2**k for k in range(0, int(math.log2(max_block_size)) + 1)]
    table = [simulate(histogram, b, block_cost, shared_prefix, shared_count) for b in sizes]
    allowed = [c for c in table if c.block_size >= min_block_size]
    best = min(allowed, key=lambda c: (c.cost, -c.block_size))  # a tie: fewer blocks
    return Advice(seed_rule(avg), table, best, avg, block_cost, min_block_size, max_block_size)


def histogram_from(value: str | dict) -> dict[int, int]:
    """A mapping {length: count}, a "LENGTH:COUNT,..." string, or the path of a JSONL of lengths."""
    if isinstance(value, dict):
        hist = {int(k): int(v) for k, v in value.items()}
        if not hist or any(n < 1 or c < 0 for n, c in hist.items()) or not sum(hist.values()):
            raise ValueError("lengths must be positive integers with positive counts")
        return hist
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a histogram mapping, LENGTH:COUNT,... or a JSONL path; got {value!r}")
    path = Path(value)
    return read_lengths(path) if path.suffix in (".jsonl", ".json") or path.exists() else parse_histogram(value)


def read_lengths(path: Path) -> dict[int, int]:
    """JSONL: one number per line, or an object with "length", "num_tokens", or "prompt_len" + "output_len"."""
    hist: dict[int, int] = {}
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON: {e.msg}") from None
        if isinstance(obj, dict):
            if "length" in obj or "num_tokens" in obj:
                n = obj.get("length", obj.get("num_tokens"))
            elif "prompt_len" in obj:
                n = obj["prompt_len"] + obj.get("output_len", 0)
            else:
                raise ValueError(f"{path}:{i}: expected 'length', 'num_tokens' or 'prompt_len'")
        else:
            n = obj
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{path}:{i}: length must be a positive integer, got {n!r}")
        hist[n] = hist.get(n, 0) + 1
    if not hist:
        raise ValueError(f"{path} holds no lengths")
    return hist


def parse_histogram(text: str) -> dict[int, int]:
    """ "128:10,512:4" -> {128: 10, 512: 4}"""
    hist: dict[int, int] = {}
    for part in text.split(","):
        try:
            length, count = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"histogram entries look like LENGTH:COUNT, got {part!r}") from None
        hist[length] = hist.get(length, 0) + count
    return hist
