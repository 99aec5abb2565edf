"""The kernel threads (``meshnode.engine.cpu.pool``): shared products are bit-identical to
the serial kernels, the caller takes over a chunk a descheduled helper holds, and a busy
machine gets serial products."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from numba import cfunc, types
from numba.np.numpy_support import carray

from meshnode.engine.cpu import BlockMatrix, matrix, pool
from meshnode.engine.cpu.atomics import fetch_add, ptr_i64
from meshnode.engine.cpu.gauge import QUOTA_SECONDS
from meshnode.engine.cpu.pool import CoreGauge, KernelPool
from tests.engine.test_cpu_kernels import N_IN, random_tensor

TICK = 1.0 / os.sysconf("SC_CLK_TCK")
# how long a helper descheduled mid-chunk may take to finish it on a busy machine
SETTLE_S = 30.0


def proc_stat(path: Path, idle_seconds: list[float], niced: float = 0.0) -> Path:
    """A ``/proc/stat`` whose CPU ``i`` has been idle ``idle_seconds[i]`` and has run
    niced processes ``niced`` s (plus a CPU 9 this process may not use, always idle)."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    nice = round(niced / TICK)
    for i, idle in enumerate([*idle_seconds, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e6]):
        lines.append(f"cpu{i} 100 {nice} 50 {round(idle / TICK)} 0 0 0 0 0 0")
    path.write_text("\n".join([*lines, "intr 1 2 3", ""]))
    return path


def idle_gauge(cores: int) -> CoreGauge:
    """A gauge on a machine without ``/proc``: every core free."""
    return CoreGauge(Path("/nonexistent/stat"), cpus=set(range(cores)))


@pytest.fixture(scope="module")
def idle_pool() -> KernelPool:
    """A pool on four free cores (one of them the caller's), whatever this machine runs."""
    return KernelPool(idle_gauge(4))


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
        assert idle_pool.settle(SETTLE_S)  # a helper late from the last product: it declines
        before = idle_pool.posted
        np.testing.assert_array_equal(x @ m, serial)
        assert idle_pool.posted == before + 1  # the pool did take it


def test_the_caller_redoes_a_chunk_a_descheduled_helper_holds(rng: np.random.Generator) -> None:
    """A helper that claimed a chunk and stopped (descheduled) does not hold the product
    up: the caller computes that chunk too. The next job still goes to the pool (in the
    other area of fields, whose done count the late chunk does not touch); the one after
    it, which would take the late chunk's area, is declined until the helper is back."""
    m = fused(rng, ("Q4_1", "Q8_0", "Q4_1"))
    x = rng.standard_normal(N_IN).astype(np.float32)
    serial = (x[None] @ m)[0]
    fn = matrix.kernels().chunk_kernel(*m._fmts)
    p = KernelPool(idle_gauge(4))
    p._start(1, 4 * N_IN)  # the caller's scratch; no helper thread yet
    st = p._st
    st[pool.HELPERS], st[pool.ACTIVE], st[pool.SLEEPING + 1] = 1, 2, 1  # a helper 1 that ...
    out = np.full((1, m.n_out), np.nan, np.float32)
    a, b, c = m._raws
    assert pool._post(st, fn, 1, a, b, c, x, out, p._scratch, 32, 1000) == 1 << 1  # wakes
    word = int(st[pool.CLAIM])
    assert word >> 20 & 0xFFFFF == 7 + 3 + 5  # 200, 70 and 131 rows in chunks of 32
    mine = int(st[pool.RANGES + 8])  # ... claims the first chunk of its range, 7 (the
    assert (mine & 0xFFFFF, mine >> 20 & 0xFFFFF) == (7, 15)  # second part's rows 0-31)
    st[pool.BUSY + 1] = 1 + ((mine >> 40) << 20 | 7)  # as helpers do ...
    st[pool.RANGES + 8] = mine + 1  # ... and is descheduled before computing it
    pool._work(st, 1000)
    np.testing.assert_array_equal(out[0], serial)
    assert pool._stale(st)
    # the next job is posted (the helper is not asleep: the caller computes it alone) and
    # waits for its own chunks only, not for the late one
    second = np.full((1, m.n_out), np.nan, np.float32)
    assert pool._post(st, fn, 2, a, b, c, x, second, p._scratch, 32, 1000) == 0
    np.testing.assert_array_equal(second[0], serial)
    # the job after it would take the late chunk's fields: declined
    third = np.full((1, m.n_out), np.nan, np.float32)
    assert pool._post(st, fn, 3, a, b, c, x, third, p._scratch, 32, 1000) == -1
    assert np.isnan(third).all()
    st[pool.BUSY + 1] = 0  # the helper is back and done
    assert not pool._stale(st)
    assert pool._post(st, fn, 3, a, b, c, x, third, p._scratch, 32, 1000) == 0
    np.testing.assert_array_equal(third[0], serial)
    again = np.empty((1, m.n_out), np.float32)
    assert p.run(fn, m._raws, x, again, 2)  # a real helper 1 now
    assert p.posted == 1
    np.testing.assert_array_equal(again[0], serial)


