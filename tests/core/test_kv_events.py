"""KV events, exactly: a block is announced stored once its step ran, gone when the pool reuses it,
never at all if its step failed; the CPU tier's copies are a medium of their own; a reset clears;
batches are numbered, a reader that fell behind is told so and resynchronises from a snapshot."""

from kvpage.core import KVCacheManager
from kvpage.core.cache_key import extra_keys_for, hash_block
from kvpage.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from tests.core.test_kv_cache_manager import BS, Seqs, finish, toks


def chain(tokens, salt=None):
    """The hex digests of the full blocks of `tokens`, computed here from the core's hash alone (what a
    router in another process does)."""
    out, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[i * BS : (i + 1) * BS], extra_keys_for(i, salt))
        out.append(parent.hex())
    return out


def events(mgr, since):
    batches, gap = mgr.events.since(since)
    assert not gap
    return [(type(e).__name__, getattr(e, "block_hashes", None), getattr(e, "medium", None)) for b in batches
            for e in b.events]  # fmt: skip


def test_stored_when_the_step_ran_removed_when_reused_never_for_a_failed_step():
    s = Seqs(KVCacheManager(6, BS, watermark=0.0))
    mgr = s.mgr
    prompt = toks(2 * BS + 1)
    s.add("a", prompt, computed=False)
    mgr.cache_blocks("a", prompt, len(prompt))  # registered as the step is scheduled ...
    assert mgr.events.seq == 0  # ... but not announced before it ran
    mgr.commit()
    h = chain(prompt)
    assert events(mgr, 0) == [("BlockStored", [h[0]], "gpu"), ("BlockStored", [h[1]], "gpu")]
    (first, second) = mgr.events.since(0)[0][0].events
    assert first.parent_block_hash is None and second.parent_block_hash == h[0]
    assert second.token_ids == prompt[BS : 2 * BS] and second.block_size == BS
    other = toks(BS + 1, 500)
    s.add("b", other, computed=False)
    mgr.cache_blocks("b", other, len(other))
    mgr.discard_uncommitted()  # the step failed: b's block was never written, never announced
    assert mgr.events.seq == 1
    s.free("a")
    s.free("b")
    s.add("c", toks(6 * BS, 900), computed=False)  # takes every block: a's two are reused
    mgr.commit()
    assert events(mgr, 1) == [("BlockRemoved", [h[1]], "gpu"), ("BlockRemoved", [h[0]], "gpu")]
    assert mgr.events.snapshot() == (2, [])
    finish(s)


def test_the_cpu_tier_is_a_medium_and_a_reset_clears_everything():
    s = Seqs(KVCacheManager(4, BS, watermark=0.0, num_tier_blocks=1))
    mgr = s.mgr
    prompt = toks(2 * BS + 1)
    s.add("a", prompt)  # committed: two blocks stored
    h = chain(prompt)
    s.free("a")
    s.add("b", toks(4 * BS - 1, 1000))  # reuses both: removed from the pool, the tier keeps one copy at a time
    mgr.take_tier_transfers()
    hb = chain(toks(4 * BS - 1, 1000))
    assert events(mgr, 1) == [("BlockRemoved", [h[1]], "gpu"), ("BlockStored", [h[1]], "cpu"),
                              ("BlockRemoved", [h[0]], "gpu"), ("BlockRemoved", [h[1]], "cpu"),
                              ("BlockStored", [h[0]], "cpu"), *[("BlockStored", [d], "gpu") for d in hb]]  # fmt: skip
    seq, held = mgr.events.snapshot()
    assert sorted((e.medium, e.block_hashes[0]) for e in held) == sorted([("cpu", h[0])] + [("gpu", d) for d in hb])
    s.free("b")
    assert mgr.reset_prefix_cache()
    batches, _ = mgr.events.since(seq)
    assert [type(e) for e in batches[-1].events] == [AllBlocksCleared] and mgr.events.snapshot() == (seq + 1, [])
    finish(s)


def test_a_reader_that_fell_behind_is_told_and_the_snapshot_is_as_of_the_latest_batch():
    log = KVEventLog(BS, capacity=2)
    mgr = KVCacheManager(8, BS, watermark=0.0)  # (only to make real keys)
    keys = []
    for i in range(3):  # three batches of one stored block each
        tokens = toks(BS + 1, 100 * i)
        mgr.allocate_slots(f"s{i}", len(tokens))
        mgr.cache_blocks(f"s{i}", tokens, len(tokens))
        keys.append(mgr.pool.blocks[mgr.block_table(f"s{i}")[0]].cache_key)
        log.stored(keys[-1], "gpu")
        assert log.publish().seq == i + 1
    assert log.publish() is None  # nothing changed: no batch
    batches, gap = log.since(0)
    assert gap and [b.seq for b in batches] == [2, 3]  # batch 1 is gone: resync from the snapshot
    assert log.since(1) == (batches, False) and log.since(3) == ([], False)
    log.removed(keys[0], "gpu")
    log.removed(keys[0], "gpu")  # announced gone once
    log.removed(keys[0], "cpu")  # never stored there: nothing
    assert [type(e) for e in log.publish().events] == [BlockRemoved]
    seq, held = log.snapshot()
    assert seq == 4 and sorted(e.block_hashes[0] for e in held) == sorted(k.digest.hex() for k in keys[1:])
    assert all(isinstance(e, BlockStored) and e.medium == "gpu" for e in held)
