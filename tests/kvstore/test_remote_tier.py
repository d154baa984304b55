"""The shared KV tier in the core, with exact block ids, over a real redis-server: blocks one manager
writes through are hits for another (landed in its CPU tier, restored from there); a record that is not
the block asked for is refused; a server that is down is skipped at once."""

from __future__ import annotations

import uuid

import pytest
import redis

from kvpage.core import KVCacheManager
from kvpage.core.cache_key import block_digests
from kvpage.core.remote_tier import RefusedBlock, RemoteTier, decode_record, encode_record
from kvpage.kvstore.redis_store import RedisStore
from tests.core.test_kv_cache_manager import BS, Seqs, toks
from tests.redis_server import free_port

PROMPT = toks(3 * BS + 1)  # three full blocks and one token
DIGESTS = list(block_digests(PROMPT[: 3 * BS], BS, None))


def manager(url: str, namespace: str, num_tier_blocks: int = 4) -> Seqs:
    remote = RemoteTier(RedisStore(url), namespace)
    return Seqs(KVCacheManager(8, BS, watermark=0.0, num_tier_blocks=num_tier_blocks, remote=remote))


def check(s: Seqs, prompt: list[int]):
    """Admission as the engine makes it: a lookup that asks the shared tier waits while the blocks are
    fetched between steps (no network call in the lookup itself), then looks again."""
    adm = s.mgr.check_admission([prompt])
    if adm.prefix.awaiting_fetch:
        s.mgr.fetch_remote()
        adm = s.mgr.check_admission([prompt])
        assert not adm.prefix.awaiting_fetch  # asked once: the request never waits twice
    return adm


def admit(s: Seqs, seq_id: str, prompt: list[int]):
    adm = check(s, prompt)
    s.admit([seq_id], [prompt], adm)
    return adm


def write(s: Seqs, seq_id: str) -> list:
    """One step: the manager's write-through list, the worker's part of it (payloads named after the
    block), the commit."""
    s.mgr.cache_blocks(seq_id, s.tokens[seq_id], len(s.tokens[seq_id]))
    t = s.mgr.take_tier_transfers()
    s.mgr.prefix.remote.store([(d, tk, b"kv of %d" % b) for b, d, tk in t.write_through])
    s.mgr.commit()
    assert s.mgr.prefix.remote.kv_store.flush()
    return t.write_through


def test_records_carry_what_they_are_and_refuse_anything_else():
    d, tokens, payload = DIGESTS[0], tuple(PROMPT[:BS]), bytes(range(256)) * 3
    record = encode_record("ns", d, tokens, payload)
    assert decode_record(record, "ns", d, tokens) == payload
    cases = {
        "another model": (record, "other-ns", d, tokens),
        "another block": (record, "ns", DIGESTS[1], tokens),
        "other tokens": (record, "ns", d, tuple(PROMPT[1 : BS + 1])),
        "damaged": (record[:-1] + bytes([record[-1] ^ 1]), "ns", d, tokens),
        "truncated": (record[:40], "ns", d, tokens),
        "short payload": (record[:-1], "ns", d, tokens),
        "not a record": (b"hello", "ns", d, tokens),
    }
    for why, args in cases.items():
        with pytest.raises(RefusedBlock):
            decode_record(*args)
            pytest.fail(why)


