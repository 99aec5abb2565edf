"""The kernel pool's helpers ask ahead for the weights of the product expected next
(``meshnode.engine.cpu.pool``: AHEAD_BYTES): the bytes each helper is told are the first of
its range in the product that followed this one the last time."""

from __future__ import annotations

import numpy as np
from numba import cfunc, types

from meshnode.engine.cpu import pool, pool_words
from meshnode.engine.cpu.pool import KernelPool
from tests.engine.test_kernel_pool import idle_gauge

ROW_BYTES = 256


@cfunc(types.void(types.int64, types.int64, types.int64))
def _nothing(st_addr, who, ch):  # type: ignore[no-untyped-def]
    # a chunk function that computes nothing: only the pool's dealing is looked at
    pass


def _product(p: KernelPool, parts: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Post a product of ``parts`` (one activation row of ROW_BYTES) on two threads."""
    n_out = sum(part.shape[0] for part in parts)
    x, out = np.zeros(ROW_BYTES, np.float32), np.zeros((1, n_out), np.float32)
    assert _nothing.address is not None
    assert p.run(_nothing.address, parts, x, out, 2)


def _ahead(p: KernelPool) -> tuple[int, int]:
    """The bytes helper 1 was told to ask for: (first, end) addresses."""
    at = pool.COUNTS + 8
    return int(p._st[at + pool_words.AHEAD]), int(p._st[at + pool_words.AHEAD_END])


def _parts(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    empty = np.zeros((0, ROW_BYTES), np.uint8)
    return np.zeros((rows, ROW_BYTES), np.uint8), empty, empty


def test_a_helper_is_told_the_start_of_its_range_in_the_product_that_came_next() -> None:
    p = KernelPool(idle_gauge(2))
    a, b, small = _parts(4096), _parts(12_000), _parts(64)  # 1 MiB, 2.9 MiB, 16 KiB
    for parts in (a, small, b, a):  # the small one (an attention's block) counts for nothing
        _product(p, parts)
    rows = pool.chunk_rows(b[0].shape[0], ROW_BYTES, 1, 2)
    chunks = -(-b[0].shape[0] // rows)
    first = b[0].ctypes.data + chunks // 2 * rows * ROW_BYTES  # helper 1's first chunk of b
    end = min(first + pool.AHEAD_BYTES, b[0].ctypes.data + b[0].nbytes)
    assert _ahead(p) == (first, end)
    _product(p, small)
    assert _ahead(p) == (first, end)  # still b's
    _product(p, b)  # b came before a, which is a's range start now
    rows = pool.chunk_rows(a[0].shape[0], ROW_BYTES, 1, 2)
    first = a[0].ctypes.data + -(-a[0].shape[0] // rows) // 2 * rows * ROW_BYTES
    assert _ahead(p) == (first, min(first + pool.AHEAD_BYTES, a[0].ctypes.data + a[0].nbytes))
    p.set_ahead(0)  # none
    for parts in (a, b, a):
        _product(p, parts)
    first, end = _ahead(p)
    assert first == end


def test_an_idle_helper_asks_for_its_bytes_ahead_and_still_sleeps() -> None:
    """The compiled spin with bytes ahead to ask for: it runs through them (prefetches:
    no fault, no result) and returns to sleep after its spins."""
    weights = np.zeros(3 << 20, np.uint8)
    st = np.zeros((1 + pool.AREAS) * pool.WORDS, np.int64)
    st[pool.ACTIVE], st[pool.HELPERS], st[pool.SPINS] = 1, 1, 20_000  # helper 1 may not claim
    at = pool.COUNTS + 8
    st[at + pool_words.AHEAD] = weights.ctypes.data
    st[at + pool_words.AHEAD_END] = weights.ctypes.data + weights.nbytes
    pool_words._helper_spin(st, 1)
    assert st[pool.SLEEPING + 1] == 1


def test_each_helpers_span_starts_its_range_within_its_part() -> None:
    """Three threads, 11 chunks of 16 rows (7 of a part of 100 rows, 4 of one of 50):
    helper 1 takes chunks 3-6 (a's rows 48-99), helper 2 chunks 7-10 (all of b)."""
    wide = 1024  # bytes a row: 150 KiB in all, above AHEAD_MIN_BYTES
    a = np.zeros((100, wide), np.uint8)
    b = np.zeros((50, wide), np.uint8)
    parts = (a, b, np.zeros((0, wide), np.uint8))
    at_a, at_b = a.ctypes.data, b.ctypes.data
    spans = pool._spans(parts, 16, 3, 1 << 30)
    assert spans == ((at_a + 48 * wide, at_a + a.nbytes), (at_b, at_b + b.nbytes))
    first = at_a + 48 * wide
    assert pool._spans(parts, 16, 3, 1024) == ((first, first + 1024), (at_b, at_b + 1024))
