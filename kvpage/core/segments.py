"""Segments: a prompt given as pieces (documents, then the question) whose KV is reused wherever the
piece stands, at block granularity (position-independent caching: EPIC's LegoLink, arXiv 2410.15332).

A segment's cached KV is that of the segment alone: the prefix-cache blocks of a prompt that is just
the segment (its chain restarts at its boundary, salt included: `cache_key.block_digests`), computed
at positions 0, 1, ... A request that places segment i at position p > 0 then has, of that segment:

    [p, p + k*B)                       its first `recompute_blocks` (k) blocks computed in the new
                                       context (they served as the segment's own attention sink;
                                       now they attend to what precedes it)
    [p + k*B, p + h*B)                 its other cached full blocks (h of them cached) copied slot by
                                       slot into the sequence's blocks, keys rotated by p (RoPE: a key
                                       computed at position j, rotated by p, is the key at j + p)
    [p + h*B, p + len)                 the rest (a partly filled last block, blocks not cached)
                                       computed in context

The first segment (position 0) is an ordinary prefix and the last one (the question) is always
computed. The copies are token-granular runs, so a segment is reused at any offset inside a block.
Everything after the first copied token attends to KV computed without its context: it is an
approximation, and none of it is registered in the prefix cache (`Sequence.exact_upto`).

With CacheBlend's selective recompute (`Request.recompute_ratio` > 0) the copied spans are computed
too, as runs marked with that share: the worker recomputes all their tokens through its check layer
and only the share whose K/V deviated most after it (worker/selective.py). The slots are the same;
only what the step writes into them differs.

The cached blocks a prompt copies from are held (referenced) before its admission allocates, each
segment's whole chain: the prompt's own fresh blocks cannot evict them, and the leading blocks it
recomputes (never copied, but where the chain is looked up) are refreshed with the rest. A prompt
that fits only if they give way lets them go and computes in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SlotRun = tuple[int, int, int, int]  # (src slot, dst slot, length, shift): keys rotated by `shift` positions


@dataclass(frozen=True, slots=True)
class Fill:
    """Positions [start, end) of a sequence whose KV is copied from a segment's cached blocks."""

    start: int
    end: int
    runs: tuple[SlotRun, ...]  # never crossing a block boundary of the source or of the destination
    source_blocks: tuple[int, ...]  # the cached blocks read (pinned until the step's copies ran)


def plan_fills(
    segments: Sequence[tuple[int, int]],
    hits: Sequence[Sequence[int]],
    dst_table: Sequence[int | None],
    block_size: int,
    recompute_blocks: int,
    from_pos: int = 0,
) -> list[Fill]:
    """The fills of a prompt whose segment i is `segments[i]` = (start position, length) and whose
    standalone KV is cached in the leading full blocks `hits[i]` (in order; empty when none is).
    `dst_table`: the sequence's block table, slots for the whole prompt. Nothing before `from_pos`
    (what a prefix hit already holds) is filled, nor the first or the last segment."""
    if recompute_blocks < 0:
        raise ValueError(f"recompute_blocks must be >= 0, got {recompute_blocks}")
    if len(hits) != len(segments):
        raise ValueError(f"{len(hits)} hit lists for {len(segments)} segments")
    bs, fills = block_size, []
    for i, ((pos, length), blocks) in enumerate(zip(segments, hits, strict=True)):
        if i == 0 or i == len(segments) - 1 or pos == 0:
            continue
        usable = min(len(blocks), length // bs)
        first = max(recompute_blocks * bs, from_pos - pos)  # segment offset of the first copied token
        last = usable * bs
        if first >= last:
            continue
        runs, used = [], []
        t = first
        while t < last:
            src_block, src_off = blocks[t // bs], t % bs
            dst_pos = pos + t
            dst_block, dst_off = dst_table[dst_pos // bs], dst_pos % bs
            if dst_block is None:
                raise ValueError(f"position {dst_pos} has no block to copy a segment into")
            n = min(bs - src_off, bs - dst_off, last - t)
            runs.append((src_block * bs + src_off, dst_block * bs + dst_off, n, pos))
            if not used or used[-1] != src_block:
                used.append(src_block)
            t += n
        fills.append(Fill(pos + first, pos + last, tuple(runs), tuple(used)))
    return fills


def segment_spans(lengths: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(start, length) of each segment of a prompt made of segments of these lengths, in order."""
    spans, pos = [], 0
    for n in lengths:
        if n <= 0:
            raise ValueError("a segment is empty")
        spans.append((pos, n))
        pos += n
    return tuple(spans)