@cfunc(types.void(types.int64, types.int64, types.int64))
def _record(st_addr, who, ch):  # type: ignore[no-untyped-def]
    # a chunk function that writes the order the chunks ran in: each chunk into the next
    # word of the posted x (its word 0 counts them)
    st = carray(ptr_i64(st_addr), (pool.WORDS,))
    log = carray(ptr_i64(st[pool.X]), (64,))
    log[1 + fetch_add(log, 0, 1)] = ch


def test_each_thread_claims_its_own_range_in_order_then_the_end_of_another() -> None:
    """The chunks are dealt out in contiguous ranges (each thread streams its weights in
    order): the caller runs its range's chunks first to last, then takes a helper's that
    has not come from the last chunk back."""
    p = KernelPool(idle_gauge(4))
    p._start(1, 16)
    st = p._st
    st[pool.HELPERS], st[pool.ACTIVE] = 1, 2  # a helper 1, awake but not running
    parts = (np.zeros((15 * 32, 1), np.uint8), np.zeros((0, 1), np.uint8))
    log, out = np.zeros(64, np.int64), np.zeros((1, 1), np.float32)
    assert pool._post(st, _record.address, 1, *parts, parts[1], log, out, p._scratch, 32, 9) == 0
    assert list(log[1 : 1 + log[0]]) == [*range(7), *range(14, 6, -1)]
    counts = p.counts()
    assert (counts["chunks"], counts["caller"], counts["helpers"]) == (15, 15, 0)


def test_a_late_helper_does_not_stop_the_next_product(rng: np.random.Generator) -> None:
    """Through ``run``: while a helper still holds a chunk of the last job, the next
    product is shared (posted, the serial kernel's bits); the one after it is left to the
    caller (declined, nothing written) until the helper is back."""
    m = fused(rng, ("Q4_K", "Q6_K", "Q5_0"))
    x = rng.standard_normal(N_IN).astype(np.float32)
    serial = (x[None] @ m)[0]
    fn = matrix.kernels().chunk_kernel(*m._fmts)
    p = KernelPool(idle_gauge(2))
    p._events.append(threading.Event())  # a helper 1 no thread runs: descheduled
    p._st[pool.HELPERS] = 1
    out = np.full((1, m.n_out), np.nan, np.float32)
    assert p.run(fn, m._raws, x, out, 2)  # the caller computes every chunk
    np.testing.assert_array_equal(out[0], serial)
    p._st[pool.BUSY + 1] = 1 + (p._gen << 20 | 0)  # helper 1 holds chunk 0 of that job
    out = np.full((1, m.n_out), np.nan, np.float32)
    assert p.run(fn, m._raws, x, out, 2)
    np.testing.assert_array_equal(out[0], serial)
    assert p.posted == 2
    out = np.full((1, m.n_out), np.nan, np.float32)
    assert not p.run(fn, m._raws, x, out, 2)
    assert p.declined == 1
    assert np.isnan(out).all()
    p._st[pool.BUSY + 1] = 0  # the helper is back and done
    assert p.run(fn, m._raws, x, out, 2)
    np.testing.assert_array_equal(out[0], serial)
    assert p.posted == 3


def test_a_product_wakes_a_helper_that_slept(rng: np.random.Generator) -> None:
    """A helper spins for the next product (``set_waits``' spin), then sleeps; the next
    product wakes it (counted in ``woken``), and gets the serial kernel's bits."""
    m = fused(rng, ("Q4_K", "Q6_K", "Q5_0"))
    x = rng.standard_normal(N_IN).astype(np.float32)
    serial = (x[None] @ m)[0]
    fn = matrix.kernels().chunk_kernel(*m._fmts)
    p = KernelPool(idle_gauge(2))
    p.set_waits(spin_us=0.0)  # the least spin: it sleeps soon after each product
    assert p.run(fn, m._raws, x, np.empty((1, m.n_out), np.float32), 2)
    deadline = time.monotonic() + SETTLE_S
    while p._st[pool.SLEEPING + 1] != 1:  # the helper has gone to sleep
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert p.settle(SETTLE_S)
    out = np.full((1, m.n_out), np.nan, np.float32)
    woken = p.woken
    assert p.run(fn, m._raws, x, out, 2)
    assert p.woken == woken + 1
    np.testing.assert_array_equal(out[0], serial)


