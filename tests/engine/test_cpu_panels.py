"""The exact k-row products' panels (:mod:`.panels`, AVX-512's sixteen-lane tiles): eight
weight rows (or the last four) decoded a block at a time, every activation row's chains
waiting in the scratch between blocks. Each output is still one FMA chain per lane, in
order, and a tree sum, so a row of a batch is the same bits as that row alone (the one-row
passes, another loop) and as AVX2's tiles give it (:mod:`.narrow`), in every format, serial
or split between the kernel threads; a difference in a single value fails.

The other tests' rows are 512 values, two blocks of 256; these are 2048 (2080 where every
part is a 32-value format: a last block of one 32-value block), and 64 in the tiny models'
shapes (a block shorter than one)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numba import njit

from meshnode.engine.cpu import MAX_KERNEL_ROWS, matrix, panels, pool
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.matrix import BlockMatrix
from meshnode.engine.cpu.pool import KernelPool
from tests.engine.test_cpu_kernels import random_tensor
from tests.engine.test_cpu_tile_forms import _TRIPLES

# every row count a batch takes the tiles' paths by: four rows, two, one, and mixes
_KS = (2, 3, 5, 8, 13, 16)


def _n_in(names: list[str]) -> int:
    return 2080 if all(FORMATS[n].block_size <= 32 for n in names) else 2048


def test_the_scratch_holds_the_chains_of_every_row_count() -> None:
    assert panels.CHAINS == 16 * panels.ROWS * MAX_KERNEL_ROWS
    assert pool.PANEL_CHAINS >= panels.CHAINS + 16  # and room to move to a 64-byte line


def _batch(k: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((k, n_in)).astype(np.float32)
    x[:, ::97] *= 1e6  # lanes of very different sizes: a change of order shows
    return x


@pytest.mark.parametrize("names", _TRIPLES, ids=["-".join(t) for t in _TRIPLES])
def test_panel_rows_are_the_bits_of_rows_alone_and_of_both_tile_forms(names: list[str]) -> None:
    kernels = matrix.kernels()
    rng = np.random.default_rng(38)
    n_in = _n_in(names)
    ids, raws = [], []
    # 70 rows: eight panels of eight, one of four, two rows alone; 9 rows: one panel and a
    # row alone; 6: a panel of four and two rows alone
    for name, rows in zip(names + ["F32"] * (3 - len(names)), (70, 9, 6), strict=True):
        ids.append(FORMATS[name].kernel_id)
        raws.append(random_tensor(name, rows, rng, n_in=n_in).data.reshape(rows, -1))
    sixteen = kernels._serial_product(*ids, 16, kernels.ANY_ROWS)  # one row and k rows
    eight = kernels._serial_product(*ids, 8, kernels.ANY_ROWS)
    n_out = sum(r.shape[0] for r in raws)
    for k in _KS:
        assert panels.fits(n_in, k, panels.scratch(n_in))  # the serial product's scratch
        x = _batch(k, n_in, rng)
        want, got = np.empty((k, n_out), np.float32), np.empty((k, n_out), np.float32)
        sixteen(*raws, x.reshape(-1), want)
        eight(*raws, x.reshape(-1), got)
        differ = np.count_nonzero(want.view(np.uint32) != got.view(np.uint32))
        assert differ == 0, f"{k} rows: {differ} of {want.size} values differ between forms"
        alone = np.empty((1, n_out), np.float32)
        for r in range(k):
            sixteen(*raws, x[r], alone)
            differ = np.count_nonzero(alone[0].view(np.uint32) != want[r].view(np.uint32))
            assert differ == 0, f"row {r} of {k} alone differs in {differ} values"


@pytest.mark.parametrize("dtype", ["Q4_K", "Q6_K", "Q8_0", "MXFP4"])
def test_panel_chunks_on_the_kernel_threads_are_the_bits_of_rows_alone(
    dtype: str, monkeypatch: pytest.MonkeyPatch, idle_threads: KernelPool
) -> None:
    # 70 rows of 2048: the pool's chunks of 32 rows are four panels each, its last of 6 a
    # panel of four and two rows alone
    monkeypatch.setattr(matrix, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(matrix, "_threads", 2)
    monkeypatch.setattr(matrix, "_pool", lambda: idle_threads)
    rng = np.random.default_rng(39)
    m = BlockMatrix([random_tensor(dtype, 70, rng, n_in=2048)])
    before = idle_threads.posted
    x = _batch(8, 2048, rng)
    batch = x @ m
    assert idle_threads.posted - before == 1  # the kernel threads took it
    for r in range(len(x)):
        alone = x[r : r + 1] @ m
        differ = int(np.count_nonzero(alone[0].view(np.uint32) != batch[r].view(np.uint32)))
        assert differ == 0, f"row {r} alone differs from the batch's in {differ} values"


_Q4_K = FORMATS["Q4_K"].kernel_id


@njit
def _panels_q4_k(raw: Any, x: Any, out: Any, w: Any, n_in: int) -> int:
    # the panels alone, on every row they take; returns the first row not done
    first: int = panels.panels(_Q4_K, raw, x, out, 0, raw.shape[0], 0, w, n_in)
    return first


def test_panels_take_whole_panels_and_leave_the_rest() -> None:
    rng = np.random.default_rng(40)
    t = random_tensor("Q4_K", 21, rng, n_in=2048)
    raw = t.data.reshape(21, -1)
    m = BlockMatrix([t])
    x = _batch(5, 2048, rng)
    out = np.full((5, 21), np.nan, np.float32)
    w = np.zeros(panels.scratch(2048), np.float32)
    assert _panels_q4_k(raw, x.reshape(-1), out, w, 2048) == 20  # two panels of eight, one of four
    assert np.isnan(out[:, 20:]).all()  # the last row left to the row-at-a-time loop
    for r in range(len(x)):
        alone = (x[r : r + 1] @ m)[0, :20]
        np.testing.assert_array_equal(out[r, :20].view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize("dtype", ["Q4_0", "Q8_0", "MXFP4"])
def test_rows_shorter_than_a_block_are_the_bits_of_rows_alone(dtype: str) -> None:
    # 96 values: one block of three 32-value blocks, as the tiny models' short rows
    rng = np.random.default_rng(41)
    m = BlockMatrix([random_tensor(dtype, 30, rng, n_in=96)])
    for k in _KS:
        x = _batch(k, 96, rng)
        batch = x @ m
        for r in range(k):
            alone = (x[r : r + 1] @ m)[0]
            np.testing.assert_array_equal(alone.view(np.uint32), batch[r].view(np.uint32))
