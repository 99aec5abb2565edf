"""A weight matrix held in its GGUF blocks, multiplied by the compiled kernels.

``x @ m`` for a :class:`BlockMatrix` ``m`` (logically ``[in, out]``, like the float32
matrices the CPU stage used before) computes the product without ever holding the float32
matrix: up to :data:`MAX_KERNEL_ROWS` activation rows go through one kernel pass over the
blocks (decode, verify windows), shared chunk by chunk with the kernel threads of
:mod:`.pool`, one thread per :data:`PARALLEL_MIN_BYTES` of it; more rows (prefill)
decode the matrix a tile of at most :data:`DENSE_TILE_BYTES` at a time into a per-thread
float32 scratch buffer and hand each tile to BLAS -- or, where this process's sgemm
rounds a row by its batch (:func:`.tiles.rows_independent`), a tile of at most
:data:`GEMM_TILE_BYTES` to the compiled GEMM (:mod:`.gemm`) -- where the decode is a
small part of the work; with several threads each decodes and multiplies tiles of its
own (:mod:`.tiles`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from meshnode_packaging.sources import RawTensor

from meshnode.engine.cpu.formats import Format, format_of, row_bytes

__all__ = [
    "MAX_KERNEL_ROWS",
    "BlockMatrix",
    "by_rows",
    "dense_product",
    "set_kernel_threads",
    "share",
    "shared_threads",
    "supported",
]

# Above this many rows a product decodes the matrix once and hands it to BLAS: sgemm's
# register blocking beats decoding each row once per product when the rows are many, and
# the kernel's per-row dot products are built for the few rows of decode and verify
# (benchmarks/engine.py, "k-row forward cost").
MAX_KERNEL_ROWS = 16

# float32 bytes of weight rows a prefill decodes at once for BLAS: the tile is still in
# the L3 cache when sgemm reads it, each sgemm call is large (512 rows x 16 MiB is ~4
# GFLOP), and a thread's scratch stays bounded (Gemma 3's whole embedding, decoded, would
# be 640 MiB). 16 MiB against 4: fewer, longer sgemm calls for the long matrices (the
# 1B shape's gate/up: 8 tiles of 2,048 rows, not 32 of 512; its down projection 8 of 256,
# not 16 of 128); the same bits. A 512-token exact prefill, tile sizes alternating in one
# process (benchmarks/prefill_tiles.py --rounds 4-5, the Xeon, idle but drifting by up to
# 25 % within minutes), median of the rounds' ratios, two runs each: the Llama-3.2-1B
# shape 1.17x and 1.01x at one thread, 1.02x and 1.11x at two; the Llama-3.1-8B shape's
# first 4 layers 1.09x and 1.06x at one, 1.06x and 0.96x at two (8 MiB: between the
# two). Short matrices keep their tiles (TILES_PER_MATRIX's share is below either cap:
# SmolLM2's and Gemma 3's tiles are the same either way).
DENSE_TILE_BYTES = 16 << 20
# The same cap for the compiled GEMM's tiles (where sgemm rounds a row by its batch). Its
# loops read the whole tile once for every panel of sixteen activation rows (32 times in
# a 512-token prefill, :func:`.gemm.product`), so every thread's tile should stay in the
# L3 cache between panels, where two threads' 16 MiB tiles are the whole L3 of a Zen 3
# CCX (32 MiB), with the activations' panels and the other layers' work beside them.
# 4 MiB against 16, a 512-token exact prefill of the Llama-3.2-1B shape (AMD EPYC Zen 3,
# AVX2; benchmarks/prefill_tiles.py --layers 16, alternating in one process, median of
# the rounds' ratios): 1.14x and 1.06x at two threads (2 MiB: 1.12x both times), 1.05x
# at one; the Llama-3.1-8B shape's first 4 layers 1.13x at two, 0.99x at one. The same
# bits: each sum's order is the GEMM's alone, whatever the tile.
GEMM_TILE_BYTES = 4 << 20
# Bytes of a matrix (as stored) per thread that shares its products: below it a thread's
# share is a few microseconds, about what posting a product to the pool's threads costs
# (and on many cores, small products would keep all of them spinning).
PARALLEL_MIN_BYTES = 64 << 10
# Bytes of a matrix (as stored) from which a product of several activation rows first
# copies them onto a 64-byte line where they do not begin on one (:func:`_lined`): ~5 us
# of Python, under 1 % of such a product (~1 ms and more), against ~5 % of its passes.
LINED_MIN_BYTES = 1 << 20

# Rows from which a row-wise call of a prefill (a norm, the SwiGLU, packing the GEMM's
# panels) is cut between the threads that share its products (:func:`by_rows`): below,
# the hand-off (tens of microseconds) costs about what half the rows do. At two threads, a
# 512-token exact prefill of the Llama-3.2-1B shape spent ~0.14 s of ~2.9 in these calls
# on one thread while the other waited for the next product
SHARED_ROWS = 64

_threads: int | None = None  # the --threads cap


def set_kernel_threads(threads: int | None) -> None:
    """Cap the kernels' threads at ``threads`` (None: numba's default, one per core)."""
    global _threads
    _threads = threads


def numba_cache_dir() -> Path:
    """Where compiled kernels are cached: ``$NUMBA_CACHE_DIR``, else meshnode's cache folder
    (``$XDG_CACHE_HOME/meshnode/numba/SOURCES``, ``~/.cache/meshnode/numba/SOURCES``).

    ``SOURCES`` is a digest of this package's code: numba checks a cached function
    against its own file only, so a kernel cached before a change to a module it inlines
    (a decoder, the pool's word layout) would otherwise be loaded stale.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "meshnode" / "numba" / _sources_digest()


def _sources_digest() -> str:
    """A short digest of the ``.py`` files of this package."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def configure_numba() -> None:
    """Point numba's cache at :func:`numba_cache_dir` unless ``$NUMBA_CACHE_DIR`` is set.

    numba reads ``NUMBA_CACHE_DIR`` once, when it is first imported; its own default is
    ``__pycache__`` beside the sources, which a system-wide install cannot write and
    which numba checks against each function's own file only.
    """
    os.environ.setdefault("NUMBA_CACHE_DIR", str(numba_cache_dir()))


def lock_numba_cache() -> None:
    """:func:`configure_numba`, and numba's cache saves and loads made to hold the folder's
    lock (:func:`.warmup.lock_cache`), before this process compiles anything. numba's cache
    is safe for one process at a time: every process takes the lock, not only one that
    starts a compile-ahead worker (several nodes on one machine, or a loaded machine where
    no worker starts, compile into the same folder at once)."""
    configure_numba()
    from meshnode.engine.cpu import warmup

    warmup.lock_cache()


@cache
def kernels() -> ModuleType:
    """The kernels module, imported (and numba configured) on first use."""
    lock_numba_cache()
    from meshnode.engine.cpu import kernels as module

    return module


def _threads_here() -> int:
    """The kernel threads of a product: the ``--threads`` cap, else one per usable core."""
    if _threads is not None:
        return _threads
    from meshnode.engine.cpu.gauge import usable_cpus

    return len(usable_cpus())


@cache
def _pool() -> Any:
    """The process's kernel threads (:mod:`.pool`), started at the first shared product."""
    kernels()  # numba configured before it is imported
    from meshnode.engine.cpu.pool import KernelPool

    return KernelPool()


@cache
def _tiles() -> ModuleType:
    """The tiled products' module (:mod:`.tiles`), imported on first use."""
    kernels()  # numba configured before it is imported
    from meshnode.engine.cpu import tiles

    return tiles


@cache
def _gemm() -> ModuleType:
    """The compiled GEMM (:mod:`.gemm`), imported on first use."""
    kernels()  # numba configured before it is imported
    from meshnode.engine.cpu import gemm

    return gemm


@cache
def _tile_threads() -> Any:
    """The process's tile threads (:class:`.tiles.TileThreads`), started at the first
    shared prefill product."""
    return _tiles().TileThreads()


def shared_threads() -> int:
    """How many threads may share BLAS work now: the ``--threads`` cap, at most the cores
    other processes leave this one (the kernel threads' gauge)."""
    return max(1, min(_threads_here(), int(_pool().gauge.free() + 0.5)))


def share(fn: Callable[[int], None], count: int, threads: int) -> None:
    """``fn(i)`` for ``i`` in ``range(count)``, items of BLAS work (prefill's tiles, a long
    segment's attention blocks): on ``threads`` tile threads (:class:`.tiles.TileThreads`)
    when ``threads`` > 1; else, or when they cannot (no BLAS threadpoolctl can set,
    another thread using them), in this thread. BLAS is single-threaded either way
    (:func:`.tiles.single_threaded_blas`): the items' results are the same bits however
    they were shared, and BLAS's own threads would spin on cores others use."""
    if threads > 1 and _tile_threads().run(fn, count, threads):
        return
    _tiles().single_threaded_blas()
    for i in range(count):
        fn(i)


def by_rows(fn: Callable[[int, int], None], rows: int, align: int = 1) -> None:
    """``fn(lo, hi)`` over rows ``0 .. rows - 1`` in parts: where there are at least
    :data:`SHARED_ROWS`, one run of rows per thread that may share work now
    (:func:`shared_threads`), each part's first row a multiple of ``align``, run by the
    tile threads (:func:`share`); else ``fn(0, rows)`` here. For a compiled row-wise call
    that releases the GIL (a prefill's norms, its SwiGLU, the GEMM's panels): each row is
    the same bits in whichever part, on whichever thread."""
    threads = shared_threads() if rows >= SHARED_ROWS else 1
    if threads < 2:
        fn(0, rows)
        return
    units = -(-rows // align)
    cuts = [min(rows, align * (units * i // threads)) for i in range(threads + 1)]
    share(lambda i: fn(cuts[i], cuts[i + 1]), threads, threads)


def dense_product(x: Any, w: np.ndarray, sizes: Sequence[int] | None = None) -> np.ndarray:
    """``x @ w`` for float32 weights ``w`` ``[in, out]`` (``--dtype float32``), each row in
    an order fixed by its segment's row count (``sizes``, in order; one segment without),
    as :meth:`BlockMatrix.product_by_segment` does for blocks: a row of a segment of at
    most :data:`MAX_KERNEL_ROWS` rows is one gemv, alone or batched; a longer segment's
    rows go through one sgemm with at least :data:`.tiles.SGEMM_MIN_ROWS` columns (zero
    columns added), above OpenBLAS's small-matrix kernel, whose sums round otherwise
    (:mod:`.tiles`); or, where this BLAS rounds a row by its batch
    (:func:`.tiles.rows_independent`), through the compiled GEMM (:mod:`.gemm`), a tile
    of columns per tile thread. BLAS runs single-threaded
    (:func:`.tiles.single_threaded_blas`). ``x @ w`` itself chose gemv or an sgemm
    kernel by the batch's row count, so a row's bits depended on its batch (issue 35)."""
    x = np.asarray(x, dtype=np.float32)
    sizes = [x.shape[0]] if sizes is None else sizes
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"segments of {sum(sizes)} rows for x of {x.shape[0]}")
    t = _tiles()
    t.single_threaded_blas()
    out = np.empty((x.shape[0], w.shape[1]), np.float32)
    small = np.repeat([s <= MAX_KERNEL_ROWS for s in sizes], sizes)
    for i in np.flatnonzero(small):
        np.matmul(x[i], w, out=out[i])
    if not small.all() and not t.rows_independent():
        out[~small] = _dense_gemm(x[~small], w)
    elif not small.all():
        if w.shape[1] < t.SGEMM_MIN_ROWS:
            w = np.pad(w, ((0, 0), (0, t.SGEMM_MIN_ROWS - w.shape[1])))
        out[~small] = (x[~small] @ w)[:, : out.shape[1]]
    return out


def _dense_gemm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` (``w`` float32 ``[in, out]``) by :func:`.gemm.product`, a tile of
    columns (the shape's tiles) per item shared by the tile threads: each element one
    sum in the order of ``k``, whatever the rows, the tiles or the threads."""
    gemm = _gemm()
    w = np.ascontiguousarray(w)
    rows, (n_in, n_out) = x.shape[0], w.shape
    panels = gemm.packed(x, by_rows)
    out = np.empty((rows, n_out), np.float32)
    flat = w.reshape(-1)
    bounds = _tiles().tiles(n_out, n_in, GEMM_TILE_BYTES)

    def tile(i: int) -> None:
        lo, hi = bounds[i]
        gemm.product(panels, rows, flat[lo:], 1, n_out, hi - lo, out, lo)

    share(tile, len(bounds), shared_threads())
    return out


def supported(t: RawTensor) -> bool:
    """Whether ``t`` is a matrix the kernels can multiply in its stored format: rows of
    whole blocks, and of whole 32-value chunks (the kernels' step, :mod:`.blocks`)."""
    fmt = format_of(t.dtype)
    n_in = t.shape[1] if len(t.shape) == 2 else 0
    return fmt is not None and n_in > 0 and n_in % fmt.block_size == 0 and n_in % 32 == 0


def _lined(x: np.ndarray) -> np.ndarray:
    """``x`` flat, from a 64-byte cache line (a copy where it does not begin on one): the
    kernels load the activations as 32-byte vectors, and where they began 16 bytes into a
    line (NumPy's arrays are 16-byte aligned) every other load straddled two lines, ~5 %
    of an 8-row exact product (``benchmarks/narrow_parts.py --offsets``)."""
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.ctypes.data % 64 == 0:
        return flat
    buf = np.empty(flat.size + 16, np.float32)
    at = (-(buf.ctypes.data // 4)) % 16
    lined: np.ndarray = buf[at : at + flat.size]
    lined[:] = flat
    return lined


@dataclass(frozen=True)
class _Part:
    fmt: Format
    raw: np.ndarray  # [out_i, row bytes] uint8, usually a view of the memory-mapped file


def _read_only(raw: np.ndarray) -> np.ndarray:
    """A read-only view of ``raw``: numba compiles a kernel per argument type, and a
    writable array is another type than the read-only memory map of a model file."""
    view = raw.view()
    view.flags.writeable = False
    return view


_EMPTY = _read_only(np.zeros((0, 0), np.uint8))


class BlockMatrix:
    """Tensors ``[out_i, in]`` stacked along ``out``, kept in their GGUF formats.

    Used as the ``[in, out]`` right-hand side of ``x @ m``; ``rows(ids)`` decodes rows
    (the embedding lookup). At most three parts (Q/K/V).
    """

    # NumPy then leaves ``ndarray @ BlockMatrix`` to ``__rmatmul__``
    __array_ufunc__ = None

    def __init__(self, tensors: Sequence[RawTensor]) -> None:
        if not 1 <= len(tensors) <= 3:
            raise ValueError(f"a block matrix has 1 to 3 parts, got {len(tensors)}")
        n_in = tensors[0].shape[1]
        parts = []
        for t in tensors:
            fmt = format_of(t.dtype)
            if fmt is None or not supported(t) or t.shape[1] != n_in:
                raise ValueError(f"tensor {t.name}: {t.dtype} {t.shape} is not a block matrix")
            raw = np.asarray(t.data).reshape(t.shape[0], row_bytes(fmt, n_in))
            parts.append(_Part(fmt, _read_only(raw)))
        self.parts = tuple(parts)
        self.n_in = n_in
        self.n_out = sum(p.raw.shape[0] for p in parts)
        self.shape = (n_in, self.n_out)  # as the [in, out] float32 matrix it stands for
        self.nbytes = sum(int(p.raw.nbytes) for p in parts)
        # unused parts: no rows, in the first part's format (one compiled kernel per mix)
        ids = [p.fmt.kernel_id for p in parts]
        self._fmts = tuple(ids + [ids[0]] * (3 - len(parts)))
        a, b, c = [p.raw for p in parts] + [_EMPTY] * (3 - len(parts))
        self._raws = (a, b, c)
        self._nbytes = sum(int(p.raw.nbytes) for p in parts)

    def __repr__(self) -> str:
        kinds = "+".join(p.fmt.name for p in self.parts)
        return f"BlockMatrix({kinds}, in={self.n_in}, out={self.n_out})"

    def __rmatmul__(self, x: Any) -> np.ndarray:
        """``x @ self`` for ``x`` ``[r, in]`` or ``[in]``: ``[r, out]`` or ``[out]``."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim == 1:
            one: np.ndarray = self._product(x[None, :])[0]
            return one
        return self._product(x)

    def product_by_segment(self, x: Any, sizes: Sequence[int]) -> np.ndarray:
        """``x @ self`` for the rows of several segments (``sizes``: their row counts, in
        order), each row by the path its segment would take alone: the rows of a segment
        of at most :data:`MAX_KERNEL_ROWS` rows through the kernel (that many at a time),
        the others' rows through BLAS in one product. A row's bits then do not depend on
        the batch it is in (the kernel's row and BLAS's row differ in the last bits)."""
        x = np.asarray(x, dtype=np.float32)
        if sum(sizes) != x.shape[0]:
            raise ValueError(f"segments of {sum(sizes)} rows for x of {x.shape[0]}")
        small = np.repeat([s <= MAX_KERNEL_ROWS for s in sizes], sizes)
        if not small.any():
            return self._product(x)
        out = np.empty((x.shape[0], self.n_out), np.float32)
        if not small.all():
            out[~small] = self._product(x[~small])
        rows = np.flatnonzero(small)
        for lo in range(0, rows.size, MAX_KERNEL_ROWS):
            some = rows[lo : lo + MAX_KERNEL_ROWS]
            out[some] = self._product(x[some])
        return out

    def _product(self, x: np.ndarray) -> np.ndarray:
        if x.shape[1] != self.n_in:
            raise ValueError(f"x has {x.shape[1]} columns, the matrix {self.n_in} rows")
        out = np.empty((x.shape[0], self.n_out), np.float32)
        if x.shape[0] > MAX_KERNEL_ROWS:
            self._tiled_product(x, out)
            return out
        if x.shape[0] > 1 and self._nbytes >= LINED_MIN_BYTES:
            flat = _lined(x)  # the k-row passes read the activations again every block
        else:  # ~5 us of Python: more than a line's worth of a small or one-row product
            flat = np.ascontiguousarray(x).reshape(-1)
        threads = min(_threads_here(), self._nbytes // max(1, PARALLEL_MIN_BYTES))
        k = kernels()
        many = k.ONE_ROW if x.shape[0] == 1 else k.K_ROWS  # the k-row tiles at first use
        chunk = partial(k.chunk_kernel, *self._fmts, many)  # compiled at its first run
        if threads > 1 and _pool().run(chunk, self._raws, flat, out, threads):
            return out
        # its own serial function, not the chunk function alone (pool.run_alone), which
        # was ~1.4x slower on one row of Q4_1 (same _rows, other code around it)
        k.product_kernel(*self._fmts, many)(*self._raws, flat, out)
        return out

    def _tiled_product(self, x: np.ndarray, out: np.ndarray) -> None:
        """``out = x @ self`` a tile of decoded rows at a time, each through BLAS, shared
        by the threads that may run (:func:`share`)."""
        t = _tiles()
        x = np.ascontiguousarray(x)
        parts = [(p.fmt.kernel_id, p.raw) for p in self.parts]
        if t.rows_independent():
            bounds = t.tiles(self.n_out, self.n_in, DENSE_TILE_BYTES)  # the shape's alone

            def tile(i: int) -> None:
                t.product_tile(parts, x, out, *bounds[i])

        else:  # this sgemm rounds a row by its batch: the compiled GEMM's one order
            bounds = t.tiles(self.n_out, self.n_in, GEMM_TILE_BYTES)
            panels, rows = _gemm().packed(x, by_rows), x.shape[0]

            def tile(i: int) -> None:
                t.gemm_tile(parts, panels, rows, out, *bounds[i])

        share(tile, len(bounds), shared_threads())

    def dense(self) -> np.ndarray:
        """The whole matrix decoded as float32 ``[out, in]`` (a new array)."""
        out = np.empty((self.n_out, self.n_in), np.float32)
        start = 0
        for p in self.parts:
            rows = p.raw.shape[0]
            every = np.arange(rows, dtype=np.int64)
            _tiles().decode_kernel(p.fmt.kernel_id)(p.raw, every, out[start : start + rows])
            start += rows
        return out

    def rows(self, ids: Any) -> np.ndarray:
        """Rows ``ids`` of the matrix (``[out, in]`` view) as float32 ``[len(ids), in]``."""
        if len(self.parts) != 1:
            raise ValueError("row lookup is for single-part matrices (the embedding)")
        idx = np.asarray(ids, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_out):
            raise IndexError(f"row index outside 0..{self.n_out - 1}")
        out = np.empty((idx.size, self.n_in), np.float32)
        p = self.parts[0]
        _tiles().decode_kernel(p.fmt.kernel_id)(p.raw, idx, out)
        return out
