"""The per-sequence state of eviction policies, and the block operations that go with it.

A sequence admitted with an evicting policy gets a window here: its policy, the attention mass each
logical block received so far (H2O's scores) and, for StreamingLLM once it evicted anything, rotated
copies of its sink blocks. The holes themselves are entries of the sequence's block table
(block_table.py); this component releases blocks into them (`evict`), keeps the sink copies rotated
by the evicted length (`prepare_sinks`; the originals may be shared, so the rotation is written into
private blocks, always from the original: no drift) and says what attention reads (`attention_view`):
the resident blocks in order, sink blocks replaced by their copies, and how many tokens are missing
before them (always whole blocks before the window).

A policy with a ladder of lower precisions (Demote) moves blocks down it instead of dropping them:
each precision has its own pool (`cold`, sized at engine start), a demoted block's hole in the table
is tagged with (precision, block id) (`BlockTable.demoted`), and the copy itself, from the block's
old place to its new one, is the worker's: `take_demotions` hands the moves queued since the last
step to the next (the worker makes them before anything else, so the source, released here, still
holds its KV). When a precision's pool is full the block goes one rung lower, past the last dropped.
Attention reads a sequence's demoted blocks after its resident ones (`cold_view`), and H2O's mass
comes back in that order too.

A sequence that has evicted anything registers no more blocks in the prefix cache: what it computes
afterwards attended to a partial context, so it is not the KV those tokens have in anyone else's
sequence (the prefix registry asks the table for holes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpage.core.block_pool import BlockPool
from kvpage.core.block_table import HOLE, BlockTable
from kvpage.core.eviction.policies import EvictionPolicy
from kvpage.core.invariants import InvariantError, check

_EMPTY = BlockPool(0, 1)  # a precision without a pool: never a free block


@dataclass(slots=True)
class Window:
    policy: EvictionPolicy
    scores: list[float] = field(default_factory=list)  # H2O: attention mass per logical block, accumulated
    sink_copies: list[int] = field(default_factory=list)  # StreamingLLM: rotated copies of the sink blocks
    sink_shift: int = 0  # the positions those copies are rotated by


HOT = "hot"  # the precision name of the cache's own pool in a demotion


class EvictionWindows:
    def __init__(self, pool: BlockPool, block_size: int, cold: Mapping[str, int] | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self._windows: dict[Hashable, Window] = {}
        self.num_evicted_tokens = 0  # released since the start
        # the pools of lower precisions a demoting policy keeps blocks in ({"int8": n, "int4": m})
        self.cold = {p: BlockPool(n, block_size) for p, n in (cold or {}).items()}
        self.num_demoted = Counter()  # blocks demoted into each precision since the start
        self._demotions: list[tuple[str, int, str, int]] = []  # (src precision, src, dst precision, dst)

    # ------------------------------------------------------------------ lifetime
    def open(self, seq_id: Hashable, policy: EvictionPolicy) -> None:
        if policy.evicts:
            self._windows[seq_id] = Window(policy)

    def fork(self, parent_id: Hashable, child_id: Hashable, parent: BlockTable, child: BlockTable) -> list[int]:
        """The child's window; returns the sink copies it shares with the parent (the caller takes
        the references): those of a parent whose holes all lie in the shared part."""
        win = self._windows.get(parent_id)
        if win is None:
            return []
        copies = win.sink_copies if child.num_holes == parent.num_holes else []
        self._windows[child_id] = Window(win.policy, win.scores[: len(child.block_ids)], list(copies),
                                         win.sink_shift if copies else 0)  # fmt: skip
        for precision, b in child.demoted.values():
            self.cold[precision].incref(self.cold[precision].blocks[b])
        return list(copies)

    def close(self, seq_id: Hashable, table: BlockTable) -> list[int]:
        """The sequence is gone: its demoted blocks are released; returns the sink copies whose
        references the caller drops."""
        for precision, b in table.demoted.values():
            self.cold[precision].decref(self.cold[precision].blocks[b])
        table.demoted = {}
        win = self._windows.pop(seq_id, None)
        return win.sink_copies if win is not None else []

    def take_demotions(self) -> list[tuple[str, int, str, int]]:
        """The block moves queued since the last call, in order, for the next step's worker."""
        out, self._demotions = self._demotions, []
        return out

    def drop_copies(self, seq_id: Hashable) -> None:
        """Before a swap-out: rotated sink copies are derived, made again after the swap-in."""
        win = self._windows.get(seq_id)
        if win is not None:
            self.pool.free(self.pool.blocks[b] for b in win.sink_copies)
            win.sink_copies, win.sink_shift = [], 0

    def held_blocks(self) -> Iterable[int]:
        """GPU blocks held as sink copies (one reference per window holding them)."""
        return (b for win in self._windows.values() for b in win.sink_copies)

    # ------------------------------------------------------------------ a step
    def evict(self, seq_id: Hashable, table: BlockTable, num_computed: int, mass: Sequence[float] | None) -> int:
        """After a step that left `num_computed` tokens in the cache: add `mass` (attention received
        by each entry the step read: the resident blocks, then the demoted ones, H2O) to the block
        scores, then move the blocks the policy places lower: demoted (queued for the worker) or
        dropped. Returns how many were dropped."""
        win = self._windows.get(seq_id)
        if win is None or table.on_cpu:
            return 0
        bs = self.block_size
        held = self.read_order(table)
        if mass is not None:
            if len(win.scores) < len(table.block_ids):
                win.scores.extend([0.0] * (len(table.block_ids) - len(win.scores)))
            for i, m in zip(held, mass):  # mass may be shorter: blocks the step did not see
                win.scores[i] += m
        full = num_computed // bs
        kept = [i for i in held if i < full and i < len(table.block_ids) - 1]
        ladder = win.policy.ladder
        level = {i: ladder.index(p) + 1 for i, (p, _) in table.demoted.items()}
        moves = win.policy.place(kept, level, num_computed, bs, win.scores)
        dropped = 0
        for i in sorted(moves, key=lambda i: (-level.get(i, 0), i)):  # the lowest first: a block it
            dropped += self._move(table, i, level.get(i, 0), moves[i], ladder)  # frees may take one from above
        self.num_evicted_tokens += dropped * bs
        return dropped

    def _move(self, table: BlockTable, i: int, src: int, dst: int | None, ladder: tuple[str, ...]) -> int:
        """Entry i from level `src` down to `dst` (the first lower one with a free block; None: dropped).
        Returns 1 if it was dropped."""
        while dst is not None and not self.cold.get(ladder[dst - 1], _EMPTY).num_free:
            dst = dst + 1 if dst < len(ladder) else None
        if src:
            precision, b = table.demoted.pop(i)
            self.cold[precision].decref(self.cold[precision].blocks[b])
        else:
            precision, b = HOT, table.block_ids[i]
            self.pool.decref(self.pool.blocks[b])  # type: ignore[index]  # sharers keep it
            table.block_ids[i] = HOLE
        if dst is None:
            return 1
        pool = self.cold[ladder[dst - 1]]
        (block,) = pool.allocate(1)  # type: ignore[misc]
        pool.add_tokens(block, self.block_size)
        table.demoted[i] = (ladder[dst - 1], block.block_id)
        self._demotions.append((precision, b, ladder[dst - 1], block.block_id))  # type: ignore[arg-type]
        self.num_demoted[ladder[dst - 1]] += 1
        return 0

    def prepare_sinks(self, seq_id: Hashable, table: BlockTable) -> list[tuple[int, int, int]]:
        """Before a StreamingLLM sequence attends: its sink copies must be rotated by the evicted
        length. Returns the (original, copy, positions) rotations for the worker, taking new copies
        when there are none or they are shared (admission counted them: `blocks_for_sinks`)."""
        n, win = self._num_sinks(seq_id, table), self._windows.get(seq_id)
        shift = table.num_holes * self.block_size
        if not n or (win.sink_copies and win.sink_shift == shift):  # type: ignore[union-attr]
            return []
        assert win is not None
        if not win.sink_copies or any(self.pool.blocks[b].ref_count > 1 for b in win.sink_copies):
            fresh = self.pool.allocate(n)
            if fresh is None:
                raise InvariantError(f"no blocks for the sink copies of {seq_id!r} after the scheduler made room")
            self.pool.free(self.pool.blocks[b] for b in win.sink_copies)
            for block in fresh:
                self.pool.add_tokens(block, self.block_size)
            win.sink_copies = [b.block_id for b in fresh]
        win.sink_shift = shift
        return [(table.block_ids[i], c, shift) for i, c in enumerate(win.sink_copies)]  # type: ignore[misc]

    def blocks_for_sinks(self, tables: Sequence[tuple[Hashable, BlockTable]]) -> int:
        """Blocks `prepare_sinks` would take for these sequences: new copies for a sequence that has
        none, and for those sharing stale copies all but the last one of r (and that one too if
        someone else still holds them)."""
        total, stale = 0, Counter()
        size: dict[int, int] = {}  # a shared copy group's blocks (its holders share one policy)
        for seq_id, table in dict(tables).items():
            n = self._num_sinks(seq_id, table)
            win = self._windows.get(seq_id)
            if not n or (win.sink_copies and win.sink_shift == table.num_holes * self.block_size):  # type: ignore[union-attr]
                continue
            if not win.sink_copies:  # type: ignore[union-attr]
                total += n
            else:
                stale[win.sink_copies[0]] += 1  # type: ignore[union-attr]
                size[win.sink_copies[0]] = n  # type: ignore[union-attr]
        for first, r in stale.items():
            holders = self.pool.blocks[first].ref_count
            total += (r - 1 + (holders > r)) * size[first]
        return total

    def attention_view(self, seq_id: Hashable, table: BlockTable) -> tuple[list[int], int]:
        """What attention reads: the resident blocks in order (a StreamingLLM sequence's sink blocks
        replaced by their rotated copies) and the number of tokens missing before them."""
        if not table.num_holes:
            return list(table.block_ids), 0  # type: ignore[arg-type]
        num_evicted = table.num_holes * self.block_size
        view = table.resident
        if self._num_sinks(seq_id, table):
            win = self._windows[seq_id]
            if not win.sink_copies or win.sink_shift != num_evicted:
                raise RuntimeError(f"sequence {seq_id!r}: sink copies are stale; call prepare_sinks first")
            view[: len(win.sink_copies)] = win.sink_copies
        return view, num_evicted

    @staticmethod
    def cold_view(table: BlockTable) -> list[tuple[str, int]]:
        """The demoted blocks attention reads besides the resident ones: (precision, block id), in
        the order of `read_order`."""
        return [table.demoted[i] for i in EvictionWindows.read_order(table) if i in table.demoted]

    @staticmethod
    def read_order(table: BlockTable) -> list[int]:
        """The logical entries attention reads and reports H2O's mass for, in the order it does
        (attention/read_plan.py: reported_mass): the resident ones, then the demoted ones, each in
        logical order."""
        return [i for i, b in enumerate(table.block_ids) if b is not HOLE] + sorted(table.demoted)

    def _num_sinks(self, seq_id: Hashable, table: BlockTable) -> int:
        """Sink blocks this sequence keeps rotated: StreamingLLM's, once it evicted anything."""
        win = self._windows.get(seq_id)
        if win is None or not win.policy.reposition or not table.num_holes:
            return 0
        return win.policy.sink_blocks(self.block_size)

    # ------------------------------------------------------------------ checks
    def check_invariants(self, tables: dict[Hashable, BlockTable]) -> None:
        bs = self.block_size
        check(set(self._windows) <= set(tables), "a window for a sequence the manager does not hold")
        refs = {p: Counter(b for t in tables.values() for q, b in t.demoted.values() if q == p) for p in self.cold}
        for p, pool in self.cold.items():
            pool.check_invariants(refs[p])
            check(all(pool.blocks[b].num_tokens == bs for b in refs[p]), lambda: f"a demoted {p} block not full")
        for seq_id, table in tables.items():
            check(all(table.block_ids[i] is HOLE for i in table.demoted),
                  lambda: f"{seq_id}: a demoted entry that is not a hole")  # fmt: skip
            check(not table.demoted or (seq_id in self._windows and all(p in self._windows[seq_id].policy.ladder
                                                                        for p, _ in table.demoted.values())),
                  lambda: f"{seq_id}: a demoted block outside its policy's ladder")  # fmt: skip
            n, win = table.num_tokens, self._windows.get(seq_id)
            holes = [i for i, b in enumerate(table.block_ids) if b is HOLE and i >= table.released]  # a policy's
            check(not holes or win is not None, lambda: f"{seq_id}: a hole without an eviction policy")
            check(
                all(i < min(n // bs, len(table.block_ids) - 1) for i in holes), lambda: f"{seq_id}: a hole at the end"
            )
            if win is None:
                continue
            sinks = win.policy.sink_blocks(bs) if win.policy.reposition else 0
            check(all(i >= sinks for i in holes), lambda: f"{seq_id}: an attention sink was evicted")
            check(not win.sink_copies or (len(win.sink_copies) == sinks and holes and not table.on_cpu),
                  lambda: f"{seq_id}: sink copies without a reason")  # fmt: skip
            for c in win.sink_copies:
                check(self.pool.blocks[c].cache_key is None and self.pool.blocks[c].num_tokens == bs,
                      lambda: f"{seq_id}: sink copy {c} is registered or not full")  # fmt: skip
