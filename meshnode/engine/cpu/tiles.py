"""Prefill's products: weight rows decoded a tile at a time into float32, each tile
multiplied by BLAS (or, where BLAS rounds a row by its batch, by the compiled GEMM), the
tiles shared by threads.

A product of more than :data:`.matrix.MAX_KERNEL_ROWS` activation rows is sgemm's work:
the matrix's output rows are cut into tiles (ranges of rows, across its parts), and a
thread decodes a tile into its own float32 scratch buffer and multiplies it into its
columns of the output with a single-threaded sgemm. With several threads every thread
decodes and multiplies tiles of its own (:class:`TileThreads`), so no core waits while
another decodes and no sgemm call synchronises threads; alone, the calling thread does
the tiles one after another.

The threads are the caller and Python helper threads: the decoder runs compiled without
the GIL and NumPy's matmul releases it.

**Same bits under any load.** An output element's value must not depend on how many
threads ran, on which of them computed it, or on the other rows of the batch. sgemm
itself does not split a sum between threads, but which code it runs depends on the
shapes and on its thread count: OpenBLAS (0.3.31, SkylakeX) multiplies a call whose
``tile rows x activation rows`` is below ~1,200 with its small-matrix kernel, whose sums
round differently from its blocked kernel (measured: 16- and 64-row tiles at 17..64
activation rows differ in the last bits, 96 rows and more never did, 17..300 rows, K 32
.. 2048). So here:

- the tiles of a matrix depend on its shape only (:func:`tiles`), never on the threads
  that share them, which the cores' load decides;
- a tile shorter than :data:`SGEMM_MIN_ROWS` is padded with zero rows to that length,
  so no product of more than :data:`.matrix.MAX_KERNEL_ROWS` activation rows takes the
  small-matrix kernel, however few rows the batch has;
- BLAS runs single-threaded in the whole process, checked before every run of tiles
  (:func:`single_threaded_blas`) and never raised again: OpenBLAS's
  ``openblas_set_num_threads_local`` sets the process's count, not the thread's (a
  caller that restored its count while a helper was still multiplying changed the
  helper's sgemm mid-product, and the bits with it: issue 35).

Then each output element is one sgemm dot product over the same inputs, by the same
code, whichever tile holds its row and whichever thread computes it: results are
bit-identical to the serial tiles under any load, and equal "dequantize, then multiply
in float32" up to summation order.

**Only where sgemm's rows are independent.** That last step holds for OpenBLAS's
SkylakeX kernels, not for its Haswell ones (AVX2 CPUs: AMD Zen 2 and 3, Intel before
Skylake-SP): there a row's sums round differently with the number of rows in the call
and with the row's place among them (OpenBLAS 0.3.31 on a Zen 3, 2026-11-30: rows of
17 .. 300-row products differed from the same rows of a 400-row one for 260 of the 283
counts, and a row moved within a 16 .. 128-row product changed its bits), so a prompt's
bits would depend on its batch and on where a cached prefix cut it. :func:`rows_independent`
asks this process's BLAS once; where it fails, each tile is decoded the same way and
multiplied by the compiled GEMM instead (:func:`gemm_tile`, :mod:`.gemm`): every output
one FMA chain over ``k`` in order, whatever the rows, the tile or the thread, and the
same bits on AVX2 and AVX-512 machines. The tiles, their sharing and the scratch are
the same for both.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshnode.engine.cpu import gemm
from meshnode.engine.cpu.kernels import _decode_any
from meshnode.engine.cpu.simd import entry
from meshnode.engine.cpu.variants import variant

__all__ = [
    "SGEMM_MIN_ROWS",
    "TILES_PER_MATRIX",
    "TILE_MIN_ROWS",
    "TileThreads",
    "decoder",
    "gemm_tile",
    "product_tile",
    "rows_independent",
    "single_threaded_blas",
    "tiles",
]

# Output rows of a tile, at least (but the last): sgemm over 400 activation rows
# reaches ~90 % of its whole-matrix speed at 256 columns (64: 77 %, 1024: 97 %; one
# thread, K = 576..2048, this machine's AVX-512 OpenBLAS).
TILE_MIN_ROWS = 256
# Tiles a matrix is cut into when it has rows for more than one: a fixed count, never
# the threads' (the bits must not depend on them), enough that 1, 2, 4 or 8 threads
# each get whole tiles, and that a thread that started late can catch up.
TILES_PER_MATRIX = 8
# Rows an sgemm call gets at least, padded with zero rows: above OpenBLAS's
# small-matrix kernel for any prefill (tile rows x activation rows > ~1,200 at 17
# rows and more; see the module docstring).
SGEMM_MIN_ROWS = 128

_scratch = threading.local()  # a float32 tile, one per computing thread


def tiles(n_out: int, n_in: int, max_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` output-row ranges covering ``n_out``, from the matrix's shape alone:
    up to :data:`TILES_PER_MATRIX` tiles of at least :data:`TILE_MIN_ROWS` rows, more
    where a tile's float32 would pass ``max_bytes`` (unless it is :data:`SGEMM_MIN_ROWS`
    rows: :func:`product_tile` pads a shorter tile to that many with zero rows, so a
    shorter one would save no scratch and multiply zeros); of equal length, multiples of
    16 rows but the last (whole cache lines of output).

    The floor matters where a row is longer than 8,192 values: the down projections of
    7-8B models (14,336) and of 70B ones (28,672), whose 4 MiB tiles were 64 and 32 rows,
    half and three quarters of each padded sgemm zeros (Llama-3.1-8B's Q6_K down, 512
    rows, one thread, this Xeon: 47 -> 92 GFLOP/s; ``docs/performance.md``)."""
    cap = max(SGEMM_MIN_ROWS, max_bytes // (4 * n_in) // 16 * 16)
    size = max(TILE_MIN_ROWS, -(-n_out // (16 * TILES_PER_MATRIX)) * 16)
    size = min(n_out, size, cap)
    return [(lo, min(n_out, lo + size)) for lo in range(0, n_out, size)]


def _decode_kernel(fmt: int) -> Any:
    @entry()
    @variant(fmt)
    def decode_rows(raw, ids, out):  # type: ignore[no-untyped-def]
        for i in range(ids.shape[0]):
            _decode_any(fmt, raw[ids[i]], out[i], np.int64(0), out.shape[1])

    return decode_rows


@functools.cache
def decode_kernel(fmt: int) -> Any:
    """``decode_rows(raw, ids, out)``: ``out[i]`` = row ``ids[i]`` of ``raw`` (format
    ``fmt``) decoded, in the calling thread; the embedding lookup, and prefill's tiles
    for BLAS (whose own threads then have the cores: a parallel decode between two
    sgemm calls would compete with OpenBLAS's spinning threads, and decoding is about
    2 % of a prefill's work)."""
    return _decode_kernel(fmt)


@functools.cache
def decoder(fmt: int) -> Any:
    """``decode(raw, lo, out)``: ``out[i]`` = row ``lo + i`` of ``raw`` (format ``fmt``)
    decoded, as :func:`decode_kernel` does it, without holding the GIL."""

    @entry(nogil=True)
    @variant(fmt)
    def decode(raw, lo, out):  # type: ignore[no-untyped-def]
        for i in range(out.shape[0]):
            _decode_any(fmt, raw[lo + i], out[i], np.int64(0), out.shape[1])

    return decode


def product_tile(
    parts: Sequence[tuple[int, np.ndarray]], x: np.ndarray, out: np.ndarray, lo: int, hi: int
) -> None:
    """``out[:, lo:hi] = x @ rows lo .. hi - 1`` of the stacked ``parts`` (format id,
    ``[rows, row bytes]``), decoded into this thread's scratch tile (padded with zero
    rows to :data:`SGEMM_MIN_ROWS`)."""
    rows = max(hi - lo, SGEMM_MIN_ROWS)
    tile = _scratch_tile(rows, x.shape[1])  # [t, in]
    _decode_tile(parts, tile, lo, hi)
    if rows == hi - lo:
        np.matmul(x, tile.T, out=out[:, lo:hi])  # [r, t]
        return
    tile[hi - lo :] = 0.0
    out[:, lo:hi] = np.matmul(x, tile.T)[:, : hi - lo]  # [r, t]


def _scratch_tile(rows: int, n_in: int) -> np.ndarray:
    """This thread's float32 scratch tile ``[rows, n_in]``."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < rows * n_in:
        # from a 64-byte line: the decoders store 32-byte vectors, which straddle two
        # lines every other time from NumPy's 16-byte alignment
        raw = np.empty(rows * n_in + 16, np.float32)
        at = (-(raw.ctypes.data // 4)) % 16
        buf = _scratch.buf = raw[at : at + rows * n_in]
    tile: np.ndarray = buf[: rows * n_in].reshape(rows, n_in)
    return tile


def _decode_tile(
    parts: Sequence[tuple[int, np.ndarray]], tile: np.ndarray, lo: int, hi: int
) -> None:
    """``tile[: hi - lo]`` = rows ``lo .. hi - 1`` of the stacked ``parts``, decoded."""
    start = 0
    for fmt, raw in parts:
        a, b = max(lo, start), min(hi, start + raw.shape[0])
        if a < b:
            decoder(fmt)(raw, a - start, tile[a - lo : b - lo])
        start += raw.shape[0]


def gemm_tile(
    parts: Sequence[tuple[int, np.ndarray]],
    panels: np.ndarray,
    rows: int,
    out: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """``out[:, lo:hi] = x @ rows lo .. hi - 1`` of the stacked ``parts``, decoded into
    this thread's scratch tile and multiplied by :func:`.gemm.product` (``panels``: the
    ``rows`` rows of ``x`` packed by :func:`.gemm.pack`): no BLAS, one order per sum."""
    tile = _scratch_tile(hi - lo, panels.size // (16 * gemm.panels(rows)))
    _decode_tile(parts, tile, lo, hi)
    n_in = tile.shape[1]
    gemm.product(panels, rows, tile.reshape(-1), n_in, 1, hi - lo, out, lo)


@functools.cache
def _blas() -> Any:
    """threadpoolctl's controller of the BLAS libraries loaded in this process."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def single_threaded_blas() -> bool:
    """Set every BLAS of the process (threadpoolctl's) to one thread, unless it is, and
    say whether there is one. Called before each shared or serial run of tiles: the
    count is the process's, and ``limit_cpu_threads`` or a caller's threadpoolctl limit
    may have changed it since."""
    libs = _blas().lib_controllers
    for lib in libs:
        if lib.num_threads != 1:
            lib.set_num_threads(1)
    return bool(libs)


@functools.cache
def rows_independent() -> bool:
    """Whether this process's single-threaded sgemm computes a row of ``x @ w.T`` to the
    same bits whatever the other rows of ``x``: their count, and the row's place among
    them (see the module docstring). Probed once: rows of products of 17 .. 300 rows, at
    the tiles' least width and at the shapes of real matrices' tiles, each against the
    same rows placed elsewhere in a product of another length. Evidence, not proof: an
    sgemm that passes had every row independent in every product the probe tried."""
    single_threaded_blas()
    rng = np.random.default_rng(0)
    for n_in, n_out in ((64, SGEMM_MIN_ROWS), (576, 256), (2048, SGEMM_MIN_ROWS)):
        w = rng.standard_normal((n_out, n_in)).astype(np.float32)
        x = rng.standard_normal((300, n_in)).astype(np.float32)
        want = x @ w.T
        for rows, shift in ((17, 0), (40, 5), (100, 37), (171, 129)):
            got = x[shift : shift + rows] @ w.T
            if not np.array_equal(got, want[shift : shift + rows]):
                return False
            moved = np.concatenate([x[:3], x[shift : shift + rows]])  # each row 3 later
            if not np.array_equal((moved @ w.T)[3:], got):
                return False
    return True


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
    one product at a time, BLAS single-threaded."""

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
        no BLAS could be set to one thread, after a fork (helpers do not survive it), or
        when another thread is using these threads: the caller then runs the items.
        """
        threads = min(threads, count)
        if threads < 2 or os.getpid() != self._pid or not single_threaded_blas():
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
            job.work()
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
        seen = 0
        while True:
            with self._cond:
                while self._gen == seen:
                    self._cond.wait()
                seen, job = self._gen, self._job
            if job is not None and who < job.helpers:
                job.work()
            job = None
