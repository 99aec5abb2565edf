"""Prefill's tiled products (``meshnode.engine.cpu.tiles``): shared between threads they
are bit-identical to the serial tiles, equal "dequantize, then multiply" up to summation
order, and fall back to the serial tiles where threads cannot share them."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from meshnode_packaging.sources import dequantize

from meshnode.engine.cpu import MAX_KERNEL_ROWS, BlockMatrix, matrix, tiles
from meshnode.engine.cpu.pool import KernelPool
from meshnode.engine.cpu.tiles import SGEMM_MIN_ROWS, TILE_MIN_ROWS, TILES_PER_MATRIX, TileThreads
from tests.engine.test_cpu_kernels import N_IN, random_tensor
from tests.engine.test_kernel_pool import idle_gauge


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(13)


@pytest.fixture(scope="module")
def team() -> TileThreads:
    return TileThreads()


def product(
    m: BlockMatrix, x: np.ndarray, threads: int, team: TileThreads, *, tiled: bool = False
) -> np.ndarray:
    """``x @ m`` with ``threads`` kernel threads on an idle machine of four cores; with
    ``tiled``, through the tiles whatever this machine's BLAS (:func:`.tiles.rows_independent`),
    to test their sharing."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matrix, "_threads", threads)
        mp.setattr(matrix, "_pool", lambda: KernelPool(idle_gauge(4)))
        mp.setattr(matrix, "_tile_threads", lambda: team)
        if tiled:
            mp.setattr(tiles, "rows_independent", lambda: True)
        out: np.ndarray = x @ m
    return out


