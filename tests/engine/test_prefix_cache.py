"""The prefix pool (engine.prefix_cache): keys, hits, references, LRU eviction, bounds."""

from __future__ import annotations

import numpy as np
import pytest

from meshnode.engine.kv_cache import KVCache
from meshnode.engine.prefix_cache import (
    PrefixMissError,
    PrefixPool,
    chain_keys,
    resume_length,
)

B = 4  # positions per block in these tables
SHAPE = {"layers": 2, "kv_heads": 1, "head_dim": 3}
PER_BLOCK = 2 * 2 * 1 * B * 3 * 4  # K and V, f32


def pool(blocks: int, salt: str = "run") -> PrefixPool:
    return PrefixPool.for_budget(
        np, budget_bytes=blocks * PER_BLOCK, dtype=np.float32, salt=salt, block=B, **SHAPE
    )


def filled(tokens: list[int]) -> KVCache:
    """A cache whose K/V at position p encode (token, p): what a forward would write."""
    cache = KVCache(np, max_tokens=64, **SHAPE)
    for p, t in enumerate(tokens):
        cache.k[:, :, p] = t * 1000 + p
        cache.v[:, :, p] = -(t * 1000 + p)
    cache.length = len(tokens)
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


def test_store_then_acquire_copies_the_blocks_exactly() -> None:
    p = pool(4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    held = p.store(tokens, filled(tokens), 0)
    assert len(held) == 2
    assert p.cached_blocks(tokens) == 2
    fresh = KVCache(np, max_tokens=64, **SHAPE)
    got_tokens, got = p.acquire(held[-1], fresh)
    assert got == held
    assert got_tokens == tokens[:8]
    assert fresh.length == 8
    ref = filled(tokens)
    np.testing.assert_array_equal(fresh.k[:, :, :8], ref.k[:, :, :8])
    np.testing.assert_array_equal(fresh.v[:, :, :8], ref.v[:, :, :8])
    assert p.stats.hit_tokens == 8
    assert p.stats.stored_blocks == 2


def test_a_miss_changes_nothing() -> None:
    p = pool(4)
    p.store([1, 2, 3, 4], filled([1, 2, 3, 4]), 0)
    cache = filled([9, 9])
    with pytest.raises(PrefixMissError, match="block 0 from the end"):
        p.acquire(p.keys([1, 2, 3, 4, 5, 6, 7, 8])[-1], cache)
    assert cache.length == 2
    assert p.stats.hit_tokens == 0
    assert p.cached_blocks([1, 2, 3, 5]) == 0  # same hash chain start, other tokens


def test_referenced_blocks_are_never_evicted_and_stores_skip_instead() -> None:
    p = pool(2)
    a = list(range(8))
    held = p.store(a, filled(a), 0)
    assert p.usage()["blocks_used"] == 2
    assert p.usage()["blocks_free"] == 0
    b = list(range(100, 108))
    assert p.store(b, filled(b), 0) == []  # the pool is full of blocks in use
    assert p.stats.skipped_blocks == 2
    assert p.cached_blocks(a) == 2
    p.release(held)
    assert p.usage()["blocks_cached"] == 2
    assert len(p.store(b, filled(b), 0)) == 2  # now a's blocks make room
    assert p.cached_blocks(a) == 0
    assert p.stats.evicted_blocks == 2


def test_a_chain_whose_first_block_was_evicted_is_a_miss() -> None:
    p = pool(3)
    a = list(range(8))
    p.release(p.store(a, filled(a), 0))
    p._blocks.pop(p.keys(a)[0])  # as if evicted alone (LRU never does: see above)
    with pytest.raises(PrefixMissError, match="block 1 from the end"):
        p.acquire(p.keys(a)[1], filled([]))


def test_eviction_is_least_recently_used_and_takes_descendants_first() -> None:
    p = pool(3)
    a, b = list(range(8)), list(range(50, 54))
    p.release(p.store(a, filled(a), 0))  # a0 a1
    p.release(p.store(b, filled(b), 0))  # b0: the pool is full
    p.release(p.acquire(p.keys(a)[0], filled([]))[1])  # a0 used again: b0 then a1 are older
    c = list(range(70, 74))
    p.release(p.store(c, filled(c), 0))
    # a1 was the least recently used (its chain's first block was touched after it).
    assert p.cached_blocks(a) == 1
    assert p.cached_blocks(b) == 1
    assert p.cached_blocks(c) == 1


def test_store_extends_what_a_sequence_holds_and_shares_equal_blocks() -> None:
    p = pool(4)
    a = list(range(12))
    first = p.store(a[:4], filled(a[:4]), 0)
    more = p.store(a, filled(a), len(first))
    assert len(more) == 2
    assert p.stats.stored_blocks == 3
    again = p.store(a, filled(a), 0)  # a second sequence with the same prompt
    assert again == first + more
    assert p.stats.stored_blocks == 3
    assert p.usage()["blocks_used"] == 3
    p.release(first + more)
    assert p.usage()["blocks_used"] == 3  # still referenced by the second sequence
    p.release(again)
    assert p.usage() == {
        "blocks_used": 0,
        "blocks_cached": 3,
        "blocks_free": 1,
        "blocks_total": 4,
        "block_tokens": B,
    }


def test_a_zero_budget_pool_caches_nothing_and_bad_sizes_are_refused() -> None:
    p = pool(0)
    assert p.capacity == 0
    assert p.store([1, 2, 3, 4], filled([1, 2, 3, 4]), 0) == []
    with pytest.raises(ValueError, match="bad prefix pool"):
        PrefixPool.for_budget(np, budget_bytes=-1, dtype=np.float32, salt="", **SHAPE)


def test_clear_keeps_the_blocks_in_use() -> None:
    p = pool(4)
    a, b = list(range(4)), list(range(10, 14))
    held = p.store(a, filled(a), 0)
    p.release(p.store(b, filled(b), 0))
    p.clear()
    assert p.cached_blocks(a) == 1
    assert p.cached_blocks(b) == 0
    p.release(held)
