"""Block-size advice from the lengths a deployment actually sees.

The seed documents' rule of thumb is block_size = max(64, 2 ** floor(log2(avg_seq_len / 4))).
Next to it we simulate: for each power-of-two block size, the slots a paged cache allocates for
those lengths and how many of them hold no token (internal fragmentation of each last block).
Waste never grows as blocks shrink, so the lower bound on the block size (`min_block_size`) is
the real decision: it stands for per-block costs (block-table entries, bookkeeping, kernel
efficiency) that this simulation does not price.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class BlockChoice:
    block_size: int
    blocks: int  # blocks to hold every sequence at once
    slots: int
    waste: float  # slots holding no token / slots


def seed_rule(avg_len: float) -> int:
    return max(64, 2 ** math.floor(math.log2(max(avg_len, 1) / 4))) if avg_len >= 4 else 64


def simulate(histogram: dict[int, int], block_size: int) -> BlockChoice:
    blocks = sum(count * -(-length // block_size) for length, count in histogram.items())
    tokens = sum(length * count for length, count in histogram.items())
    slots = blocks * block_size
    return BlockChoice(block_size, blocks, slots, (slots - tokens) / slots if slots else 0.0)


def advise(histogram: dict[int, int], min_block_size: int = 16, max_block_size: int = 256):
    """(seed rule's size, table over powers of two 1..max, the least-waste size within [min, max])."""
    if not histogram or any(n < 1 or c < 0 for n, c in histogram.items()) or not sum(histogram.values()):
        raise ValueError("lengths must be positive integers with positive counts")
    if min_block_size < 1 or min_block_size > max_block_size:
        raise ValueError(f"min_block_size must be in [1, {max_block_size}], got {min_block_size}")
    total = sum(histogram.values())
    avg = sum(n * c for n, c in histogram.items()) / total
    sizes = [2**k for k in range(0, int(math.log2(max_block_size)) + 1)]
    table = [simulate(histogram, b) for b in sizes]
    allowed = [c for c in table if c.block_size >= min_block_size]
    best = min(allowed, key=lambda c: (c.waste, -c.block_size))
    return seed_rule(avg), table, best, avg


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
