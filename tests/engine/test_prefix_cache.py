"""The prefix index (engine.prefix_cache) over a stage's block pool (engine.kv_pages):
keys, hits by reference, LRU eviction of cached blocks only, the budget."""

from __future__ import annotations

import numpy as np
import pytest

from meshnode.engine.kv_pages import BlockPool, PagedCache
from meshnode.engine.prefix_cache import (
    PrefixMissError,
    PrefixPool,
    chain_keys,
    resume_length,
)

B = 4  # positions per block in these tables
SHAPE = {"layers": 2, "kv_heads": 1, "head_dim": 3}


def pool(blocks: int, budget: int | None = None, salt: str = "run") -> PrefixPool:
    kv = BlockPool(capacity=blocks, dtype=np.float32, block=B, **SHAPE)
    return PrefixPool(kv, salt, blocks if budget is None else budget)


def filled(p: PrefixPool, tokens: list[int]) -> PagedCache:
    """A cache whose K/V at position p encode (token, p): what a forward would write."""
    cache = PagedCache(p.kv, 64)
    cache.reserve(len(tokens))
    for layer in range(2):
        k = np.array([[[t * 1000 + i] * 3 for i, t in enumerate(tokens)]], np.float32)
        cache.write(layer, 0, k, -k)
    cache.advance(0, len(tokens))
    return cache


def test_chain_keys_cover_the_prefix_and_the_salt() -> None:
    a = chain_keys("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], B)
    assert len(a) == 2  # full blocks only
    assert chain_keys("s", [1, 2, 3, 4, 5, 6, 7, 8], B) == a
    # Block 1's key depends on block 0's tokens: the same second block after another first.
    assert chain_keys("s", [0, 2, 3, 4, 5, 6, 7, 8], B)[1] != a[1]
    assert chain_keys("other", [1, 2, 3, 4, 5, 6, 7, 8], B) != a


@pytest.mark.parametrize(
    ("prompt", "cached", "expected"),
    [(9, 2, 8), (8, 2, 4), (8, 1, 4), (4, 1, 0), (1, 5, 0), (0, 0, 0), (100, 3, 12)],
)
def test_resume_length_leaves_the_last_token_to_compute(
    prompt: int, cached: int, expected: int
) -> None:
    assert resume_length(prompt, cached, B) == expected


def test_store_then_acquire_shares_the_blocks_in_place() -> None:
    p = pool(4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    seq = filled(p, tokens)
    held = p.store(tokens, seq, 0)
    assert len(held) == 2
    assert p.cached_blocks(tokens) == 2
    fresh = PagedCache(p.kv, 64)
    got_tokens, got = p.acquire(held[-1], fresh)
    assert got == held
    assert got_tokens == tokens[:8]
    assert fresh.length == 8
    assert fresh.slots() == seq.slots()[:2]  # the same slots: no copy
    for layer in range(2):
        for a, b in zip(fresh.gather(layer, 8), seq.gather(layer, 8), strict=True):
            np.testing.assert_array_equal(a, b)
    assert p.stats.hit_tokens == 8
    assert p.stats.stored_blocks == 2
    assert [p.kv.refs[s] for s in fresh.slots()] == [3, 3]  # two tables and the index


def test_a_miss_changes_nothing() -> None:
    p = pool(4)
    p.store([1, 2, 3, 4], filled(p, [1, 2, 3, 4]), 0)
    cache = filled(p, [9, 9])
    with pytest.raises(PrefixMissError, match="block 0 from the end"):
        p.acquire(p.keys([1, 2, 3, 4, 5, 6, 7, 8])[-1], PagedCache(p.kv, 64))
    assert cache.length == 2
    assert p.stats.hit_tokens == 0
    assert p.cached_blocks([1, 2, 3, 5]) == 0  # same hash chain start, other tokens


def test_blocks_in_use_are_never_evicted_and_a_full_pool_refuses() -> None:
    p = pool(2)
    a = list(range(8))
    seq = filled(p, a)
    p.store(a, seq, 0)
    assert p.usage()["blocks_used"] == 2
    assert p.usage()["blocks_free"] == 0
    with pytest.raises(ValueError, match="KV pool full"):
        filled(p, list(range(100, 104)))
    assert p.cached_blocks(a) == 2
    seq.release_pages()
    assert p.usage()["blocks_cached"] == 2
    b = list(range(100, 108))
    p.store(b, filled(p, b), 0)  # a's cached blocks make room
    assert p.cached_blocks(a) == 0
    assert p.stats.evicted_blocks == 2


def test_a_chain_whose_first_block_was_evicted_is_a_miss() -> None:
    p = pool(3)
    a = list(range(8))
    p.store(a, filled(p, a), 0)
    p._blocks.pop(p.keys(a)[0])  # as if evicted alone (LRU never does: see below)
    with pytest.raises(PrefixMissError, match="block 1 from the end"):
        p.acquire(p.keys(a)[1], PagedCache(p.kv, 64))


def test_eviction_is_least_recently_used_and_takes_descendants_first() -> None:
    p = pool(3)
    a, b = list(range(8)), list(range(50, 54))
    for tokens in (a, b):  # a0 a1, then b0: the pool is full
        seq = filled(p, tokens)
        p.store(tokens, seq, 0)
        seq.release_pages()
    again = PagedCache(p.kv, 64)
    p.acquire(p.keys(a)[0], again)  # a0 used again: b0 then a1 are older
    again.release_pages()
    c = list(range(70, 74))
    p.store(c, filled(p, c), 0)
    # a1 was the least recently used (its chain's first block was touched after it).
    assert p.cached_blocks(a) == 1
    assert p.cached_blocks(b) == 1
    assert p.cached_blocks(c) == 1


def test_store_extends_what_a_sequence_holds_and_keeps_the_first_equal_block() -> None:
    p = pool(8)
    a = list(range(12))
    one = filled(p, a)
    first = p.store(a[:4], one, 0)
    more = p.store(a, one, len(first))
    assert len(more) == 2
    assert p.stats.stored_blocks == 3
    two = filled(p, a)  # a second sequence computed the same prompt
    assert p.store(a, two, 0) == first + more
    assert p.stats.stored_blocks == 3
    assert p.usage()["blocks_used"] == 6
    one.release_pages()
    two.release_pages()
    assert p.usage() == {
        "blocks_used": 0,
        "blocks_cached": 3,
        "blocks_free": 5,
        "blocks_total": 8,
        "block_tokens": B,
    }


def test_trim_keeps_the_budget_of_cached_blocks() -> None:
    p = pool(8, budget=2)
    a = list(range(12))
    seq = filled(p, a)
    p.store(a, seq, 0)
    p.trim()
    assert p.cached_blocks(a) == 3  # in use: not cached
    seq.release_pages()
    p.trim()
    assert p.usage()["blocks_cached"] == 2
    assert p.cached_blocks(a) == 2  # the chain's last block went first
    with pytest.raises(ValueError, match="bad prefix pool"):
        pool(2, budget=-1)


def test_clear_keeps_the_blocks_in_use() -> None:
    p = pool(4)
    a, b = list(range(4)), list(range(10, 14))
    held = filled(p, a)
    p.store(a, held, 0)
    other = filled(p, b)
    p.store(b, other, 0)
    other.release_pages()
    p.clear()
    assert p.cached_blocks(a) == 1
    assert p.cached_blocks(b) == 0
    held.release_pages()
    assert p.usage()["blocks_cached"] == 1
