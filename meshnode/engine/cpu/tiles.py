"""Prefill's products: weight rows decoded a tile at a time into float32, each tile
multiplied by BLAS, the tiles shared by threads.

A product of more than :data:`.matrix.MAX_KERNEL_ROWS` activation rows is sgemm's work:
the matrix's output rows are cut into tiles (ranges of rows, across its parts), and a
thread decodes a tile into its own float32 scratch buffer and multiplies it into its
columns of the output with a single-threaded sgemm. With several threads every thread
decodes and multiplies tiles of its own (:class:`TileThreads`), so no core waits while
another decodes and no sgemm call synchronises threads; alone, the calling thread does
the tiles one after another with BLAS's own threads.

The threads are the caller and Python helper threads: the decoder runs compiled without
the GIL and NumPy's matmul releases it. A thread's BLAS calls are made single-threaded
with OpenBLAS's per-thread count (``openblas_set_num_threads_local``, OpenBLAS 0.3.27 and
later, the library NumPy's wheels bundle); with another BLAS the tiles stay in the
calling thread.

Each output element is one sgemm dot product over the same inputs whichever tile holds
its row and whichever thread computes it (sgemm splits only rows and columns between its
threads, never the sum): results are bit-identical to the serial tiles, and equal
"dequantize, then multiply in float32" up to summation order.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshnode.engine.cpu.kernels import _decode_any
from meshnode.engine.cpu.simd import entry

__all__ = [
    "TILES_PER_THREAD",
    "TILE_MIN_ROWS",
    "TileThreads",
    "decoder",
    "local_blas_threads",
    "product_tile",
    "tiles",
]

# Output rows of a tile shared between threads, at least: sgemm over 400 activation rows
# reaches ~90 % of its whole-matrix speed at 256 columns (64: 77 %, 1024: 97 %; one
# thread, K = 576..2048, this machine's AVX-512 OpenBLAS).
TILE_MIN_ROWS = 256
# Tiles per thread, at most, when a matrix has rows for more: two let a thread that
# started late catch up, and keep each sgemm large.
TILES_PER_THREAD = 2

_scratch = threading.local()  # a float32 tile, one per computing thread


def tiles(n_out: int, n_in: int, threads: int, max_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` output-row ranges covering ``n_out``: as many as the threads (a
    multiple of them, up to :data:`TILES_PER_THREAD` each) for tiles of at least
    :data:`TILE_MIN_ROWS` rows, more where a tile's float32 would pass ``max_bytes``
    (unless it is 16 rows); of equal length, multiples of 16 rows but the last (whole
    cache lines of output)."""
    cap = max(16, max_bytes // (4 * n_in))
    count = threads * min(TILES_PER_THREAD, max(1, n_out // (threads * TILE_MIN_ROWS)))
    while (size := min(n_out, -(-n_out // (16 * count)) * 16)) > cap:
        count += threads
    return [(lo, min(n_out, lo + size)) for lo in range(0, n_out, size)]


@functools.cache
def decoder(fmt: int) -> Any:
    """``decode(raw, lo, out)``: ``out[i]`` = row ``lo + i`` of ``raw`` (format ``fmt``)
    decoded, as :func:`.kernels.decode_kernel` does it, without holding the GIL."""

    @entry(nogil=True)
    def decode(raw, lo, out):  # type: ignore[no-untyped-def]
        for i in range(out.shape[0]):
            _decode_any(fmt, raw[lo + i], out[i], np.int64(0), out.shape[1])

    return decode


def product_tile(
    parts: Sequence[tuple[int, np.ndarray]], x: np.ndarray, out: np.ndarray, lo: int, hi: int
) -> None:
    """``out[:, lo:hi] = x @ rows lo .. hi - 1`` of the stacked ``parts`` (format id,
    ``[rows, row bytes]``), decoded into this thread's scratch tile."""
    n_in = x.shape[1]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < (hi - lo) * n_in:
        buf = _scratch.buf = np.empty((hi - lo) * n_in, np.float32)
    tile = buf[: (hi - lo) * n_in].reshape(hi - lo, n_in)  # [t, in]
    start = 0
    for fmt, raw in parts:
        a, b = max(lo, start), min(hi, start + raw.shape[0])
        if a < b:
            decoder(fmt)(raw, a - start, tile[a - lo : b - lo])
        start += raw.shape[0]
    np.matmul(x, tile.T, out=out[:, lo:hi])  # [r, t]


@functools.cache
def local_blas_threads() -> Callable[[int], int] | None:
    """OpenBLAS's ``openblas_set_num_threads_local`` (set the calling thread's BLAS
    threads, return the previous count), or None with another BLAS or an older one."""
    from threadpoolctl import ThreadpoolController

    for lib in ThreadpoolController().select(internal_api="openblas").lib_controllers:
        fn = getattr(lib.dynlib, "openblas_set_num_threads_local", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn  # type: ignore[no-any-return]
    return None


class _Job:
    """``fn(i)`` for ``i`` in ``range(count)``, claimed one at a time by the threads."""

    def __init__(self, fn: Callable[[int], None], count: int, helpers: int) -> None:
        self.fn, self.count, self.helpers = fn, count, helpers
        self._next = itertools.count()  # next() is atomic under the GIL
        self._left = count
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        """Claim and run items until none is left."""
        while (i := next(self._next)) < self.count:
            try:
                self.fn(i)
            except BaseException as exc:  # re-raised by the caller
                self.error = self.error or exc
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self.done.set()


class TileThreads:
    """The calling thread plus helper threads, started as needed, that run the tiles of
    one product at a time, each with single-threaded BLAS."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._gen = 0
        self._helpers = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.posted = 0  # products shared so far

    def run(self, fn: Callable[[int], None], count: int, threads: int) -> bool:
        """Run ``fn(i)`` for ``i`` in ``range(count)`` on up to ``threads`` threads, the
        caller among them; re-raises the first exception of any of them.

        Returns False, having done nothing, when fewer than two threads would run, when
        this BLAS has no per-thread count, after a fork (helpers do not survive it), or
        when another thread is using these threads: the caller then runs the items.
        """
        local = local_blas_threads()
        threads = min(threads, count)
        if threads < 2 or local is None or os.getpid() != self._pid:
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._start(threads - 1)
            job = _Job(fn, count, threads - 1)
            with self._cond:
                self._gen += 1
                self._job = job
                self._cond.notify_all()
            before = local(1)
            try:
                job.work()
            finally:
                local(before)
            job.done.wait()
            with self._cond:
                self._job = None  # its arrays are not kept alive by a sleeping helper
            self.posted += 1
        finally:
            self._lock.release()
        if job.error is not None:
            raise job.error
        return True

    def _start(self, helpers: int) -> None:
        while self._helpers < helpers:
            args = (self._helpers,)
            name = f"meshnode-tiles-{self._helpers + 1}"
            threading.Thread(target=self._helper, args=args, name=name, daemon=True).start()
            self._helpers += 1

    def _helper(self, who: int) -> None:
        local = local_blas_threads()
        assert local is not None
        local(1)
        seen = 0
        while True:
            with self._cond:
                while self._gen == seen:
                    self._cond.wait()
                seen, job = self._gen, self._job
            if job is not None and who < job.helpers:
                job.work()
            job = None