def test_the_patience_is_a_few_of_the_jobs_chunk_times() -> None:
    """The caller waits PATIENCE_CHUNKS of the job's chunk times (learned from its own
    chunks, per chunk function and row count) for a chunk a helper holds, within the
    bounds; PATIENCE_MICROSECONDS before anything is learned; a fixed one when set."""
    p = KernelPool(idle_gauge(2))
    p._per_us = 2.0  # idle-loop iterations a microsecond
    key, units = (12345, 8), 1000
    assert p._patience(key, units) == 2 * pool.PATIENCE_MICROSECONDS  # nothing learned
    p._st[pool.RAN] = 4
    p._learn(key, units, 4 * 100e-6)  # the caller ran 4 chunks of 100 µs
    assert p._patience(key, units) == pytest.approx(2 * 100 * pool.PATIENCE_CHUNKS, abs=1)
    assert p._patience(key, 100 * units) == 2 * pool.PATIENCE_MAX_MICROSECONDS
    assert p._patience(key, units // 100) == 2 * pool.PATIENCE_MICROSECONDS
    assert p._patience((12345, 1), units) == 2 * pool.PATIENCE_MICROSECONDS  # another key
    p._learn(key, units, 4 * 300e-6)  # slower now: a running average moves towards it
    chunk_us = 100 + pool.PATIENCE_WEIGHT * (300 - 100)
    assert p._patience(key, units) == pytest.approx(2 * chunk_us * pool.PATIENCE_CHUNKS, abs=1)
    p._st[pool.RAN] = 0  # the helpers ran every chunk: nothing to learn from
    p._learn(key, units, 1.0)
    assert p._patience(key, units) == pytest.approx(2 * chunk_us * pool.PATIENCE_CHUNKS, abs=1)
    p.set_waits(patience_us=70.0)
    assert p._patience(key, units) == 140


class Clocks:
    """The wall clock and this process's CPU time, moved by hand."""

    def __init__(self) -> None:
        self.now = self.cpu = 0.0

    def gauge(self, stat: Path, cpus: set[int]) -> CoreGauge:
        return CoreGauge(stat, cpus, clock=lambda: self.now, cpu_time=lambda: self.cpu)


def test_the_gauge_counts_idle_time_and_our_own(tmp_path: Path) -> None:
    clocks = Clocks()
    stat = tmp_path / "stat"
    gauge = clocks.gauge(proc_stat(stat, [10.0, 10.0, 10.0]), {0, 1})  # CPU 2 is not ours
    assert gauge.free() == 2.0  # no interval yet: every core
    clocks.now, clocks.cpu = 1.0, 0.5  # we ran 0.5 s, CPU 0 idled 0.5 s, CPU 1 not at all
    proc_stat(stat, [10.5, 10.0, 99.0])
    assert gauge.free() == pytest.approx(1.5)  # 2 + half of (1.0 - 2)
    clocks.now += 0.01  # within the sampling interval: the same figure, no read
    stat.write_text("garbage")
    assert gauge.free() == pytest.approx(1.5)
    assert CoreGauge(tmp_path / "missing", {0, 1, 2}).free() == 3.0


def test_the_chunks_scratch_rows_begin_on_a_cache_line() -> None:
    """NumPy's large arrays begin 16 bytes into a 64-byte line: a chunk's 32-byte loads
    from its thread's scratch row straddled two lines every other load. Every row begins
    on a line, as the scratch grows too, and the rows are whole lines apart."""
    p = KernelPool(idle_gauge(4))
    for threads, n_in in ((2, 576), (2, 8192), (3, 8192), (3, 100), (4, 2048)):
        p._start(threads, 7 * n_in)
        rows, width = p._scratch.shape
        assert rows >= threads
        assert width >= 7 * n_in
        assert width % 16 == 0
        assert p._scratch.flags.c_contiguous
        assert all(p._scratch[r].ctypes.data % 64 == 0 for r in range(rows))
        assert not p._scratch.any()


def test_a_gauge_reads_the_quota_once_every_quota_seconds(tmp_path: Path) -> None:
    """Without ``/proc/stat`` (benchmarks' ``--every-core-free``) the gauge read the
    cgroup files at every product, ~0.3 ms of the caller's CPU each, while the helpers
    waited; then at every sample (every SAMPLE_SECONDS: ~0.2 % of a two-thread decode).
    It reads them once every QUOTA_SECONDS, with ``/proc/stat`` or without."""
    clocks, reads = Clocks(), [0]

    def quota() -> float | None:
        reads[0] += 1
        return None

    for stat in (tmp_path / "missing", proc_stat(tmp_path / "stat", [10.0, 10.0])):
        reads[0] = 0
        gauge = CoreGauge(stat, {0, 1}, lambda: clocks.now, quota=quota)
        assert reads[0] == 1  # the constructor's look
        reads[0] = 0
        for _ in range(5):  # within a sample
            assert 0.0 <= gauge.free() <= 2.0
            clocks.now += pool.SAMPLE_SECONDS / 10
        steps = int(QUOTA_SECONDS / pool.SAMPLE_SECONDS)
        for _ in range(steps - 2):  # samples within QUOTA_SECONDS of the first
            clocks.now += pool.SAMPLE_SECONDS
            assert 0.0 <= gauge.free() <= 2.0
        assert reads[0] == 0
        clocks.now += 2 * pool.SAMPLE_SECONDS
        assert 0.0 <= gauge.free() <= 2.0
        assert reads[0] == 1


def test_niced_processes_leave_their_cores_to_a_process_that_is_not(tmp_path: Path) -> None:
    if os.getpriority(os.PRIO_PROCESS, 0) > 0:
        pytest.skip("this test process is niced: niced time is then not free")
    clocks = Clocks()
    stat = tmp_path / "stat"
    gauge = clocks.gauge(proc_stat(stat, [10.0, 10.0]), {0, 1})
    gauge.free()
    clocks.now, clocks.cpu = 1.0, 1.0  # we ran 1 s; a nice-19 build ran 1 s on each CPU
    proc_stat(stat, [10.0, 10.0], niced=1.0)
    assert gauge.free() == 2.0  # 2 + half of (min(2, 1 + 2) - 2)


def test_a_busy_machine_gets_serial_products(tmp_path: Path, rng: np.random.Generator) -> None:
    """Both cores busy with others, and this process got a third of one: no helpers."""
    m = fused(rng, ("Q8_0", "Q8_0", "Q8_0"))
    x = rng.standard_normal(N_IN).astype(np.float32)
    fn = matrix.kernels().chunk_kernel(*m._fmts)
    out = np.empty((1, m.n_out), np.float32)
    clocks, stat = Clocks(), tmp_path / "stat"
    busy = KernelPool(clocks.gauge(proc_stat(stat, [0.0, 0.0]), {0, 1}))
    assert busy.run(fn, m._raws, x, out, 2)  # no interval yet: both cores
    for _ in range(3):
        clocks.now, clocks.cpu = clocks.now + 1.0, clocks.cpu + 0.3
        assert not busy.run(fn, m._raws, x, out, 2)  # 2 -> 1.15 -> 0.73 -> 0.51
    assert busy.posted == 1
    assert busy.counts()["crowded"] == 3  # left to the caller by the gauge, counted
    assert busy._gauge.free() < 1.5


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


def test_a_product_gets_a_thread_per_parallel_min_bytes_of_matrix(
    idle_pool: KernelPool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matrix, "_pool", lambda: idle_pool)
    monkeypatch.setattr(matrix, "_threads", 4)
    x = rng.standard_normal((1, N_IN)).astype(np.float32)
    small = BlockMatrix([random_tensor("Q8_0", 150, rng)])  # 150 x 544 bytes: one thread
    assert small.nbytes // matrix.PARALLEL_MIN_BYTES == 1
    before = idle_pool.posted
    _ = x @ small
    assert idle_pool.posted == before
    m = fused(rng, ("Q4_1", "Q8_0", "Q4_1"))  # 133 KiB: two threads of the four
    assert idle_pool.settle(SETTLE_S)
    _ = x @ m
    assert idle_pool.posted == before + 1
    assert idle_pool._st[pool.ACTIVE] == 2


@pytest.mark.parametrize(
    ("n_out", "n_in", "k", "rows"),
    [
        (16384, 2048, 1, 256),  # Llama-3.2-1B gate/up, decode: CHUNK_WORK weights
        (16384, 2048, 8, 84),  # 8 streams: 8 rows weigh as 3 (a row's decode as 4 FMAs)
        (2048, 8192, 8, pool.CHUNK_ROWS),  # its down projection: 20 rows, raised
        (576, 576, 1, 36),  # SmolLM2: about CHUNKS_PER_THREAD chunks a thread
    ],
)
def test_a_chunk_holds_about_chunk_work_weights_times_rows(
    n_out: int, n_in: int, k: int, rows: int
) -> None:
    assert pool.chunk_rows(n_out, n_in, k, 2) == rows
    assert rows % 4 == 0  # whole 4-row tiles
    assert rows == pool.CHUNK_ROWS or rows * n_in * (1 + k // 4) <= pool.CHUNK_WORK
