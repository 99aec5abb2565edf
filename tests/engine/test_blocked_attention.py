"""A long segment's attention over GGUF blocks (``blocked_attention``): the reference's
result (``ops.attention``) up to summation order, for every block, window and cache
shape, and bit for bit the same whichever threads compute its blocks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from meshnode.engine import ops
from meshnode.engine.attention import BLOCK_ROWS, _mask, blocked_attention
from meshnode.engine.cpu.tiles import TileThreads, single_threaded_blas


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 256), (2, 2, 16)], ids=["gqa", "mqa", "mha"]
)
@pytest.mark.parametrize("rows", [1, BLOCK_ROWS - 1, BLOCK_ROWS, 3 * BLOCK_ROWS + 5])
@pytest.mark.parametrize("cached", [0, 37])
@pytest.mark.parametrize("window", [None, 1, 50, 4096])
def test_blocks_equal_the_reference(
    heads: int, kv_heads: int, dim: int, rows: int, cached: int, window: int | None
) -> None:
    rng = np.random.default_rng(rows * 7 + cached + (window or 0))
    t = cached + rows
    q = rng.standard_normal((heads, rows, dim)).astype(np.float32) * 2
    keys = rng.standard_normal((kv_heads, t, dim)).astype(np.float32) * 2
    values = rng.standard_normal((kv_heads, t, dim)).astype(np.float32)
    scale = np.float32(dim**-0.5)
    want = ops.attention(np, q, keys, values, float(scale), window)
    got = blocked_attention(q, keys, values, scale, window)
    assert got.shape == want.shape
    assert got.dtype == np.float32
    # a weighted mean of values of magnitude <= 5: float32 rounding of a few ulp of that
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_sees_only_its_window_and_past() -> None:
    """Values that no row may see (the future, or before its window) change nothing."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2 * BLOCK_ROWS, 16)).astype(np.float32)
    keys = rng.standard_normal((1, 2 * BLOCK_ROWS, 16)).astype(np.float32)
    values = rng.standard_normal((1, 2 * BLOCK_ROWS, 16)).astype(np.float32)
    base = blocked_attention(q, keys, values, np.float32(0.25), 8)
    row = BLOCK_ROWS + 3  # sees keys row - 7 .. row
    poisoned = values.copy()
    poisoned[:, row + 1] = poisoned[:, row - 8] = 1e30
    got = blocked_attention(q, keys, poisoned, np.float32(0.25), 8)
    np.testing.assert_array_equal(got[:, row], base[:, row])


@pytest.mark.parametrize("window", [None, 70])
def test_blocks_shared_by_threads_are_bit_identical_to_one_thread(window: int | None) -> None:
    if not single_threaded_blas():
        pytest.skip("no BLAS threadpoolctl can set to one thread: blocks stay serial")
    rng = np.random.default_rng(5)
    rows, t = 5 * BLOCK_ROWS + 9, 6 * BLOCK_ROWS
    q = rng.standard_normal((9, rows, 64)).astype(np.float32)
    keys = rng.standard_normal((3, t, 64)).astype(np.float32)
    values = rng.standard_normal((3, t, 64)).astype(np.float32)
    team = TileThreads()

    def shared(fn: Callable[[int], None], n: int) -> None:
        assert team.run(fn, n, 3)

    got = blocked_attention(q, keys, values, np.float32(0.125), window, shared)
    assert team.posted == 1
    want = blocked_attention(q, keys, values, np.float32(0.125), window)
    np.testing.assert_array_equal(got, want)


# (query row 0's position, first key read): a block reads keys up to its last row
@pytest.mark.parametrize(("q0", "lo"), [(0, 0), (5, 0), (5, 3), (63, 63), (200, 0), (200, 150)])
@pytest.mark.parametrize("window", [None, 1, 40, 4096])
def test_the_mask_touches_what_a_full_mask_does(q0: int, lo: int, window: int | None) -> None:
    """Masking only the columns some row hides sets the same entries as masking every
    column (so a resumed suffix's attention keeps its bits: issue 30)."""
    rng = np.random.default_rng(q0 + lo)
    rows, keys = 24, q0 + 24 - lo
    s = rng.standard_normal((3, 2, rows, keys)).astype(np.float32)
    want = s.copy()
    q_pos = np.arange(q0, q0 + rows)[:, None]
    k_pos = np.arange(lo, lo + keys)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    np.copyto(want, -np.inf, where=hidden)
    _mask(s, q0, lo, window)
    np.testing.assert_array_equal(s, want)
