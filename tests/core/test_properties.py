"""Property-based tests: random operation sequences against the KV-cache manager.

The test owns every sequence's tokens (as requests do) and a token-level model of the physical
memory (`KVMemory`). Operations are grouped into steps, as the scheduler groups them: a step
allocates, computes (writes KV, `cache_blocks`), forks and admits, and then either runs (`commit`)
or fails (`discard_uncommitted`: its KV writes are undone, the sequences it created are freed and
the others fall back to what they had computed before it). Every operation is followed by
`check_invariants(tokens)` and by reading every sequence's computed tokens back through its block
table, so a plan that overwrote a shared block, lost a copy-on-write, swapped the wrong block or
served a hit whose KV was never written is caught where it happens. Prompts given as segments copy
each reused segment's own cached KV slot by slot (segments.py), under the same interleaving. Each run
ends by freeing everything and checking the pools (those of demoted blocks too) are fully free.
"""

import os

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpage.core import AdmissionStatus, KVCacheManager
from kvpage.core.eviction import H2O, Demote, EvictionWindows, StreamingLLM
from kvpage.core.kv_spec import FULL, ChunkedLocal, RecurrentState, SlidingWindow, needed_from
from kvpage.core.segments import segment_spans
from tests.core.kv_memory import KVMemory

# A few shared "system prompts" so that random prompts often share prefixes.
PREFIXES = [[], list(range(1, 9)), list(range(1, 5)) + [9, 9, 9, 9], list(range(40, 52))]
tokens = st.integers(min_value=0, max_value=5)  # a tiny vocabulary makes identical blocks common
SETUP = dict(  # the manager's shape, drawn for each run
    num_blocks=st.integers(2, 14),
    block_size=st.sampled_from([1, 2, 3, 4]),
    num_cpu_blocks=st.integers(0, 8),
    caching=st.booleans(),
    watermark=st.sampled_from([0.0, 0.1]),
    num_tier_blocks=st.sampled_from([0, 0, 1, 3]),
)


