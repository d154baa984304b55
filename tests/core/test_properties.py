"""Property-based tests: random operation sequences against the KV-cache manager.

Every operation is followed by `check_invariants()` and by reading every sequence back through its
block table from a token-level model of the physical memory (`KVMemory`), so a plan that overwrote
a shared block, lost a copy-on-write or swapped the wrong block is caught where it happens. Each
run ends by freeing everything and checking the pools are fully free.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpage.core import AdmissionStatus, KVCacheManager
from tests.core.kv_memory import KVMemory

# A few shared "system prompts" so that random prompts often share prefixes.
PREFIXES = [[], list(range(1, 9)), list(range(1, 5)) + [9, 9, 9, 9], list(range(40, 52))]
tokens = st.integers(min_value=0, max_value=5)  # a tiny vocabulary makes identical blocks common


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 14),
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_cpu_blocks=st.integers(0, 8),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1]),
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, watermark):
        self.mgr = KVCacheManager(
            num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=caching, watermark=watermark
        )
        self.mem = KVMemory(self.mgr)
        self.computed: dict[str, int] = {}  # tokens whose KV the "model" has reported written
        self.next_id = 0

    def resident(self):
        return [s for s in self.mgr.seq_ids() if not self.mgr.is_swapped(s)]

    def swapped(self):
        return [s for s in self.mgr.seq_ids() if self.mgr.is_swapped(s)]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(tokens, max_size=10), salt=st.sampled_from([None, "t"]))
    def add(self, prefix, suffix, salt):
        prompt = prefix + suffix
        if not prompt:
            return
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        hit = self.mgr.find_cached_prefix(prompt, salt)
        assert hit.num_tokens < len(prompt) and hit.num_tokens % self.mgr.block_size == 0
        admission = self.mgr.check_admission(len(prompt), hit)
        before = self.mgr.stats()
        alloc = self.mgr.allocate_slots(seq_id, prompt[hit.num_tokens :], hit)
        if alloc is None:
            assert admission.status is not AdmissionStatus.NOW
            assert self.mgr.stats() == before and not self.mgr.has_sequence(seq_id)
            return
        self.mem.apply(seq_id, alloc, len(prompt) - hit.num_tokens)
        assert self.mgr.token_ids(seq_id) == prompt
        self.computed[seq_id] = hit.num_tokens

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), new=st.lists(tokens, min_size=1, max_size=6))
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(self.resident()))
        before = (self.mgr.stats(), self.mgr.block_table(seq_id))
        alloc = self.mgr.allocate_slots(seq_id, new)
        if alloc is None:
            assert (self.mgr.stats(), self.mgr.block_table(seq_id)) == before
            return
        assert len(alloc.copies) <= 1
        self.mem.apply(seq_id, alloc, len(new))

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def mark_computed(self, data):
        seq_id = data.draw(st.sampled_from(self.resident()))
        n = data.draw(st.integers(self.computed[seq_id], self.mgr.num_tokens(seq_id)))
        self.mgr.mark_computed(seq_id, n)
        self.computed[seq_id] = n

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.resident()))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.mgr.fork(parent, child)
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: self.mgr.seq_ids())
    @rule(data=st.data())
    def free(self, data):  # finished or aborted (mid-prefill when computed < tokens)
        seq_id = data.draw(st.sampled_from(self.mgr.seq_ids()))
        self.mgr.free(seq_id)
        del self.computed[seq_id]

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=3, unique=True))
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
        self.mgr.check_invariants()
        self.mem.check()

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for seq_id in self.mgr.seq_ids():
            self.mgr.free(seq_id)
        self.mgr.check_invariants()
        st_ = self.mgr.stats()
        assert st_.used_blocks == 0 and st_.cpu_used_blocks == 0
        assert st_.free_blocks == st_.total_blocks and st_.logical_blocks == 0


ManagerMachine.TestCase.settings = settings(
    max_examples=2000,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerProperties = ManagerMachine.TestCase