@pytest.mark.parametrize("kinds", [("Q4_1", "Q8_0", "Q4_1"), ("Q4_K", "Q6_K", "Q5_0")])
@pytest.mark.parametrize("threads", [2, 3])
def test_shared_tiles_are_bit_identical_to_serial_and_to_dequantize(
    kinds: tuple[str, str, str], threads: int, team: TileThreads, rng: np.random.Generator
) -> None:
    # 1,100 rows in parts of 600, 250, 250: tiles that cross the parts' ends
    parts = [random_tensor(d, n, rng) for d, n in zip(kinds, (600, 250, 250), strict=True)]
    m = BlockMatrix(parts)
    x = rng.standard_normal((MAX_KERNEL_ROWS + 24, N_IN)).astype(np.float32)
    before = team.posted
    shared = product(m, x, threads, team, tiled=True)
    assert team.posted == before + 1
    serial = product(m, x, 1, team, tiled=True)
    assert team.posted == before + 1
    np.testing.assert_array_equal(shared, serial)
    ref = np.concatenate([dequantize(p) for p in parts]).astype(np.float64)
    want = x.astype(np.float64) @ ref.T
    scale = np.abs(x).astype(np.float64) @ np.abs(ref).T
    assert np.all(np.abs(shared - want) <= 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("n_out", [1, 17, 300, 511, 1100, 3072, 50_000])
def test_tiles_cover_the_rows_in_equal_cache_line_tiles(n_out: int) -> None:
    n_in, cap = 576, 4 << 20
    got = tiles.tiles(n_out, n_in, cap)  # from the shape alone: no thread count to depend on
    assert got[0][0] == 0
    assert got[-1][1] == n_out
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
    sizes = [hi - lo for lo, hi in got]
    assert all(s == sizes[0] and s % 16 == 0 for s in sizes[:-1])
    assert 0 < sizes[-1] <= sizes[0]
    assert all(4 * s * n_in <= cap for s in sizes)
    assert min(sizes[:-1] or sizes) >= min(n_out, TILE_MIN_ROWS)  # each sgemm large
    if 4 * n_out * n_in <= cap * TILES_PER_MATRIX:  # not cut smaller by the cap
        assert len(got) <= TILES_PER_MATRIX


@pytest.mark.parametrize("n_in", [8192, 14_336, 28_672])
def test_a_long_row_s_tiles_are_never_shorter_than_sgemm_s_padding(n_in: int) -> None:
    # the down projections of 1B, 8B and 70B shapes: a 4 MiB tile of 14,336-value rows
    # would be 64 rows, which product_tile pads to SGEMM_MIN_ROWS with zeros (half its
    # multiply wasted); the floor costs no scratch that the padding did not already take
    cap, n_out = 4 << 20, 4096
    got = tiles.tiles(n_out, n_in, cap)
    sizes = [hi - lo for lo, hi in got]
    assert got[0][0] == 0
    assert got[-1][1] == n_out
    assert all(s >= SGEMM_MIN_ROWS for s in sizes[:-1])
    scratch = [4 * max(s, SGEMM_MIN_ROWS) * n_in for s in sizes]  # what product_tile takes
    assert max(scratch) <= max(cap, 4 * SGEMM_MIN_ROWS * n_in)
    if 4 * SGEMM_MIN_ROWS * n_in <= cap:  # the cap binds as before where it can
        assert all(4 * s * n_in <= cap for s in sizes)


def test_an_error_in_any_thread_reaches_the_caller(team: TileThreads) -> None:
    if not tiles.single_threaded_blas():
        pytest.skip("no BLAS threadpoolctl can set to one thread: tiles stay serial")
    ran: list[str] = []

    def item(i: int) -> None:
        ran.append(threading.current_thread().name)
        if i == 5:
            raise ZeroDivisionError("item 5")

    with pytest.raises(ZeroDivisionError, match="item 5"):
        team.run(item, 8, 2)
    assert len(ran) == 8  # the other items still ran: the output is whole or an error
    assert team.run(lambda i: None, 4, 2)  # and the threads still serve


def test_without_a_blas_set_to_one_thread_the_tiles_stay_serial(
    team: TileThreads, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = BlockMatrix([random_tensor("Q8_0", 520, rng)])
    x = rng.standard_normal((MAX_KERNEL_ROWS + 1, N_IN)).astype(np.float32)
    want = product(m, x, 1, team, tiled=True)
    monkeypatch.setattr(tiles, "single_threaded_blas", lambda: False)
    before = team.posted
    np.testing.assert_array_equal(product(m, x, 2, team, tiled=True), want)
    assert team.posted == before


@pytest.mark.parametrize("n_out", [32, 100, 300, 1100])
def test_a_long_segment_s_rows_are_the_same_bits_in_any_batch(
    n_out: int, team: TileThreads, rng: np.random.Generator
) -> None:
    # a segment of 17 rows (BLAS's) alone, then beside a decode row, a verify window, a
    # short prompt and a long one, on 1 to 3 threads: the short tiles and the small
    # batches that took OpenBLAS's small-matrix kernel (issue 35) included
    m = BlockMatrix([random_tensor("Q4_K", n_out, rng)])
    seg = rng.standard_normal((MAX_KERNEL_ROWS + 1, N_IN)).astype(np.float32)
    want = product(m, seg, 1, team)
    for others, threads in [(0, 2), (1, 3), (5, 1), (40, 2), (300, 3)]:
        x = np.concatenate([seg, rng.standard_normal((others, N_IN)).astype(np.float32)])
        np.testing.assert_array_equal(product(m, x, threads, team)[: len(seg)], want)
    # by segment: the long one through BLAS, the short ones through the kernel
    short = rng.standard_normal((3, N_IN)).astype(np.float32)
    x = np.concatenate([short[:1], seg, short[1:]])
    got = m.product_by_segment(x, [1, len(seg), 2])
    np.testing.assert_array_equal(got[1 : 1 + len(seg)], want)
    np.testing.assert_array_equal(got[[0, -2, -1]], short @ m)  # several kernel rows


def test_where_blas_rows_depend_on_their_batch_the_gemm_takes_long_products(
    team: TileThreads, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an sgemm whose rows round with their batch (OpenBLAS's Haswell kernels) is never
    # called: a long product's rows are the compiled GEMM's (test_cpu_gemm.py), each the
    # same bits in any long segment; short segments still take the kernel
    monkeypatch.setattr(tiles, "rows_independent", lambda: False)

    def no_sgemm(*args: object) -> None:
        raise AssertionError("sgemm called where its rows depend on their batch")

    monkeypatch.setattr(tiles, "product_tile", no_sgemm)
    m = BlockMatrix([random_tensor("Q4_K", 500, rng), random_tensor("Q8_0", 40, rng)])
    x = rng.standard_normal((3 * MAX_KERNEL_ROWS + 5, N_IN)).astype(np.float32)
    before = team.posted
    got = product(m, x, 2, team)
    assert team.posted == before + 1  # 540 rows: tiles shared
    for lo in (0, 17, 36):
        seg = x[lo : lo + MAX_KERNEL_ROWS + 1]
        np.testing.assert_array_equal(product(m, seg, 1, team), got[lo : lo + len(seg)])
    by_segment = m.product_by_segment(x, [1, 40, x.shape[0] - 41])
    np.testing.assert_array_equal(by_segment[1:41], got[1:41])
    np.testing.assert_array_equal(by_segment[0], product(m, x[:1], 1, team)[0])
    np.testing.assert_array_equal(by_segment[41:], product(m, x[41:], 1, team))
