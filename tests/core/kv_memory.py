"""A token-level model of the physical KV memory, for checking the core's data-flow plans.

The worker keeps K/V tensors indexed by slot; here each slot holds the token id whose KV it stores.
Applying the core's plans (slot mapping, copy-on-write pairs, swap mappings) to it and reading every
sequence back through its block table shows that no plan ever overwrote another sequence's KV.

The manager owns blocks, not tokens: the test owns every sequence's token ids (`tokens`, shared by
reference, as a request owns them) and this model reads them from there.

A failed step is modelled too: while a journal is open, every token written records the slot's
previous content, and `rollback()` restores it (the KV of a step that never ran was never written).
Block copies (copy-on-write, swap) are not journalled: the worker performs them before the forward.

Blocks a policy demoted (core/eviction: Demote) go to pools of lower precisions (`cold`, one memory
each, "hot" naming the GPU pool): the manager queues the moves and the worker makes them first of
all in the next step, so here they wait (`pending`) until the next operation that touches memory,
and the checks read a demoted block as it will be once they are made: its source must still hold
its KV until then, whatever the manager did with the block meanwhile.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from kvpage.core import KVCacheManager, SlotAllocation
from kvpage.tools.scheduler_sim import copy_blocks


class KVMemory:
    def __init__(self, mgr: KVCacheManager, tokens: Mapping[Hashable, Sequence[int]]) -> None:
        self.mgr = mgr
        self.tokens = tokens  # the test's own token lists; never copied
        self.gpu: dict[int, int] = {}  # slot -> token id
        self.cpu: dict[int, int] = {}
        self.tier: dict[int, int] = {}  # the prefix cache's CPU tier
        self._journal: list[tuple[int, int | None]] = []  # (gpu slot, previous token) of this step's writes
        self.cold: dict[str, dict[int, int]] = {p: {} for p in mgr.eviction.cold}  # precision -> slot -> token
        self.pending: list[tuple[str, int, str, int]] = []  # demotions queued, not yet made by the worker

    def _copy_blocks(self, src: dict[int, int], dst: dict[int, int], pairs: list[tuple[int, int]]) -> None:
        copy_blocks(src, dst, pairs, self.mgr.block_size)

    def queue_demotions(self) -> list[tuple[str, int, str, int]]:
        """Take the demotions the manager queued since the last call (returned): made before anything else."""
        moves = self.mgr.take_demotions()
        self.pending += moves
        return moves

    def demote(self) -> None:
        """The worker's first act: the queued demotions, in order (a block a move frees may be the
        destination of a later one)."""
        self.queue_demotions()
        self._demote(self.pending, {"hot": self.gpu, **self.cold})
        self.pending = []

    def _demote(self, moves: list[tuple[str, int, str, int]], pools: dict[str, dict[int, int]]) -> None:
        for src_p, src, dst_p, dst in moves:
            copy_blocks(pools[src_p], pools[dst_p], [(src, dst)], self.mgr.block_size)

    def transfers(self) -> None:
        """The tier copies the manager planned so far: evicted blocks out first, then hits back in
        (the worker runs them before anything else of the step but the demotions)."""
        self.demote()
        t = self.mgr.take_tier_transfers()
        offload, restore = t.offload, t.restore
        if offload or restore:
            from hypothesis import event

            event(f"tier: {'offload' if offload else ''} {'restore' if restore else ''}")
        self._copy_blocks(self.gpu, self.tier, offload)
        self._copy_blocks(self.tier, self.gpu, restore)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write on the GPU pool."""
        self.demote()
        self._copy_blocks(self.gpu, self.gpu, pairs)

    def copy_before_writes(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the worker makes before the step's forward (a partial prefix hit's): the source
        blocks as they were before this step's writes."""
        self.demote()
        before = self.before_writes()
        bs = self.mgr.block_size
        for src, dst in pairs:
            for i in range(bs):
                self._set(dst * bs + i, before(src * bs + i))

    def copy_slots_before_writes(self, runs: list[tuple[int, int, int, int]]) -> None:
        """A prompt's segments copied slot by slot (segments.py: (src slot, dst slot, length, shift)),
        by the worker before the step's forward: the sources as they were before this step's writes
        (the shift rotates keys; in token terms a copy)."""
        self.demote()
        before = self.before_writes()
        for src, dst, n, _ in runs:
            for i in range(n):
                self._set(dst + i, before(src + i))

    def before_writes(self):
        """slot -> its token before this step's writes."""
        first: dict[int, int | None] = {}
        for slot, prev in self._journal:
            first.setdefault(slot, prev)
        return lambda slot: first[slot] if slot in first else self.gpu.get(slot)

    def _set(self, slot: int, value: int | None) -> None:
        if value is None:
            self.gpu.pop(slot, None)
        else:
            self.gpu[slot] = value

    def write(self, seq_id: Hashable, start: int, end: int) -> None:
        """The model wrote the KV of tokens [start, end) of the sequence into their slots (in every
        KV-cache group: each layer writes its own)."""
        self.demote()
        tokens = self.tokens[seq_id]
        for g in range(self.mgr.num_groups):
            for t, slot in zip(range(start, end), self.mgr.slot_mapping(seq_id, start, end, g), strict=True):
                self._journal.append((slot, self.gpu.get(slot)))
                self.gpu[slot] = tokens[t]

    def apply(self, seq_id: Hashable, alloc: SlotAllocation, num_new: int) -> None:
        """Copy-on-write first, then write the last `num_new` tokens' KV into their slots."""
        self.transfers()
        self.copy(alloc.copies)
        n = self.mgr.num_tokens(seq_id)
        self.write(seq_id, n - num_new, n)

    def commit(self) -> None:
        self._journal.clear()

    def rollback(self) -> None:
        """Undo every token written since the last commit, newest first."""
        for slot, prev in reversed(self._journal):
            if prev is None:
                self.gpu.pop(slot, None)
            else:
                self.gpu[slot] = prev
        self._journal.clear()

    def swap(self, pairs: list[tuple[int, int]], *, to_cpu: bool) -> None:
        self.transfers()  # (swapping in takes blocks: evicted ones went to the tier first)
        if to_cpu:
            self._copy_blocks(self.gpu, self.cpu, pairs)
        else:
            self._copy_blocks(self.cpu, self.gpu, pairs)

    def rotate(self, rotations: list[tuple[int, int, int]]) -> None:
        """StreamingLLM's sink copies: in token terms a copy (the rotation changes the keys, not whose they are)."""
        self.copy([(src, dst) for src, dst, _ in rotations])

    def read(self, seq_id: Hashable, group: int = 0) -> list[int | None]:
        """The sequence's tokens through its block table of a group (None where a policy or the
        window released the block)."""
        bs = self.mgr.block_size
        mem = self.cpu if self.mgr.is_swapped(seq_id) else self.gpu
        table = self.mgr.block_table(seq_id, group)
        return [None if table[t // bs] is None else mem.get(table[t // bs] * bs + t % bs)
                for t in range(self.mgr.num_tokens(seq_id))]  # fmt: skip

    def read_attended(self, seq_id: Hashable) -> list[int | None]:
        """What attention reads: the compacted table of `attention_table`."""
        bs = self.mgr.block_size
        table, missing = self.mgr.attention_table(seq_id)
        n = self.mgr.num_tokens(seq_id) - missing
        return [self.gpu.get(table[t // bs] * bs + t % bs) for t in range(n)]

    def check(self, computed: Mapping[Hashable, int] | None = None) -> None:
        """Every sequence reads back its own tokens: all of them, or its first `computed[seq_id]`
        (the tokens whose KV the model has written)."""
        assert set(self.mgr.seq_ids()) == set(self.tokens), "the test's sequences and the manager's differ"
        for seq_id in self.mgr.seq_ids():
            tokens = self.tokens[seq_id]
            assert len(tokens) == self.mgr.num_tokens(seq_id), f"{seq_id}: slots for other than its tokens"
            n = len(tokens) if computed is None else computed[seq_id]
            for g in range(self.mgr.num_groups):
                table, bs = self.mgr.block_table(seq_id, g), self.mgr.block_size
                expect = [None if table[t // bs] is None else tok for t, tok in enumerate(tokens[:n])]  # (holes)
                assert self.read(seq_id, g)[:n] == expect, f"{seq_id} reads back other KV in group {g}"
        self.check_demoted()

    def check_demoted(self) -> None:
        """Every demoted block holds its sequence's tokens, as the queued demotions will leave it (made
        on copies here: the real ones wait for the next operation)."""
        self.queue_demotions()
        pools = {"hot": self.gpu, **self.cold}
        if self.pending:
            pools = {p: dict(m) for p, m in pools.items()}
            self._demote(self.pending, pools)
        bs = self.mgr.block_size
        for seq_id in self.mgr.seq_ids():
            tokens = self.tokens[seq_id]
            for i, (p, b) in self.mgr._table(seq_id).demoted.items():
                got = [pools[p].get(b * bs + o) for o in range(bs)]
                assert got == list(tokens[i * bs : (i + 1) * bs]), f"{seq_id}: block {i} (demoted, {p} {b}) reads {got}"