class ManagerMachine(RuleBasedStateMachine):
    @initialize(**SETUP)
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks, cold_blocks=None,
              layer_spec=FULL):  # fmt: skip
        self.mgr = KVCacheManager(
            num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=caching, watermark=watermark,
            num_tier_blocks=num_tier_blocks, cold_blocks=cold_blocks, layer_spec=layer_spec,
        )  # fmt: skip
        self.tokens: dict[str, list[int]] = {}  # every sequence's token ids: the test owns them
        self.computed: dict[str, int] = {}  # leading tokens whose KV the "model" has written
        self.mem = KVMemory(self.mgr, self.tokens)
        self.created: set[str] = set()  # sequences created in the current step
        self.step_start: dict[str, int] = {}  # computed count before the current step, of those it touched
        self.next_id = 0
        # prompts of segments (seq_plan.py: SegmentFill, as the scheduler keeps it per sequence)
        self.filled: dict[str, list[tuple[int, int]]] = {}  # spans whose KV a segment's copy wrote
        self.exact_upto: dict[str, int] = {}  # where a sequence's exactly computed KV ends (its first copy)
        self.docs: list[list[int]] = []  # prompts admitted so far: a later prompt's segments
        self.held: list[int] = []  # the segments' cached blocks the current step holds (sources of its copies)

    policies: list = [None]  # eviction policies given to new sequences in turn (EvictingManagerMachine)

    def policy_of(self, seq_id: str):
        return self.policies[int(seq_id[1:]) % len(self.policies)]

    def resident(self):
        return [s for s in self.mgr.seq_ids() if not self.mgr.is_swapped(s)]

    def swapped(self):
        return [s for s in self.mgr.seq_ids() if self.mgr.is_swapped(s)]

    def untouched(self):
        """Sequences the current step has not scheduled: the only ones that may be freed or preempted
        mid-step (blocks registered by a step must stay held until it ends)."""
        return [s for s in self.mgr.seq_ids() if s not in self.created and s not in self.step_start]

    def draw_fork(self, data) -> tuple[str, int | None]:
        """A resident parent, and how many of its full blocks a child shares (None: all of them)."""
        parent = data.draw(st.sampled_from(self.resident()))
        num_full = self.mgr.num_tokens(parent) // self.mgr.block_size
        return parent, data.draw(st.none() | st.integers(0, num_full))

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id - 1}"

    def touch(self, seq_id):
        self.step_start.setdefault(seq_id, self.computed[seq_id])

    def created_now(self, seq_id, tokens, computed):
        self.tokens[seq_id], self.computed[seq_id] = tokens, computed
        self.created.add(seq_id)

    def forget(self, seq_id):
        del self.tokens[seq_id], self.computed[seq_id]
        self.filled.pop(seq_id, None)
        self.exact_upto.pop(seq_id, None)

    def cacheable(self, seq_id, n: int) -> int:
        """Of its first n tokens, those the prefix cache may register (nothing from a segment's copy on)."""
        return min(n, self.exact_upto.get(seq_id, n))

    def run_tokens(self, seq_id, start: int, end: int) -> None:
        """The model computes tokens [start, end) of a sequence, skipping the spans a segment's copy
        filled (the scheduler's runs do: their KV is there already)."""
        pos = start
        for a, b in self.filled.get(seq_id, []):
            if a < end and b > pos:
                if a > pos:
                    self.mem.write(seq_id, pos, a)
                pos = b
        if pos < end:
            self.mem.write(seq_id, pos, end)

    def remember(self, prompt):
        """A prompt a later one may give as a segment (its own KV is cached once computed)."""
        if prompt not in self.docs:
            self.docs = [*self.docs[-5:], list(prompt)]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(tokens, max_size=10), salt=st.sampled_from([None, "t"]))
    def add(self, prefix, suffix, salt):
        prompt = prefix + suffix
        if not prompt:
            return
        self.remember(prompt)
        seq_id = self.new_id()
        hit = self.mgr.find_cached_prefix(prompt, salt)
        bs, partial = self.mgr.block_size, hit.partial.num_tokens if hit.partial else 0
        assert hit.num_tokens < len(prompt) and hit.num_tokens == len(hit.block_ids) * bs + partial and partial < bs
        admission = self.mgr.check_admission([prompt], salt)
        assert admission.prefix.block_ids == hit.block_ids and admission.shared_blocks == [0]
        before = self.mgr.stats()
        alloc = self.mgr.allocate_slots(seq_id, len(prompt) - hit.num_tokens, hit, self.policy_of(seq_id))
        if alloc is None:  # (admission would have dropped a partial hit whose pinned source does not fit)
            assert admission.status is not AdmissionStatus.NOW or (hit.partial and not admission.prefix.partial)
            assert self.mgr.stats() == before and not self.mgr.has_sequence(seq_id)
            return
        partial_copy = [(hit.partial.block_id, self.mgr.block_table(seq_id)[len(hit.block_ids)])] if partial else []
        if partial:
            event("partial prefix hit")
        assert alloc.copies == partial_copy
        self.mem.transfers()  # hits on the CPU tier are copied back into their new blocks
        self.mem.copy_before_writes(alloc.copies)
        self.created_now(seq_id, prompt, hit.num_tokens)  # the hits' KV is there already

    @rule(
        data=st.data(),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(tokens, min_size=1, max_size=10),
        num_siblings=st.integers(0, 2),
        salt=st.sampled_from([None, "t"]),
        use_prefix_cache=st.booleans(),
        keep_watermark=st.booleans(),
    )
    def admit_group(self, data, prefix, suffix, num_siblings, salt, use_prefix_cache, keep_watermark):
        """A request with several live sequences (samples or beams brought back) enters at once."""
        lead = prefix + suffix
        self.remember(lead)
        lists = [lead]
        for _ in range(num_siblings):
            agree = data.draw(st.integers(0, len(lead)))
            lists.append(lead[:agree] + data.draw(st.lists(tokens, min_size=0 if agree else 1, max_size=8)))
        adm = self.mgr.check_admission(lists, salt, use_prefix_cache=use_prefix_cache, keep_watermark=keep_watermark)
        hits = adm.prefix.block_ids
        bs, pool = self.mgr.block_size, self.mgr.pool
        assert use_prefix_cache or hits == []
        if adm.status is AdmissionStatus.NEVER:
            assert adm.blocks_needed + len(hits) > pool.num_total
            assert (f"its {len(lists)} sequences need" if len(lists) > 1 else "it needs") in adm.reason
            return
        assert adm.reason is None and (adm.status is AdmissionStatus.NOW) == (adm.blocks_needed <= adm.blocks_available)
        if adm.status is not AdmissionStatus.NOW:
            return
        ids = [self.new_id() for _ in lists]
        free_before = pool.num_free
        tiered = adm.prefix.tier_block_ids  # hits on the CPU tier (None in hits): each takes a new block
        taken_hits = sum(pool.blocks[b].ref_count == 0 for i, b in enumerate(hits) if i not in tiered and b is not None)
        partial = adm.prefix.partial
        if partial is not None:
            event("partial prefix hit (admitted)")
        taken_hits += partial is not None and pool.blocks[partial.block_id].ref_count == 0  # (pinned for the step)
        copies = self.mgr.admit(ids, lists, adm, self.policy_of(ids[0]))
        assert copies == ([(partial.block_id, self.mgr.block_table(ids[0])[len(hits)])] if partial else [])
        self.mem.transfers()
        self.mem.copy_before_writes(copies)
        taken = free_before - pool.num_free
        if all(s is FULL for s in self.mgr.specs):
            assert taken == adm.blocks_needed + taken_hits  # the plan's count is exact
        else:  # (a partial hit or a sibling may let a window release some of them at once)
            assert taken <= adm.blocks_needed + taken_hits
        lead_table = self.mgr.block_table(ids[0])
        assert all(lead_table[i] == b for i, b in enumerate(hits) if i not in tiered)  # (a window's: holes too)
        for i, (seq_id, toks, m) in enumerate(zip(ids, lists, adm.shared_blocks, strict=True)):
            assert self.mgr.num_tokens(seq_id) == len(toks)
            mine = self.mgr.block_table(seq_id)[:m]  # (a window may have released some of them at once)
            assert all(a == b or (a is None and self.mgr.layer_spec is not FULL) for a, b in zip(mine, lead_table))
            assert toks[: m * bs] == lead[: m * bs]
            # KV written so far: the hits (the lead computes the rest of the blocks it shares later)
            lead_computed = adm.prefix.num_tokens if use_prefix_cache else 0
            # (a sibling never computes what its window released: the lead computes those blocks)
            sib = max(min(m * bs, len(hits) * bs), self.mgr._table(seq_id).released * bs)
            self.created_now(seq_id, list(toks), lead_computed if i == 0 else sib)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def append(self, data):
        """Some sequences get slots for new tokens, one after the other, taking exactly the blocks
        `num_blocks_to_grow` predicted (copy-on-write of shared partial blocks included)."""
        group = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=3, unique=True))
        growth = [(s, data.draw(st.lists(tokens, min_size=1, max_size=6))) for s in group]
        predicted = self.mgr.num_blocks_to_grow([(s, len(new)) for s, new in growth])
        predicted -= self.mgr.num_blocks_for_sinks(group)  # (prepare_sinks takes those, not allocate_slots)
        free_before, all_fit = self.mgr.pool.num_free, True
        for seq_id, new in growth:
            before = (self.mgr.stats(), self.mgr.block_table(seq_id))
            alloc = self.mgr.allocate_slots(seq_id, len(new))
            if alloc is None:
                assert (self.mgr.stats(), self.mgr.block_table(seq_id)) == before
                all_fit = False
                continue
            assert len(alloc.copies) <= self.mgr.num_groups  # (copy-on-write: one a group at most)
            self.touch(seq_id)
            self.tokens[seq_id].extend(new)
            self.mem.transfers()
            self.mem.copy(alloc.copies)
        assert all_fit or predicted > free_before
        if all_fit:
            assert free_before - self.mgr.pool.num_free == predicted

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def compute(self, data):
        """The step computes tokens [computed, n) of a sequence: the model writes their KV, and the
        scheduler registers the full blocks (hits for sequences admitted later in the same step)."""
        seq_id = data.draw(st.sampled_from(self.resident()))
        start = self.computed[seq_id]
        n = data.draw(st.integers(start, self.mgr.num_tokens(seq_id)))
        self.touch(seq_id)
        self.run_tokens(seq_id, start, n)
        self.mgr.cache_blocks(seq_id, self.tokens[seq_id], self.cacheable(seq_id, n))
        self.computed[seq_id] = n

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data):
        parent, num_blocks = self.draw_fork(data)
        child = self.new_id()
        table, spec, bs = self.mgr.block_table(parent), self.mgr.layer_spec, self.mgr.block_size
        if spec is not FULL and num_blocks is not None and None in table[needed_from(spec, num_blocks * bs, bs) :
                                                                          num_blocks]:  # fmt: skip
            with pytest.raises(ValueError, match="the window reads one that was released"):
                self.mgr.fork(parent, child, num_blocks)
            return
        if spec is FULL and num_blocks and table[num_blocks - 1] is None:  # would end on a hole
            with pytest.raises(ValueError, match="the last of them was evicted"):
                self.mgr.fork(parent, child, num_blocks)
            return
        self.mgr.fork(parent, child, num_blocks)
        n = len(self.tokens[parent]) if num_blocks is None else num_blocks * self.mgr.block_size
        self.created_now(child, self.tokens[parent][:n], min(n, self.computed[parent]))
        self.filled[child] = [(a, min(b, n)) for a, b in self.filled.get(parent, []) if a < n]  # (plan.fork)
        if parent in self.exact_upto:
            self.exact_upto[child] = self.exact_upto[parent]

    @rule(ok=st.booleans())
    def end_step(self, ok):
        if ok:
            self.mgr.commit()
            self.mem.commit()
        else:
            self.mgr.discard_uncommitted()  # before any of the step's sequences is freed
            self.mem.rollback()
            for seq_id in self.created:
                if self.mgr.has_sequence(seq_id):
                    self.mgr.free(seq_id)
                    self.forget(seq_id)
            for seq_id, n in self.step_start.items():
                if seq_id in self.computed:
                    self.computed[seq_id] = n
        self.created.clear()
        self.step_start.clear()
        self.held = []
        assert self.mgr.prefix.pinned_blocks() == []  # the step's copies ran: their sources are let go

    @precondition(lambda self: self.untouched())
    @rule(data=st.data())
    def free(self, data):  # finished or aborted (mid-prefill when computed < tokens)
        seq_id = data.draw(st.sampled_from(self.untouched()))
        if data.draw(st.booleans()):  # as the scheduler frees a sequence that ends: its tail stays cached
            self.mgr.free(seq_id, self.tokens[seq_id], self.cacheable(seq_id, self.computed[seq_id]))
            if any(self.mgr.prefix.is_tail(b) for b in self.mgr.pool.blocks):
                event("a tail block cached")
        else:
            self.mgr.free(seq_id)
        self.forget(seq_id)

    @precondition(lambda self: [s for s in self.untouched() if not self.mgr.is_swapped(s)])
    @rule(data=st.data())
    def swap_out(self, data):
        victims = [s for s in self.untouched() if not self.mgr.is_swapped(s)]
        group = data.draw(st.lists(st.sampled_from(victims), min_size=1, max_size=3, unique=True))
        before = self.mgr.stats()
        pairs = self.mgr.swap_out(group)
        if pairs is None:
            assert self.mgr.stats() == before
            return
        self.mem.swap(pairs, to_cpu=True)

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.lists(st.sampled_from(self.swapped()), min_size=1, max_size=3, unique=True))
        before = self.mgr.stats()
        pairs = self.mgr.swap_in(group)
        if pairs is None:
            assert self.mgr.stats() == before
            return
        self.mem.swap(pairs, to_cpu=False)

    @invariant()
    def consistent(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants(self.tokens)
        self.mem.check(self.computed)
        pinned = self.mgr.prefix.pinned_blocks()
        assert all(pinned.count(b) >= self.held.count(b) for b in self.held)  # held until the step ends

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        self.end_step(ok=True)
        for seq_id in self.mgr.seq_ids():
            self.mgr.free(seq_id)
        self.mgr.check_invariants()
        st_ = self.mgr.stats()
        assert st_.used_blocks == 0 and st_.cpu_used_blocks == 0
        assert st_.free_blocks == st_.total_blocks and st_.logical_blocks == 0
        assert all(pool.num_free == pool.num_total for pool in self.mgr.eviction.cold.values())


SCALE = float(os.environ.get("KVPAGE_PROPERTY_SCALE", "0.7"))  # CI: 700 examples; `make test-slow`: 10,000


def machine_settings(max_examples: int, steps: int):
    return settings(max_examples=int(max_examples * SCALE), stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip


ManagerMachine.TestCase.settings = machine_settings(1000, 30)
TestManagerProperties = ManagerMachine.TestCase


class TieredManagerMachine(ManagerMachine):
    """The same, under the pressure that makes the CPU tier work: caching on, a small pool that keeps
    evicting registered blocks into the tier, and prompts that come back to hit them there."""

    @initialize(
        num_blocks=st.integers(2, 6),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.integers(0, 4),
        caching=st.just(True),
        watermark=st.just(0.0),
        num_tier_blocks=st.integers(1, 6),
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks):
        super().setup(num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks)
        self.seen: list[list[int]] = []  # prompts of sequences that were freed

    def forget(self, seq_id):
        self.seen.append(list(self.tokens[seq_id]))
        super().forget(seq_id)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def complete(self, data):
        """The step ends; then a sequence runs its remaining tokens in a step of its own and finishes:
        its full blocks stay registered, free, ready to be evicted into the tier."""
        self.end_step(ok=True)
        if not self.resident():
            return
        seq_id = data.draw(st.sampled_from(self.resident()))
        n = self.mgr.num_tokens(seq_id)
        self.run_tokens(seq_id, self.computed[seq_id], n)
        self.mgr.cache_blocks(seq_id, self.tokens[seq_id], self.cacheable(seq_id, n))
        self.mgr.commit()
        self.mem.commit()
        self.mgr.free(seq_id, self.tokens[seq_id], self.cacheable(seq_id, n))
        self.forget(seq_id)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def come_back(self, data):
        """A prompt seen before comes back (after its blocks may have gone to the tier)."""
        prompt = data.draw(st.sampled_from(self.seen))
        self.add(prompt, [], None)


TieredManagerMachine.TestCase.settings = machine_settings(500, 40)
TestTieredManagerProperties = TieredManagerMachine.TestCase


class SegmentingManagerMachine(ManagerMachine):
    """The same with room for prompts of segments to be admitted beside their cached sources (caching
    on, pools a little larger): copies happen among steps, frees, swaps and failures."""

    @initialize(
        num_blocks=st.integers(8, 20),
        block_size=st.sampled_from([2, 3, 4]),
        num_cpu_blocks=st.integers(0, 6),
        caching=st.just(True),
        watermark=st.just(0.0),
        num_tier_blocks=st.sampled_from([0, 0, 2]),
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks):
        super().setup(num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks)

    def finish(self, n: int) -> None:
        """The oldest n sequences the step has not touched end (as the free rule ends them): the pool
        of this machine would otherwise stay full of live sequences, and prompts wait forever."""
        for seq_id in self.untouched()[:n]:
            self.mgr.free(seq_id, self.tokens[seq_id], self.cacheable(seq_id, self.computed[seq_id]))
            self.forget(seq_id)

    @rule(data=st.data(), salt=st.sampled_from([None, None, None, "t"]), keep=st.booleans(), finish=st.integers(0, 3))
    def cache_doc(self, data, salt, keep, finish):
        """The step ends; then a document runs alone, as a prompt of its own, in a step of its own
        (its KV is what a later prompt that gives it as a segment copies), and ends or stays."""
        doc = data.draw(st.lists(tokens, min_size=1, max_size=3 * self.mgr.block_size))
        self.end_step(ok=True)
        self.finish(finish)
        seq_id = f"s{self.next_id}"
        self.add(doc, [], salt)
        if not self.mgr.has_sequence(seq_id):
            return
        self.run_tokens(seq_id, self.computed[seq_id], len(doc))
        self.mgr.cache_blocks(seq_id, doc, len(doc))
        self.computed[seq_id] = len(doc)
        self.end_step(ok=True)
        if not keep:
            self.mgr.free(seq_id, doc, len(doc))
            self.forget(seq_id)

    @rule(
        data=st.data(),
        first=st.lists(tokens, min_size=1, max_size=3),
        question=st.lists(tokens, min_size=1, max_size=4),
        salt=st.sampled_from([None, None, None, "t"]),
        recompute_blocks=st.sampled_from([0, 0, 1]),
        finish=st.integers(0, 3),
        doc_first=st.booleans(),
    )
    def admit_segments(self, data, first, question, salt, recompute_blocks, finish, doc_first):
        """A prompt given as segments, admitted as the scheduler admits it (seq_plan.py: SegmentFill):
        its middle segments are prompts seen before (or their starts), whose own cached blocks are
        held before admission allocates (given back if the prompt does not fit beside them), then
        copied slot by slot into the new sequence before the step's forward; the first segment is an
        ordinary prefix, the last (the question) is computed. Half the time a document is cached
        just before (`cache_doc`), as a client sends the documents first."""
        if doc_first:
            self.cache_doc(data, salt, data.draw(st.booleans()), finish)
        # prompts seen, and what each sequence has computed (this step's too: not yet a source, being unwritten)
        seen = self.docs + [self.tokens[s][: self.computed[s]] for s in self.mgr.seq_ids() if self.computed[s]]
        if not seen:
            return
        cached = [d for d in seen if self.mgr.num_resident_blocks(d, salt)]  # (drawn more often: they copy)
        some = st.sampled_from(seen)
        if cached:
            some = st.one_of(some, *[st.sampled_from(cached)] * 3)
        bs, pins = self.mgr.block_size, list(self.mgr.prefix.pinned_blocks())
        docs = [d[: min(len(d), 3 * bs)] for d in data.draw(st.lists(some, min_size=1, max_size=2))]  # (short)
        docs = [d[: data.draw(st.just(len(d)) | st.integers(1, len(d)))] for d in docs]  # whole, or its start
        segments = [g for g in [first, *docs, question] if g]
        prompt = [t for g in segments for t in g]
        spans = segment_spans([len(g) for g in segments])
        self.finish(finish)
        hits = self.mgr.hold_segments(prompt, spans, salt)
        before = self.mem.before_writes()
        for i, ((pos, n), chain) in enumerate(zip(spans, hits, strict=True)):
            middle = 0 < i < len(spans) - 1  # (the first is a prefix, the last is computed: neither is held)
            assert chain == (self.mgr.prefix.resident_chain(prompt[pos : pos + n], salt) if middle else [])
            assert len(chain) <= n // bs
            for j, b in enumerate(chain):  # registered, and written by a step that ran: before this one
                assert self.mgr.pool.blocks[b].cache_key.token_ids == tuple(prompt[pos + j * bs : pos + (j + 1) * bs])
                assert [before(b * bs + o) for o in range(bs)] == prompt[pos + j * bs : pos + (j + 1) * bs]
        assert sorted(self.mgr.prefix.pinned_blocks()) == sorted(pins + [b for h in hits for b in h])
        adm = self.mgr.check_admission([prompt], salt)
        if adm.status is not AdmissionStatus.NOW and any(hits):
            event("segments give way")
            self.mgr.release_segments(hits)
            hits = [[] for _ in hits]
            adm = self.mgr.check_admission([prompt], salt)
        if adm.status is not AdmissionStatus.NOW:
            assert sorted(self.mgr.prefix.pinned_blocks()) == sorted(pins)
            return
        seq_id = self.new_id()
        copies = self.mgr.admit([seq_id], [prompt], adm)  # (no eviction policy goes with segments)
        self.mem.transfers()
        self.mem.copy_before_writes(copies)
        computed, copied = adm.prefix.num_tokens, self.mgr.num_segment_tokens_copied
        fills = self.mgr.fill_segments(seq_id, spans, hits, recompute_blocks, computed)
        expect = []  # each middle segment: from its first block not recomputed (nor hit) to its last cached
        for i, ((pos, n), chain) in enumerate(zip(spans, hits, strict=True)):
            start, end = pos + max(recompute_blocks * bs, computed - pos), pos + min(len(chain), n // bs) * bs
            if 0 < i < len(spans) - 1 and start < end:
                expect.append((start, end))
        assert [(f.start, f.end) for f in fills] == expect
        assert self.mgr.num_segment_tokens_copied - copied == sum(e - s for s, e in expect)
        assert all(set(f.source_blocks) <= set(self.mgr.prefix.pinned_blocks()) for f in fills)
        self.mem.copy_slots_before_writes([r for f in fills for r in f.runs])
        if fills:
            event("segments copied")
        read = self.mem.read(seq_id)
        assert all(read[s:e] == prompt[s:e] for s, e in expect)  # the copies land where the prompt has them
        self.held += [b for h in hits for b in h]
        self.created_now(seq_id, prompt, computed)
        self.filled[seq_id] = expect
        if expect:
            self.exact_upto[seq_id] = expect[0][0]


SegmentingManagerMachine.TestCase.settings = machine_settings(150, 30)
TestSegmentingManagerProperties = SegmentingManagerMachine.TestCase


class EvictingManagerMachine(ManagerMachine):
    """The same with eviction policies (StreamingLLM, H2O; tiny windows so that they bite): after a
    step, sequences release blocks from the middle of their tables, leaving holes; StreamingLLM ones
    then take rotated copies of their sinks. Holes must read nothing, everything else its own tokens
    (through the logical table and through what attention reads), and sharers keep their blocks."""

    @initialize(
        num_blocks=st.integers(4, 16),
        block_size=st.sampled_from([1, 2, 3]),
        num_cpu_blocks=st.integers(0, 8),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1]),
        num_tier_blocks=st.sampled_from([0, 2]),
        policies=st.sampled_from([
            [StreamingLLM(sink_tokens=2, window_tokens=3), None, H2O(heavy_tokens=2, recent_tokens=2)],
            [StreamingLLM(sink_tokens=0, window_tokens=2)],
            [H2O(heavy_tokens=0, recent_tokens=1), StreamingLLM(sink_tokens=3, window_tokens=1)],
        ]),
    )  # fmt: skip
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks, policies):
        super().setup(num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks)
        self.policies = policies

    def place(self, seq_id, n: int, mass) -> int:
        """After a step that left n tokens in the cache: the sequence's policy places its blocks. Each
        entry only goes down (resident, then down the policy's ladder, then dropped); every move
        queued for the worker is one entry's, from where it was to where it is; this sequence's
        reference goes, its sharers keep theirs; and what stays outside the recent window fits the
        policy's budget (its ladder's quotas, rung by rung)."""
        table = self.mgr._table(seq_id)
        before, demoted = list(table.block_ids), dict(table.demoted)
        holders = {b: self.mgr.pool.blocks[b].ref_count for b in before if b is not None}
        released = self.mgr.evict(seq_id, n, mass)
        moves = self.mem.queue_demotions()
        win = self.mgr.eviction._windows.get(seq_id)
        if win is None:
            assert released == 0 and not moves and table.block_ids == before
            return 0
        policy, bs, dropped = win.policy, self.mgr.block_size, len(win.policy.ladder) + 1

        def level(ids, tags, i):  # 0: resident; k: the ladder's k-th rung; past the ladder: dropped
            return 0 if ids[i] is not None else policy.ladder.index(tags[i][0]) + 1 if i in tags else dropped

        was = [level(before, demoted, i) for i in range(len(before))]
        now = [level(table.block_ids, table.demoted, i) for i in range(len(before))]
        assert all(a >= b for a, b in zip(now, was, strict=True)), f"a block went up: {was} -> {now}"
        assert released == sum(a == dropped != b for a, b in zip(now, was, strict=True))
        moved = [i for i, (a, b) in enumerate(zip(now, was, strict=True)) if b < a < dropped]
        assert sorted(moves) == sorted(((("hot", before[i]) if was[i] == 0 else demoted[i]) + table.demoted[i])
                                       for i in moved)  # fmt: skip
        for i, b in enumerate(before):
            if b is not None and now[i]:  # this sequence's reference went; every other holder keeps the block
                assert self.mgr.pool.blocks[b].ref_count == holders[b] - 1
        window = getattr(policy, "window_tokens", None) or policy.recent_tokens
        old = [now[i] for i in range(len(before)) if (i + 1) * bs <= n - window]
        quotas = policy.quotas(bs) or (policy.budget_tokens(bs) // bs - policy.window_blocks(bs),)
        for rung in range(len(quotas)):  # (a rung whose pool is full sends its blocks lower)
            assert sum(lv <= rung for lv in old) <= sum(quotas[: rung + 1]), f"{policy}: {old} over {quotas}"
        if released:
            event("blocks dropped")
        if moves:
            event("blocks demoted")
        return released

    @precondition(lambda self: [s for s in self.untouched() if not self.mgr.is_swapped(s)])
    @rule(data=st.data())
    def evict(self, data):
        """After a step: a sequence's policy places its blocks (H2O and Demote rank them by a random
        mass, one value per entry attention read: the resident ones, then the demoted ones)."""
        seq_id = data.draw(st.sampled_from([s for s in self.untouched() if not self.mgr.is_swapped(s)]))
        num_read = len(EvictionWindows.read_order(self.mgr._table(seq_id)))
        mass = data.draw(st.none() | st.lists(st.floats(0, 1), min_size=num_read, max_size=num_read))
        self.place(seq_id, self.computed[seq_id], mass)

    @precondition(lambda self: [s for s in self.untouched() if not self.mgr.is_swapped(s)])
    @rule(data=st.data())
    def run_and_evict(self, data):
        """A whole step of one sequence, as the scheduler runs it: slots for a few new tokens (sink
        copies first, if due), their KV written and registered, the step committed, then its policy."""
        seq_id = data.draw(st.sampled_from([s for s in self.untouched() if not self.mgr.is_swapped(s)]))
        self.run_step(data, seq_id, data.draw(st.lists(tokens, min_size=0, max_size=4)))

    def run_step(self, data, seq_id, new: list[int]) -> bool:
        """One step of `seq_id` with `new` tokens (False: no room for them, nothing done)."""
        need = self.mgr.num_blocks_to_grow([(seq_id, len(new))])
        if need > self.mgr.pool.num_free:
            return False
        alloc = self.mgr.allocate_slots(seq_id, len(new))
        self.touch(seq_id)
        self.tokens[seq_id].extend(new)
        self.mem.transfers()
        self.mem.copy(alloc.copies)
        self.mem.rotate(self.mgr.prepare_sinks(seq_id))
        self.mem.transfers()
        n = self.mgr.num_tokens(seq_id)
        self.run_tokens(seq_id, self.computed[seq_id], n)
        self.mgr.cache_blocks(seq_id, self.tokens[seq_id], self.cacheable(seq_id, n))
        self.computed[seq_id] = n
        self.end_step(ok=True)
        num_read = len(EvictionWindows.read_order(self.mgr._table(seq_id)))  # (ties: each policy's own order)
        mass = st.just([1.0] * num_read) | st.lists(st.floats(0, 1), min_size=num_read, max_size=num_read)
        self.place(seq_id, n, data.draw(mass))
        return True

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def prepare(self, data):
        """StreamingLLM's sink copies, rotated to the evicted length, when there is room: then what
        attention reads is exactly the resident tokens, in order."""
        seq_id = data.draw(st.sampled_from(self.resident()))
        need = self.mgr.num_blocks_for_sinks([seq_id])
        if need > self.mgr.pool.num_free:
            return
        free_before = self.mgr.pool.num_free
        self.mem.transfers()
        rotations = self.mgr.prepare_sinks(seq_id)
        self.mem.transfers()  # (taking a copy may push a cached block into the CPU tier)
        assert free_before - self.mgr.pool.num_free == need
        self.mem.rotate(rotations)
        table, bs = self.mgr.block_table(seq_id), self.mgr.block_size
        computed = self.computed[seq_id]
        expect = [tok for t, tok in enumerate(self.tokens[seq_id][:computed]) if table[t // bs] is not None]
        assert self.mem.read_attended(seq_id)[: len(expect)] == expect


EvictingManagerMachine.TestCase.settings = machine_settings(250, 30)
TestEvictingManagerProperties = EvictingManagerMachine.TestCase


class DemotingManagerMachine(EvictingManagerMachine):
    """The same with Demote (core/eviction): tiny quotas and tiny pools per precision, so that blocks
    go down the ladder, fall a rung lower when a pool is full, and are dropped past its end, beside
    sequences that keep everything or only drop. The moves are the worker's, made first of all in the
    next step (KVMemory: `pending`): until then each source must hold its KV, whatever the manager did
    with the block meanwhile; after, each demoted block holds its sequence's tokens."""

    @initialize(
        num_blocks=st.integers(6, 16),
        block_size=st.sampled_from([1, 1, 2, 3]),
        num_cpu_blocks=st.integers(0, 6),
        caching=st.booleans(),
        watermark=st.just(0.0),
        num_tier_blocks=st.sampled_from([0, 2]),
        policies=st.sampled_from([
            [Demote(hot_tokens=0, int8_tokens=1, int4_tokens=1, recent_tokens=1, cpu_tokens=1)],
            [Demote(hot_tokens=1, int8_tokens=1, int4_tokens=2, recent_tokens=1, cpu_tokens=1), None],
            [Demote(hot_tokens=0, int8_tokens=2, int4_tokens=1, recent_tokens=2), H2O(heavy_tokens=1, recent_tokens=1),
             StreamingLLM(sink_tokens=1, window_tokens=2)],
            [Demote(hot_tokens=0, int8_tokens=0, int4_tokens=3, recent_tokens=2)],
        ]),
        cold_blocks=st.fixed_dictionaries({"int8": st.sampled_from([1, 1, 2, 0]), "int4": st.integers(0, 3),
                                           "cpu": st.integers(0, 2)}),
    )  # fmt: skip
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks, policies,
              cold_blocks):  # fmt: skip
        ManagerMachine.setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks,
                             cold_blocks)  # fmt: skip
        self.policies = policies

    @precondition(lambda self: [s for s in self.untouched() if not self.mgr.is_swapped(s)])
    @rule(data=st.data(), steps=st.integers(1, 8))
    def decode(self, data, steps):
        """A sequence decodes a few tokens, a step each, its policy placing its blocks after each by a
        random mass: blocks go down rung by rung, a better one taking a worse one's room."""
        seq_id = data.draw(st.sampled_from([s for s in self.untouched() if not self.mgr.is_swapped(s)]))
        self.run_step(data, seq_id, [])  # the rest of its prompt first (its slots are there): then room
        for _ in range(steps):
            if not self.run_step(data, seq_id, [data.draw(tokens)]):
                return


DemotingManagerMachine.TestCase.settings = machine_settings(150, 30)
TestDemotingManagerProperties = DemotingManagerMachine.TestCase


class WindowedManagerMachine(ManagerMachine):
    """The same on layers that read a sliding window or chunks (kv_spec.py): each step that runs lets
    the sequences it touched release the blocks their computed tokens no longer need (layer_window.py),
    and every sequence still reads back its own tokens where it holds them. Lookups resume past
    released blocks, forks and siblings share only what their window reads."""

    @initialize(
        **SETUP,
        spec=st.sampled_from([SlidingWindow(1), SlidingWindow(3), SlidingWindow(6), ChunkedLocal(2), ChunkedLocal(5)]),
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks, spec):
        ManagerMachine.setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, num_tier_blocks,
                             layer_spec=spec)  # fmt: skip

    @rule(ok=st.booleans())
    def end_step(self, ok):
        touched = [s for s in {*self.step_start, *self.created} if self.mgr.has_sequence(s)] if ok else []
        super().end_step(ok)
        resident = [s for s in touched if not self.mgr.is_swapped(s)]
        self.mgr.finish_step([(s, self.computed[s], None) for s in resident])  # (commits nothing more)
        for s in resident:
            self.mgr.check_window(s, self.computed[s])
            if any(t.released for t in self.mgr._tables_of(s)):
                event("blocks released behind the window")


