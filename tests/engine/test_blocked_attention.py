"""A long segment's attention over GGUF blocks (``blocked_attention``): the reference's
result (``ops.attention``) up to summation order, for every block, window and cache
shape, and bit for bit the same whichever threads compute its blocks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from meshnode.engine import ops
from meshnode.engine.attention import BLOCK_ROWS, blocked_attention
from meshnode.engine.cpu.attention_rows import LANES, block_softmax, first_key
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


@pytest.mark.parametrize("window", [None, 1, 40, 4096])
@pytest.mark.parametrize(("q0", "lo"), [(0, 0), (5, 0), (63, 30), (200, 0), (200, 170)])
def test_block_softmax_is_each_rows_own_softmax(q0: int, lo: int, window: int | None) -> None:
    """The compiled softmax of a block's scores: each row's weights are the softmax of
    the scores it sees (float64 reference) and 0 elsewhere, the same bits as the row
    computed alone (a row's weights do not depend on its block)."""
    rows, group = 24, 2
    lo = min(lo, first_key(q0, window or 0))  # a block reads from its first row's first key
    keys = q0 + rows - lo
    stride = keys + LANES
    rng = np.random.default_rng(q0 * 3 + lo)
    scores = (rng.standard_normal((group * rows, stride)) * 4).astype(np.float32)
    s = scores.copy()
    block_softmax(s.reshape(-1), stride, group * rows, rows, q0, lo, keys, window or 0)
    for r in range(group * rows):
        pos = q0 + r % rows
        c0, c1 = first_key(pos, window or 0) - lo, pos + 1 - lo
        x = scores[r, c0:c1].astype(np.float64)
        want = np.exp(x - x.max())
        np.testing.assert_allclose(s[r, c0:c1], want / want.sum(), rtol=2e-6, atol=1e-9)
        assert not s[r, :c0].any()
        assert not s[r, c1:keys].any()
        alone = scores[r : r + 1].copy()
        block_softmax(alone.reshape(-1), stride, 1, 1, pos, lo, keys, window or 0)
        np.testing.assert_array_equal(alone[0, :keys], s[r, :keys])


@pytest.mark.parametrize("window", [None, 300])
def test_a_suffix_over_a_long_cached_prefix(window: int | None) -> None:
    """A resumed prompt's suffix (issue 30): 70 rows over 1,500 cached positions, against
    a float64 reference."""
    rng = np.random.default_rng(11)
    rows, t = 70, 1570
    q = rng.standard_normal((9, rows, 64)).astype(np.float32)
    keys = rng.standard_normal((3, t, 64)).astype(np.float32)
    values = rng.standard_normal((3, t, 64)).astype(np.float32)
    want = ops.attention(np, q.astype(np.float64), keys.astype(np.float64),
                         values.astype(np.float64), 0.125, window)  # fmt: skip
    got = blocked_attention(q, keys, values, np.float32(0.125), window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
