"""The activations' 8-bit quantization for the products of :mod:`.q8_kernels` (``--dtype
q8``): each row in blocks of 32 values, ``q = round(x / d)`` with ``d = max|x| / 127``, as
llama.cpp's Q8_0/Q8_1 do, into one buffer that holds beside the int8 quants what the
kernels read per block and per group of eight rows (:func:`quantize` says where)."""

from __future__ import annotations

import numpy as np

from meshnode.engine.cpu.simd import entry
from meshnode.engine.cpu.simd_int import bsplat
from meshnode.engine.cpu.simd_q8 import absmax32, bstore, bsum16, nonfinite32, quant32

__all__ = ["HEADER", "ONE_ROW_MAX", "buffer_bytes", "byte_areas", "quantize", "quantized"]

# Products of up to this many rows go one activation row at a time (lanes: weight rows)
ONE_ROW_MAX = 1
# Bytes before the areas of quantize's buffer (n_in and k, int64, at bytes 0 and 8)
HEADER = 64


@entry()
def buffer_bytes(k, n_in):  # type: ignore[no-untyped-def]
    """Bytes of :func:`quantize`'s buffer for ``k`` rows of ``n_in`` activations."""
    return HEADER + k * n_in + 448 * ((k + 7) // 8) * (n_in // 32)


@entry()
def byte_areas(n, blocks):  # type: ignore[no-untyped-def]
    # byte offsets of the transposed areas (see quantize): quants, d, sums, halves' sums
    xt = HEADER + n
    dxt = xt + 256 * blocks
    sxt = dxt + 32 * blocks
    ot = sxt + 96 * blocks
    return xt, ot, dxt, sxt


@entry()
def quantize(x, k, buf):  # type: ignore[no-untyped-def]
    """Quantize ``x`` (float32, flat: ``k`` rows of ``n_in``, whole 32-value blocks) into
    ``buf`` (``uint8``, :func:`buffer_bytes` long).

    Row by row (``n = k n_in`` bytes, from byte :data:`HEADER`; block ``b`` of row ``r``
    at ``32 (r nb + b)``, ``nb = n_in / 32``): the int8 quants. Then by groups of eight
    rows (lane ``r % 8``), for each block ``b`` of group ``g`` (``i = g nb + b``): the
    quants as 32 bytes per four values, the four of each of the eight rows in turn (256
    bytes at ``256 i``; only for more than :data:`ONE_ROW_MAX` rows); the eight rows'
    scales ``d`` (float32 ``[8]`` at ``32 i``); ``d`` times the sum of their quants, of
    the first 16, of the last 16 (three areas of ``[8]`` at ``32 i``); and the int32
    ``-sum`` of the quants of the first and of the last 16 (two areas of ``[8]`` at ``32
    i``), which the kernels shift by a format's offset. The lanes of missing rows in the
    last group are zeros. A block with a value that is not finite gets ``d = nan`` and
    zero quants, so that products with it are nan, as in float32."""
    n = x.shape[0]
    n_in = n // k
    nb = n_in // 32
    blocks = (k + 7) // 8 * nb
    head = buf[:16].view(np.int64)
    head[0], head[1] = n_in, k
    xt, ot, dxt, _ = byte_areas(n, blocks)
    wide = k > ONE_ROW_MAX
    if k % 8:
        buf[xt:].fill(0)
    words = buf[HEADER : HEADER + n].view(np.int32)
    tq = buf[xt:dxt].view(np.int32)
    tf = buf[dxt:ot].view(np.float32)  # d, sum, first and last 16
    ts = buf[ot : ot + 64 * blocks].view(np.int32)
    nan, zero = np.float32(np.nan), np.float32(0.0)
    for g in range(n // 32):
        r, b = g // nb, g % nb
        i, lane = (r // 8) * nb + b, r % 8
        o = 32 * g
        if nonfinite32(x, o):
            d, v = nan, bsplat(0)
        else:
            amax = absmax32(x, o)
            inv = np.float32(127.0) / amax if amax > 0 else zero
            d, v = amax / np.float32(127.0), quant32(x, o, inv)
        bstore(buf, HEADER + o, v)
        if wide:
            at = 128 * (i // 2) + 8 * (i % 2) + lane
            for j in range(8):
                tq[at + 16 * j] = words[8 * g + j]
        low, high = bsum16(v, 0), bsum16(v, 1)
        at = 8 * i + lane
        tf[at] = d
        tf[8 * blocks + at] = d * np.float32(low + high)
        tf[16 * blocks + at] = d * np.float32(low)
        tf[24 * blocks + at] = d * np.float32(high)
        ts[at], ts[8 * blocks + at] = -low, -high


@entry()
def quantized(x, k):  # type: ignore[no-untyped-def]
    """:func:`quantize`'s buffer for ``x`` (flat float32, ``k`` rows), new, from a 64-byte
    cache line. numba's arrays are 32-byte aligned (the 8192-wide down projection's began
    32 bytes into a line): every area of the buffer is whole 32-byte steps from its start,
    so AVX2's loads never straddle two lines, and from a line neither do AVX-512's 64-byte
    loads of two blocks."""
    n = buffer_bytes(k, x.shape[0] // k)
    buf = np.empty(n + 64, np.uint8)
    at = (-buf.ctypes.data) % 64
    q = buf[at : at + n]
    quantize(x, k, q)
    return q
