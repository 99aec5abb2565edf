"""The kernel threads (``meshnode.engine.cpu.pool``): shared products are bit-identical to
the serial kernels, the caller takes over a chunk a descheduled helper holds, and a busy
machine gets serial products."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshnode.engine.cpu import BlockMatrix, matrix, pool
from meshnode.engine.cpu.pool import CoreGauge, KernelPool
from tests.engine.test_cpu_kernels import N_IN, random_tensor


def loadavg(tmp_path: Path, running: int) -> Path:
    """A ``/proc/loadavg`` that says ``running`` threads run now."""
    path = tmp_path / f"loadavg-{running}"
    path.write_text(f"0.50 0.40 0.30 {running}/300 4242\n")
    return path


@pytest.fixture(scope="module")
def idle_pool(tmp_path_factory: pytest.TempPathFactory) -> KernelPool:
    """A pool on four free cores (one of them the caller's), whatever this machine runs."""
    return KernelPool(CoreGauge(loadavg(tmp_path_factory.mktemp("idle"), 1), cores=4))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(11)


def fused(rng: np.random.Generator, kinds: tuple[str, str, str]) -> BlockMatrix:
    """Three parts of different formats and lengths (none a multiple of a chunk)."""
    return BlockMatrix(
        [random_tensor(d, n, rng) for d, n in zip(kinds, (200, 70, 131), strict=True)]
    )


@pytest.mark.parametrize("kinds", [("Q4_1", "Q8_0", "Q4_1"), ("Q4_K", "Q6_K", "Q5_0")])
@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_shared_products_are_bit_identical_to_serial(
    kinds: tuple[str, str, str],
    k: int,
    idle_pool: KernelPool,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = fused(rng, kinds)
    x = rng.standard_normal((k, N_IN)).astype(np.float32)
    monkeypatch.setattr(matrix, "_threads", 1)
    serial = x @ m
    monkeypatch.setattr(matrix, "_pool", lambda: idle_pool)
    for threads in (2, 4):
        monkeypatch.setattr(matrix, "_threads", threads)
        before = idle_pool.posted
        np.testing.assert_array_equal(x @ m, serial)
        assert idle_pool.posted == before + 1  # the pool did take it


def test_the_caller_redoes_a_chunk_a_descheduled_helper_holds(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A helper that claimed a chunk and stopped (descheduled) does not hold the product
    up: the caller computes that chunk too; no job is posted until the helper is back."""
    m = fused(rng, ("Q4_1", "Q8_0", "Q4_1"))
    x = rng.standard_normal(N_IN).astype(np.float32)
    serial = (x[None] @ m)[0]
    fn = matrix.kernels().chunk_kernel(*m._fmts)
    p = KernelPool(CoreGauge(loadavg(tmp_path, 1), cores=4))
    p._start(1, 4 * N_IN)  # the caller's scratch; no helper thread yet
    st = p._st
    st[pool.HELPERS] = 1  # a helper 1 that ...
    out = np.full((1, m.n_out), np.nan, np.float32)
    chunks = 7 + 3 + 5  # 200, 70 and 131 rows in chunks of 32
    a, b, c = m._raws
    pool._post(st, fn, 1, a, b, c, x, out, p._scratch, 7, 3, chunks, pool.CHUNK_ROWS)
    word = int(st[pool.CLAIM])  # ... claims chunk 0 (rows 0-31) as helpers do ...
    st[pool.BUSY + 1] = 1 + ((word >> 40) << 20 | 0)
    st[pool.CLAIM] = word + 1  # ... and is descheduled before computing it
    pool._work(st, chunks, 1000)
    np.testing.assert_array_equal(out[0], serial)
    assert pool._stale(st)
    assert not p.run(fn, m._raws, x, np.empty((1, m.n_out), np.float32), 2)
    assert p.posted == 0
    st[pool.BUSY + 1] = 0  # the helper is back and done
    assert not pool._stale(st)
    again = np.empty((1, m.n_out), np.float32)
    assert p.run(fn, m._raws, x, again, 2)  # a real helper 1 now
    assert p.posted == 1
    np.testing.assert_array_equal(again[0], serial)


def test_a_busy_machine_gets_serial_products(tmp_path: Path, rng: np.random.Generator) -> None:
    m = fused(rng, ("Q8_0", "Q8_0", "Q8_0"))
    x = rng.standard_normal((1, N_IN)).astype(np.float32).reshape(-1)
    fn = matrix.kernels().chunk_kernel(*m._fmts)
    out = np.empty((1, m.n_out), np.float32)
    busy = KernelPool(CoreGauge(loadavg(tmp_path, 3), cores=2))  # 2 others on 2 cores
    assert not busy.run(fn, m._raws, x, out, 2)
    assert busy.posted == 0
    three = KernelPool(CoreGauge(loadavg(tmp_path, 3), cores=4))  # 2 cores left: 2 threads
    assert three.run(fn, m._raws, x, out, 4)
    assert three._st[pool.ACTIVE] == 2


def test_the_gauge_averages_and_counts_every_core_without_proc(tmp_path: Path) -> None:
    gauge = CoreGauge(loadavg(tmp_path, 5), cores=8)
    assert gauge.free(lambda: 1) == 4.0  # 5 running, one of them ours
    assert CoreGauge(tmp_path / "missing", cores=8).free(lambda: 1) == 8.0


def test_the_kernel_cache_is_keyed_by_the_kernel_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    where = matrix.numba_cache_dir()
    assert where.parent == tmp_path / "meshnode" / "numba"
    assert len(where.name) == 16
    assert where.name == matrix._sources_digest()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert matrix.numba_cache_dir() == tmp_path / "mine"