def test_blocks_written_by_one_manager_are_hits_on_another(redis_server):
    ns = f"test-{uuid.uuid4().hex}"
    a = manager(redis_server.url, ns)
    admit(a, "a", PROMPT)
    assert a.mgr.block_table("a") == [0, 1, 2, 3]
    written = write(a, "a")
    assert written == [(b, DIGESTS[b], tuple(PROMPT[b * BS : (b + 1) * BS])) for b in range(3)]
    batches, _ = a.mgr.events.since(0)
    remote = [e for e in batches[-1].events if e.medium == "remote"]
    assert [e.block_hashes[0] for e in remote] == [d.hex() for d in DIGESTS]
    a.check()

    b = manager(redis_server.url, ns)
    adm = admit(b, "b", PROMPT)
    assert adm.prefix.tier_block_ids == {0: 0, 1: 1, 2: 2} and adm.prefix.num_tokens == 3 * BS
    t = b.mgr.take_tier_transfers()
    assert t.fetched == [(0, b"kv of 0"), (1, b"kv of 1"), (2, b"kv of 2")]  # (tier block, payload)
    assert t.restore == [(0, 0), (1, 1), (2, 2)]  # (tier block, GPU block)
    assert b.mgr.block_table("b") == [0, 1, 2, 3]
    assert t.write_through == []  # it read them there: nothing to write back
    b.cache("b")
    b.check()
    st = b.mgr.stats()
    assert st.prefix_hit_tokens == 3 * BS and st.tier_hit_tokens == 3 * BS
    assert b.mgr.prefix.remote.stats.hit_blocks == 3
    b.free("b")
    b.check()

    c = manager(redis_server.url, f"{ns}-other-model")  # another namespace: nothing of theirs is found
    assert check(c, PROMPT).prefix.num_tokens == 0


def test_a_damaged_or_foreign_record_is_refused_and_the_rest_computed(redis_server):
    ns = f"test-{uuid.uuid4().hex}"
    a = manager(redis_server.url, ns)
    admit(a, "a", PROMPT)
    write(a, "a")
    server = redis.Redis.from_url(redis_server.url)
    key = a.mgr.prefix.remote.key
    record = server.get(key(DIGESTS[1]))
    server.set(key(DIGESTS[1]), record[:-1] + bytes([record[-1] ^ 0xFF]))  # one byte of block 1's KV
    foreign = encode_record("some other model", DIGESTS[2], tuple(PROMPT[2 * BS : 3 * BS]), b"kv of 2")
    server.set(key(DIGESTS[2]), foreign)

    b = manager(redis_server.url, ns)
    adm = admit(b, "b", PROMPT)
    assert adm.prefix.tier_block_ids == {0: 0} and adm.prefix.num_tokens == BS  # block 0 only
    assert b.mgr.prefix.remote.stats.refused_blocks == 1  # the fetch stops at the first refusal
    t = b.mgr.take_tier_transfers()
    assert t.fetched == [(0, b"kv of 0")]
    assert [w[0] for w in t.write_through] == []  # nothing registered yet: the step computes blocks 1, 2
    b.cache("b")
    b.check()
    server.close()

    server = redis.Redis.from_url(redis_server.url)
    server.set(key(DIGESTS[0]), foreign)  # under block 0's key, another model's record: refused too
    c = manager(redis_server.url, ns)
    assert check(c, PROMPT).prefix.num_tokens == 0
    assert c.mgr.prefix.remote.stats.refused_blocks == 1
    server.close()


def test_a_server_that_is_down_is_skipped_at_once_and_retried_later():
    clock = [0.0]
    remote = RemoteTier(RedisStore(f"redis://127.0.0.1:{free_port()}"), "ns", retry_after=5.0,
                        clock=lambda: clock[0])  # fmt: skip
    s = Seqs(KVCacheManager(8, BS, watermark=0.0, num_tier_blocks=4, remote=remote))
    asked = s.mgr.check_admission([PROMPT]).prefix
    assert asked.num_tokens == 0 and asked.awaiting_fetch and remote.stats.errors == 0  # no call in the lookup
    assert s.mgr.fetch_remote() == 0  # the call, between steps
    assert remote.stats.errors == 1 and not remote.stats.up and not remote.available
    admit(s, "a", PROMPT)  # asked again: not called while it is down
    assert remote.stats.errors == 1
    s.mgr.cache_blocks("a", PROMPT, len(PROMPT))
    assert s.mgr.take_tier_transfers().write_through == []  # nothing sent to a server that is down
    s.mgr.commit()
    s.check()
    clock[0] = 6.0  # past retry_after: asked again (still down)
    s2 = Seqs(KVCacheManager(8, BS, watermark=0.0, num_tier_blocks=4, remote=remote))
    check(s2, PROMPT)
    assert remote.stats.errors == 2
    remote.close()
