"""The compiled GEMM of long products (``meshnode.engine.cpu.gemm``): each output is one
FMA chain over ``k`` in order, so a row's bits depend on nothing but its activations and
its weights -- not on the rows beside it, its place, the tiles or the threads."""

from __future__ import annotations

import numpy as np
import pytest
from llvmlite import binding
from meshnode_packaging.sources import dequantize

from meshnode.engine.cpu import MAX_KERNEL_ROWS, BlockMatrix, dense_product, gemm, matrix, tiles
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.pool import KernelPool
from meshnode.engine.cpu.tiles import TileThreads
from tests.engine.test_cpu_kernels import N_IN, random_tensor
from tests.engine.test_kernel_pool import idle_gauge


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(29)


@pytest.fixture(scope="module")
def team() -> TileThreads:
    return TileThreads()


@pytest.fixture(autouse=True)
def dependent_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long products take the GEMM whatever this machine's BLAS, as on an AVX2 CPU."""
    monkeypatch.setattr(tiles, "rows_independent", lambda: False)


def multiply(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for ``w`` ``[N, K]`` by :func:`.gemm.product` alone (one call)."""
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    n_out, n_in = w.shape
    gemm.product(gemm.packed(x), x.shape[0], w.reshape(-1), n_in, 1, n_out, out, 0)
    return out


def product(m: BlockMatrix, x: np.ndarray, threads: int, team: TileThreads) -> np.ndarray:
    """``x @ m`` on ``threads`` threads of an idle four-core machine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matrix, "_threads", threads)
        mp.setattr(matrix, "_pool", lambda: KernelPool(idle_gauge(4)))
        mp.setattr(matrix, "_tile_threads", lambda: team)
        out: np.ndarray = x @ m
    return out


@pytest.mark.skipif(
    not binding.get_host_cpu_features().get("fma"),
    reason="llvm.fmuladd fuses only where the CPU has FMA: the chain below is the fused one",
)
@pytest.mark.parametrize(
    ("rows", "n_out", "n_in"),
    # blocks of six weight rows, then tails of four (10, 11, 37), two (8, 3, 37) and one
    # row; on AVX-512 two panels at a time (17 rows and more; 33, 40: a last odd panel),
    # over at most K_PASS values of k a pass (the last case: three passes, the chains
    # kept between them)
    [
        (17, 7, 40),
        (33, 13, 3),
        (5, 6, 64),
        (20, 11, 24),
        (16, 8, 9),
        (3, 3, 17),
        (18, 10, 5),
        (19, 37, 33),
        (40, 8, 7),
        (34, 13, 2 * gemm.K_PASS + 37),
    ],
)
def test_each_output_is_one_fused_chain_over_k_in_order(
    rows: int, n_out: int, n_in: int, rng: np.random.Generator
) -> None:
    # acc = round32(x * w + acc) for k = 0, 1, ...: the float64 product of two float32 is
    # exact, the float64 sum rounds once before float32 (a double rounding that these
    # fixed inputs never hit: a wrong order or a split sum would differ in most values)
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    want = np.zeros((rows, n_out), np.float32)
    for k in range(n_in):
        term = x[:, k, None].astype(np.float64) * w[None, :, k].astype(np.float64)
        want = (term + want).astype(np.float32)
    np.testing.assert_array_equal(multiply(x, w), want)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 47])
@pytest.mark.parametrize("n_out", [1, 5, 6, 7, 13, 259])
@pytest.mark.parametrize("n_in", [32, 33, 100])
def test_odd_shapes_equal_a_float64_product(
    rows: int, n_out: int, n_in: int, rng: np.random.Generator
) -> None:
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    got = multiply(x, w)  # every value written (NaN before)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    assert np.all(np.abs(got - want) <= 1e-6 * n_in * scale)


@pytest.mark.parametrize(
    ("rows", "n_in"), [(1, 1), (16, 16), (17, 33), (40, 100), (3, 64), (35, 2048)]
)
def test_panels_hold_each_row_k_major_and_zeros_past_the_last(
    rows: int, n_in: int, rng: np.random.Generator
) -> None:
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    padded = np.zeros((gemm.panels(rows) * 16, n_in), np.float32)
    padded[:rows] = x
    want = padded.reshape(-1, 16, n_in).transpose(0, 2, 1).reshape(-1)  # [g, k, lane]
    out = np.full(want.size, np.nan, np.float32)  # every value written
    gemm.pack(x, out)
    np.testing.assert_array_equal(out, want)
    assert gemm.packed(x).ctypes.data % 64 == 0  # panels begin on a cache line


