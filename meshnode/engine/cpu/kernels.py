"""Compiled CPU kernels over GGUF blocks: k-row products, row gathers, whole-matrix decode.

The weights of one product come as up to three parts (Q/K/V or gate/up, each ``[out_i,
row bytes]`` in its own format) so a fused projection is one call and one parallel region.
Each output row is decoded once into a small float32 buffer (:func:`.dequant.decode_row`)
and then multiplied with all ``k`` activation rows while it is in the L1 cache: ``k`` rows
cost one pass over the weights.

Compiled with numba at first use and cached on disk (``cache=True``): the cache lives in
``NUMBA_CACHE_DIR``, which :mod:`meshnode.engine.cpu` points at meshnode's cache folder
unless it is set (numba's default, ``__pycache__`` beside this file, is not writable in
a system-wide install).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from meshnode.engine.cpu.dequant import decode_row

# Output rows per parallel work item: large enough that a work item's start-up (a small
# buffer, a dispatch) is noise, small enough that the smallest projections of a small
# model (576 rows) still split over a few threads.
CHUNK_ROWS = 64


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot(w, xr):  # type: ignore[no-untyped-def]
    s = np.float32(0.0)
    for j in range(w.shape[0]):
        s += w[j] * xr[j]
    return s


@njit(cache=True, parallel=True)
def matmul_parts(fmts, a, b, c, x, out):  # type: ignore[no-untyped-def]
    """``out[r, o] = x[r] . row o`` of the parts ``a``, ``b``, ``c`` stacked along ``out``.

    ``fmts`` holds the parts' kernel ids; an unused part has zero rows.
    """
    na, nb = a.shape[0], b.shape[0]
    n_out = na + nb + c.shape[0]
    k, n_in = x.shape
    chunks = (n_out + CHUNK_ROWS - 1) // CHUNK_ROWS
    for ch in prange(chunks):
        w = np.empty(n_in, np.float32)
        for o in range(ch * CHUNK_ROWS, min(n_out, (ch + 1) * CHUNK_ROWS)):
            if o < na:
                decode_row(fmts[0], a[o], w)
            elif o < na + nb:
                decode_row(fmts[1], b[o - na], w)
            else:
                decode_row(fmts[2], c[o - na - nb], w)
            for r in range(k):
                out[r, o] = _dot(w, x[r])


@njit(cache=True, parallel=True)
def gather_rows(fmt, raw, ids, out):  # type: ignore[no-untyped-def]
    """``out[i]`` = row ``ids[i]`` of ``raw`` decoded (the embedding lookup)."""
    for i in prange(ids.shape[0]):
        decode_row(fmt, raw[ids[i]], out[i])


@njit(cache=True, parallel=True)
def decode_matrix(fmt, raw, out):  # type: ignore[no-untyped-def]
    """Every row of ``raw`` decoded into ``out`` ``[rows, n_in]`` (prefill's BLAS path)."""
    for o in prange(raw.shape[0]):
        decode_row(fmt, raw[o], out[o])
