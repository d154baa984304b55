"""The free-block queue: a doubly linked list of blocks in LRU order.

The head is the next block handed out (least recently freed); freed blocks join at the tail.
Removing a block from the middle is O(1) because each block carries its own links; this is what
lets a prefix-cache hit take a free-but-cached block back without scanning.

    head <-> b3 <-> b7 <-> b1 <-> tail      (sentinels at both ends)
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpage.core.block import Block

_SENTINEL = -1  # the block id of the two end markers, which are never handed out


class FreeBlockQueue:
    """Intrusive doubly linked list over `Block.prev_free` / `Block.next_free`."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: list[Block]) -> None:
        # Sentinels never leave the list, so no operation needs an "is this the end?" branch.
        self._head = Block(block_id=_SENTINEL)
        self._tail = Block(block_id=_SENTINEL)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def append(self, block: Block) -> None:
        """Put `block` at the tail (most recently freed)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> Block:
        """Take the block at the head (least recently freed). Raises IndexError when empty."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(first)
        return first

    def remove(self, block: Block) -> None:
        """Unlink `block` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        """The free block ids from head (next to be handed out) to tail."""
        return [b.block_id for b in self]