WindowedManagerMachine.TestCase.settings = machine_settings(300, 30)
TestWindowedManagerProperties = WindowedManagerMachine.TestCase


class GroupedManagerMachine(WindowedManagerMachine):
    """The same on a model of several KV-cache groups (a full-attention group beside windows or chunks,
    as Gemma's or Qwen2's layers): one table per group over one pool. Every step's writes land in each
    group's slots and every group reads back its own; a hit is every group's at one length, a fork
    shares every group's blocks or refuses, swap moves every group. Requests enter through admission
    (a sequence of several groups starts from every group's hits), one sequence each: the siblings' rule
    is the windowed machine's."""

    @initialize(
        num_blocks=st.integers(6, 40),  # (each group holds a prompt's blocks until its step releases them)
        block_size=st.sampled_from([2, 3, 4]),
        num_cpu_blocks=SETUP["num_cpu_blocks"],
        caching=SETUP["caching"],
        watermark=SETUP["watermark"],
        specs=st.sampled_from(
            [
                (FULL, SlidingWindow(3)),
                (FULL, ChunkedLocal(2)),
                (FULL, SlidingWindow(6), SlidingWindow(6)),
                (FULL, SlidingWindow(1), ChunkedLocal(5)),
                (FULL, RecurrentState()),
                (FULL, SlidingWindow(3), RecurrentState()),
            ]
        ),  # fmt: skip
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, specs):
        ManagerMachine.setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark, 0)
        self.mgr = KVCacheManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=caching,
                                  watermark=watermark, group_specs=specs)  # fmt: skip
        self.mem = KVMemory(self.mgr, self.tokens)

    add = None  # (a sequence of several groups starts from admission's hits only)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(tokens, min_size=1, max_size=10),
        salt=st.sampled_from([None, "t"]),
        use_prefix_cache=st.booleans(),
    )
    def admit_one(self, prefix, suffix, salt, use_prefix_cache):
        prompt = prefix + suffix
        adm = self.mgr.check_admission([prompt], salt, use_prefix_cache=use_prefix_cache)
        hits = adm.groups
        assert len(hits) == self.mgr.num_groups and len({p.num_tokens for p in hits}) == 1
        if adm.status is not AdmissionStatus.NOW:
            return
        if hits[0].num_tokens:
            event("a hit in every group")
        seq_id = self.new_id()
        assert self.mgr.admit([seq_id], [prompt], adm) == []  # (no partial hit: nothing to copy)
        for g, p in enumerate(hits):  # each group's table holds its hits, its holes before them
            assert self.mgr.block_table(seq_id, g)[: len(p.block_ids)] == p.block_ids
        self.created_now(seq_id, list(prompt), hits[0].num_tokens)

    admit_group = None

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data):
        parent, num_blocks = self.draw_fork(data)
        child, bs = self.new_id(), self.mgr.block_size
        if num_blocks is not None and any(
            None in self.mgr.block_table(parent, g)[needed_from(spec, num_blocks * bs, bs) : num_blocks]
            for g, spec in enumerate(self.mgr.specs)
        ):
            with pytest.raises(ValueError, match="released|evicted"):
                self.mgr.fork(parent, child, num_blocks)
            assert not self.mgr.has_sequence(child)
            return
        self.mgr.fork(parent, child, num_blocks)
        n = len(self.tokens[parent]) if num_blocks is None else num_blocks * bs
        self.created_now(child, self.tokens[parent][:n], min(n, self.computed[parent]))
        if any(t.released for t in self.mgr._tables_of(child)):  # (a window's holes, shared)
            event("a fork of released blocks")


GroupedManagerMachine.TestCase.settings = machine_settings(200, 30)
TestGroupedManagerProperties = GroupedManagerMachine.TestCase
