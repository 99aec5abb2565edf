"""A paged sequence's keys or values copied into one float32 array in position order, for
the BLAS path of a long segment's attention (:meth:`meshnode.engine.kv_pages.PagedCache.write`).

A sequence resumed from a cached prefix holds its blocks in a few runs of consecutive
slots (each earlier turn of a chat took its own), so NumPy needs no row-by-row gather; but
a float16 cache (``--kv-dtype f16``, the default with q8 weights) is widened by NumPy one
value at a time, 4 ns each: 2 ms a layer for SmolLM2 at 1,600 positions, which grew a
chat turn's first token by a tenth at turn 10 (issue 30). Here each run is widened sixteen
lanes at a time (:func:`.simd_kv.wload_kv`, exact), one call per array and layer.
"""

from __future__ import annotations

from numba import njit

from meshnode.engine.cpu.simd import wstore
from meshnode.engine.cpu.simd_kv import wload_kv

__all__ = ["LANES", "widen_spans"]

#: Floats per step: a span's length is a multiple (the caller checks the head dimension).
LANES = 16


@njit(nogil=True, cache=True)
def widen_spans(kv, out, spans):  # type: ignore[no-untyped-def]
    """For each row ``(src, dst, n)`` of ``spans`` (int64 ``[S, 3]``): ``out[dst : dst +
    n] = kv.flat[src : src + n]`` as float32. ``kv``: a C-contiguous float32 array, or a
    float16 one viewed as ``uint16``; ``out``: a flat float32 array; ``n`` a multiple of
    :data:`LANES`."""
    for r in range(spans.shape[0]):
        src, dst, n = spans[r, 0], spans[r, 1], spans[r, 2]
        for c in range(0, n, LANES):
            wstore(out, dst + c, wload_kv(kv, src + c))