def test_a_matrix_s_columns_are_the_bits_of_its_rows(rng: np.random.Generator) -> None:
    # weight rows read across a [K, N] matrix (dense_product's) or along a decoded tile
    x = rng.standard_normal((20, 96)).astype(np.float32)
    w = rng.standard_normal((96, 50)).astype(np.float32)  # [in, out]
    out = np.empty((20, 50), np.float32)
    gemm.product(gemm.packed(x), 20, w.reshape(-1), 1, 50, 50, out, 0)
    np.testing.assert_array_equal(out, multiply(x, np.ascontiguousarray(w.T)))


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_every_format_s_long_products_equal_dequantize(
    dtype: str, rng: np.random.Generator, team: TileThreads
) -> None:
    t = random_tensor(dtype, 70, rng)
    x = rng.standard_normal((MAX_KERNEL_ROWS + 9, N_IN)).astype(np.float32)
    before = team.posted
    got = product(BlockMatrix([t]), x, 2, team)
    assert team.posted == before  # 70 rows: one tile, nothing to share
    ref = dequantize(t).astype(np.float32)
    np.testing.assert_array_equal(got, multiply(x, ref))  # decoded as dequantize decodes
    want = x.astype(np.float64) @ ref.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(ref).T.astype(np.float64)
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("kinds", [("Q4_K", "Q6_K", "Q5_0"), ("Q8_0", "Q4_1", "F16")])
def test_a_row_is_the_same_bits_in_any_long_segment_on_any_threads(
    kinds: tuple[str, str, str], rng: np.random.Generator, team: TileThreads
) -> None:
    # a row alone in a 17-row segment, then at other places in 300-row ones, through
    # tiles that cross the parts' ends, on one thread and two
    parts = [random_tensor(d, n, rng) for d, n in zip(kinds, (600, 250, 250), strict=True)]
    m = BlockMatrix(parts)
    seg = rng.standard_normal((MAX_KERNEL_ROWS + 1, N_IN)).astype(np.float32)
    want = product(m, seg, 1, team)
    many = rng.standard_normal((300, N_IN)).astype(np.float32)
    for place, threads in [(0, 2), (1, 1), (150, 2), (283, 2)]:
        x = many.copy()
        x[place : place + len(seg)] = seg
        before = team.posted
        got = product(m, x, threads, team)
        # 1,100 rows: the panels packed (300 rows, two parts), then tiles, both shared
        assert team.posted == before + 2 * (threads > 1)
        np.testing.assert_array_equal(got[place : place + len(seg)], want)
    by_segment = m.product_by_segment(np.concatenate([seg[:2], seg]), [2, len(seg)])
    np.testing.assert_array_equal(by_segment[2:], want)


@pytest.mark.parametrize(("n_in", "n_out"), [(64, 48), (576, 1536)])
def test_dense_long_segments_are_the_same_bits_in_any_batch(
    n_in: int, n_out: int, rng: np.random.Generator, team: TileThreads
) -> None:
    w = rng.standard_normal((n_in, n_out), dtype=np.float32)
    seg = rng.standard_normal((MAX_KERNEL_ROWS + 1, n_in), dtype=np.float32)
    many = rng.standard_normal((100, n_in), dtype=np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matrix, "_threads", 2)
        mp.setattr(matrix, "_pool", lambda: KernelPool(idle_gauge(4)))
        mp.setattr(matrix, "_tile_threads", lambda: team)
        want = dense_product(seg, w)
        got = dense_product(np.concatenate([many[:3], seg, many]), w, [3, len(seg), 100])
    np.testing.assert_array_equal(got[3 : 3 + len(seg)], want)
    np.testing.assert_array_equal(want, multiply(seg, np.ascontiguousarray(w.T)))
    scale = np.abs(seg).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert np.all(np.abs(want - seg.astype(np.float64) @ w.astype(np.float64)) <= 1e-5 * scale)
