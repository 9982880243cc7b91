"""BlockPool and SessionCache on tiny pools: exact block ids, eviction order, integrity."""

from __future__ import annotations

import random
import time

import pytest

from replica.kv import BlockPool, NoFreeBlocks, SessionCache


def test_allocation_is_fifo_with_exact_ids():
    pool = BlockPool(11)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    pool.free(a)
    assert pool.allocate(6) == [5, 6, 7, 8, 9, 10]
    assert pool.allocate(2) == [0, 1]  # freed blocks are reused after never-used ones
    assert pool.num_free == 1
    pool.check_integrity({"a": [0, 1], "b": [3, 4], "c": [5, 6, 7, 8, 9, 10]})


def test_allocation_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1


def test_refcounts_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.incref(a[:1])
    pool.free(a)
    assert pool.refcount(a[0]) == 1 and pool.refcount(a[1]) == 0
    pool.check_integrity({"x": [a[0]]})
    with pytest.raises(AssertionError):
        pool.check_integrity({"x": [a[0]], "y": [a[0]]})  # two owners, ref-count 1
    pool.free([a[0]])
    with pytest.raises(RuntimeError):
        pool.free([a[0]])


def test_integrity_catches_an_owned_free_block():
    pool = BlockPool(3)
    pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity({"x": [0], "y": [2]})


def test_session_claim_keeps_longest_exact_prefix():
    pool = BlockPool(11)
    cache = SessionCache(pool, block_size=4)
    blocks = pool.allocate(3)  # [0, 1, 2] holding tokens 0..9
    cache.retain("s", list(range(10)), blocks)
    assert cache.num_blocks == 3
    # the new prompt diverges at token 6: blocks 0 (tokens 0..3) and 1 (4..5 valid) are kept
    got, n = cache.claim("s", [0, 1, 2, 3, 4, 5, 99, 98, 97, 96])
    assert (got, n) == ([0, 1], 6)
    assert "s" not in cache and pool.refcount(2) == 0
    pool.check_integrity({"stream": got})


def test_session_claim_always_leaves_one_token_to_compute():
    pool = BlockPool(4)
    cache = SessionCache(pool, block_size=4)
    cache.retain("s", [5, 6, 7, 8], pool.allocate(1))
    got, n = cache.claim("s", [5, 6, 7, 8])
    assert n == 3 and got == [0]


def test_retain_frees_blocks_past_computed_tokens():
    pool = BlockPool(6)
    cache = SessionCache(pool, block_size=4)
    cache.retain("s", [1, 2, 3, 4, 5], pool.allocate(3))  # 5 tokens need 2 blocks
    assert cache.num_blocks == 2 and pool.num_free == 4


def test_lru_eviction_order():
    pool = BlockPool(6)
    cache = SessionCache(pool, block_size=2)
    for key in ("a", "b", "c"):
        cache.retain(key, [1, 2, 3], pool.allocate(2))
    assert pool.num_free == 0
    assert cache.evict_lru() == "a"
    cache.retain("a", [1], pool.allocate(1))  # re-retained: now the most recent
    assert [cache.evict_lru(), cache.evict_lru(), cache.evict_lru()] == ["b", "c", "a"]
    assert cache.evict_lru() is None and pool.num_free == 6


def test_randomized_pool_never_loses_a_block():
    rng = random.Random(0)
    pool = BlockPool(32)
    cache = SessionCache(pool, block_size=4)
    streams: dict[str, list[int]] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 4)
            while pool.num_free < n and cache.evict_lru() is not None:
                pass
            if pool.num_free >= n:
                streams[f"s{step}"] = pool.allocate(n)
        elif op < 0.7 and streams:
            key = rng.choice(sorted(streams))
            blocks = streams.pop(key)
            cache.retain(f"sess{rng.randint(0, 5)}", list(range(len(blocks) * 4 - 1)), blocks)
        elif op < 0.9:
            key = f"sess{rng.randint(0, 5)}"
            got, _ = cache.claim(key, list(range(rng.randint(1, 20))))
            if got:
                streams[f"c{step}"] = got
        elif streams:
            pool.free(streams.pop(rng.choice(sorted(streams))))
        owners = dict(streams)
        owners.update(cache.owners())
        pool.check_integrity(owners)


def test_retained_sessions_carry_when_their_turn_finished():
    pool = BlockPool(6)
    cache = SessionCache(pool, block_size=2)
    before = time.time()
    cache.retain("a", [1, 2, 3], pool.allocate(2))
    cache.retain("b", [1], pool.allocate(1))
    first = cache.retained_at()
    assert list(first) == ["a", "b"] and before <= first["a"] <= first["b"] <= time.time()
    blocks, _ = cache.claim("a", [1, 2, 3, 4])  # a's next turn runs, then is retained again
    cache.retain("a", [1, 2, 3, 4, 5], blocks + pool.allocate(1))
    again = cache.retained_at()
    assert list(again) == ["b", "a"] and again["a"] >= first["b"] and again["b"] == first["b"]
