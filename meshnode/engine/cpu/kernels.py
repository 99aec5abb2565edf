"""Compiled CPU kernels over GGUF blocks: k-row products, row gathers, whole-matrix decode.

The weights of one product come as up to three parts (Q/K/V or gate/up, each ``[out_i,
row bytes]`` in its own format) so a fused projection is one call and one parallel region.
Output rows are processed one at a time, 32 values (one :func:`.blocks.chunk`, four
vectors) at a step:

- one activation row (decode): the chunk is multiplied into four vector accumulators
  while it is in registers; nothing is stored;
- ``k`` rows (verify windows, batches): the row is decoded once into a small float32
  buffer (L1-resident), then multiplied with the activation rows four at a time, so ``k``
  rows cost one pass over the weights and the decode is paid once.

Sums are float32 in vector lanes and then across lanes: the order differs from a plain
loop, the terms are those of "dequantize, then multiply".

Each kernel exists serial (``*_serial``, for one thread: no parallel region to start per
product) and parallel over chunks of output rows. Compiled with numba at first use and
cached on disk (``cache=True`` in ``NUMBA_CACHE_DIR``, see :mod:`.matrix`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import njit, prange

from meshnode.engine.cpu.blocks import chunk
from meshnode.engine.cpu.simd import vadd, vfma, vload, vstore, vsum, vzero

# Output rows per parallel work item: large enough that a work item's start-up (a small
# buffer, a dispatch) is noise, small enough that the smallest projections of a small
# model (576 rows) still split over a few threads.
CHUNK_ROWS = 64


@njit(cache=True)
def _dot1(fmt, row, x, n_in):  # type: ignore[no-untyped-def]
    # one activation row: decode and multiply in registers
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    for c in range(n_in // 32):
        w0, w1, w2, w3 = chunk(fmt, row, c)
        o = 32 * c
        a0 = vfma(w0, vload(x, o), a0)
        a1 = vfma(w1, vload(x, o + 8), a1)
        a2 = vfma(w2, vload(x, o + 16), a2)
        a3 = vfma(w3, vload(x, o + 24), a3)
    return vsum(vadd(vadd(a0, a1), vadd(a2, a3)))


@njit(cache=True)
def _decode(fmt, row, w):  # type: ignore[no-untyped-def]
    # the whole row into w (float32, the row's length)
    for c in range(w.shape[0] // 32):
        w0, w1, w2, w3 = chunk(fmt, row, c)
        o = 32 * c
        vstore(w, o, w0)
        vstore(w, o + 8, w1)
        vstore(w, o + 16, w2)
        vstore(w, o + 24, w3)


@njit(cache=True)
def _dot4(w, x, r, n_in):  # type: ignore[no-untyped-def]
    # activation rows r .. r + 3 (x flat, rows of n_in) with the decoded row w; two
    # accumulators per row so that eight FMA chains are in flight
    p, q, s, t = r * n_in, (r + 1) * n_in, (r + 2) * n_in, (r + 3) * n_in
    a0, a1, b0, b1 = vzero(), vzero(), vzero(), vzero()
    c0, c1, d0, d1 = vzero(), vzero(), vzero(), vzero()
    for j in range(0, n_in, 16):
        w0, w1 = vload(w, j), vload(w, j + 8)
        a0, a1 = vfma(w0, vload(x, p + j), a0), vfma(w1, vload(x, p + j + 8), a1)
        b0, b1 = vfma(w0, vload(x, q + j), b0), vfma(w1, vload(x, q + j + 8), b1)
        c0, c1 = vfma(w0, vload(x, s + j), c0), vfma(w1, vload(x, s + j + 8), c1)
        d0, d1 = vfma(w0, vload(x, t + j), d0), vfma(w1, vload(x, t + j + 8), d1)
    return vsum(vadd(a0, a1)), vsum(vadd(b0, b1)), vsum(vadd(c0, c1)), vsum(vadd(d0, d1))


@njit(cache=True)
def _dot_one(w, x, r, n_in):  # type: ignore[no-untyped-def]
    p = r * n_in
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    for j in range(0, n_in, 32):
        a0 = vfma(vload(w, j), vload(x, p + j), a0)
        a1 = vfma(vload(w, j + 8), vload(x, p + j + 8), a1)
        a2 = vfma(vload(w, j + 16), vload(x, p + j + 16), a2)
        a3 = vfma(vload(w, j + 24), vload(x, p + j + 24), a3)
    return vsum(vadd(vadd(a0, a1), vadd(a2, a3)))


@njit(cache=True)
def _rows(fmt, raw, x, out, lo, hi, col, w):  # type: ignore[no-untyped-def]
    # rows lo .. hi - 1 of one part (format fmt, a literal: the decoders fold to one
    # format) into columns col + lo .. of out; w: float32 [n_in] scratch
    k, n_in = out.shape[0], w.shape[0]
    for o in range(lo, hi):
        row = raw[o]
        if k == 1:
            out[0, col + o] = _dot1(fmt, row, x, n_in)
            continue
        _decode(fmt, row, w)
        r = 0
        while r + 4 <= k:
            dots = _dot4(w, x, r, n_in)
            out[r, col + o], out[r + 1, col + o] = dots[0], dots[1]
            out[r + 2, col + o], out[r + 3, col + o] = dots[2], dots[3]
            r += 4
        while r < k:
            out[r, col + o] = _dot_one(w, x, r, n_in)
            r += 1


def _serial_product(fa: int, fb: int, fc: int) -> Any:
    @njit(cache=True)
    def product(a, b, c, x, out):  # type: ignore[no-untyped-def]
        w = np.empty(x.shape[0] // out.shape[0], np.float32)
        ends = (a.shape[0], a.shape[0] + b.shape[0])  # int64, not literal: one _rows each
        _rows(fa, a, x, out, 0, a.shape[0], ends[0] - ends[0], w)
        _rows(fb, b, x, out, 0, b.shape[0], ends[0], w)
        _rows(fc, c, x, out, 0, c.shape[0], ends[1], w)

    return product


def _parallel_product(fa: int, fb: int, fc: int) -> Any:
    @njit(cache=True, parallel=True)
    def product(a, b, c, x, out):  # type: ignore[no-untyped-def]
        na, nb, nc = a.shape[0], b.shape[0], c.shape[0]
        ca = (na + CHUNK_ROWS - 1) // CHUNK_ROWS
        cb = (nb + CHUNK_ROWS - 1) // CHUNK_ROWS
        cc = (nc + CHUNK_ROWS - 1) // CHUNK_ROWS
        n_in = x.shape[0] // out.shape[0]
        for ch in prange(ca + cb + cc):
            w = np.empty(n_in, np.float32)
            if ch < ca:
                lo = ch * CHUNK_ROWS
                _rows(fa, a, x, out, lo, min(na, lo + CHUNK_ROWS), na - na, w)
            elif ch < ca + cb:
                lo = (ch - ca) * CHUNK_ROWS
                _rows(fb, b, x, out, lo, min(nb, lo + CHUNK_ROWS), na, w)
            else:
                lo = (ch - ca - cb) * CHUNK_ROWS
                _rows(fc, c, x, out, lo, min(nc, lo + CHUNK_ROWS), na + nb, w)

    return product


@functools.cache
def product_kernel(fa: int, fb: int, fc: int, parallel: bool) -> Any:
    """``product(a, b, c, x, out)``: ``out[r, o] = x[r] . row o`` of the parts ``a``,
    ``b``, ``c`` (formats ``fa``, ``fb``, ``fc``) stacked along ``out``.

    ``x`` is the activations flattened (``k`` rows of ``n_in``), ``out`` is ``[k, n_out]``;
    an unused part has zero rows. ``parallel``: over chunks of output rows, else in the
    calling thread (one thread: no parallel region to start per product).

    Each format mix is its own compiled function: the ids are compile-time constants in
    it, so each part's decoder is inlined with no dispatch in the loops. numba's disk
    cache keys a closure by its captured values, so each mix compiles once per machine.
    """
    return (_parallel_product if parallel else _serial_product)(fa, fb, fc)


def _decode_kernel(fmt: int) -> Any:
    @njit(cache=True, parallel=True)
    def decode_rows(raw, ids, out):  # type: ignore[no-untyped-def]
        for i in prange(ids.shape[0]):
            _decode(fmt, raw[ids[i]], out[i])

    return decode_rows


@functools.cache
def decode_kernel(fmt: int) -> Any:
    """``decode_rows(raw, ids, out)``: ``out[i]`` = row ``ids[i]`` of ``raw`` (format
    ``fmt``) decoded; the embedding lookup, and the whole matrix for prefill's BLAS."""
    return _decode_kernel(fmt)
