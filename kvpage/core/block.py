"""A block: `block_size` token slots of KV storage somewhere (GPU or CPU memory), as bookkeeping.

Token t of a sequence lives in slot `block_table[t // B] * B + t % B`. A block carries its reference
count, how many of its slots hold a token, the content key while it is registered in a prefix cache,
and the links of the free queue it sits in while unreferenced (free_block_queue.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.core.cache_key import CacheKey


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    num_tokens: int = 0  # slots that hold a token's KV
    cache_key: CacheKey | None = None  # set while registered in the prefix cache
    prev_free: Block | None = None  # links of the free queue; None while the block is in use
    next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, tokens={self.num_tokens})"


def cdiv(a: int, b: int) -> int:
    """Whole blocks of `b` slots for `a` tokens (ceil(a / b) on integers)."""
    return -(-a // b)
