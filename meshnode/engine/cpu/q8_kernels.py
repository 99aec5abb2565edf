"""Compiled products of GGUF blocks with 8-bit activations (``--dtype q8``, inexact).

Each activation row is quantized in blocks of 32 values, as llama.cpp's Q8_0/Q8_1 do:
``q = round(x / d)`` with ``d = max|x| / 127``, stored as int8 with ``d`` (float32), the
sums of ``q`` over each four values (the lanes of :func:`.simd_int.dot4`) and ``d`` times
the sums of ``q`` over each 16 and 32 values. Then for each 32-value chunk of a weight row the
quants, unpacked to unsigned bytes ``u``, meet the block's int8 values in one integer dot
product (eight int32 lanes, :func:`.simd_int.dot4`) and the result is scaled in float:

- a weight ``s (u - z)`` (Q4_0, Q5_0, Q8_0 as ``w + 128``, Q3_K, Q6_K: an integer offset
  ``z``) gives ``s d (u . q - z sum(q))``, all in int32 lanes but for the last multiply;
- a weight ``s u + m`` (Q4_1, Q5_1 and the K-quants' minimums) gives ``s d (u . q) +
  m d sum(q)``: the sum of the quantized values, as llama.cpp's Q8_1 keeps it, not of
  ``x``. Then the rounding errors of ``x`` meet the weights ``s u + m``, which are about
  centred, not ``s u`` alone: with ``sum(x)`` SmolLM2's products were 2x further from
  float32 (relative error 1.5 % against 0.76 %);
- K-quants with a scale per 16 values multiply the two halves' lanes by their scales.

So the error against "dequantize, then multiply in float32" is that of rounding ``x``:
at most ``d / 2`` per value, ``sum |w_i| d_b / 2`` over a row. Formats without integer
quants (F32, F16, BF16) and rows that are not whole 32-value blocks are not taken here
(:mod:`.q8` sends them to the exact kernels).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cfunc, njit, types
from numba.np.numpy_support import carray

from meshnode.engine.cpu import pool
from meshnode.engine.cpu.atomics import ptr_f32, ptr_i64, ptr_u8
from meshnode.engine.cpu.simd import ishl, tofloat, vfma, vsplat, vsum, vzero
from meshnode.engine.cpu.simd_int import (
    band,
    bits32,
    bload,
    bor,
    bshl,
    bshr,
    bxor,
    dot4,
    fload,
    fload2,
    half,
    half2,
    iload,
    imul,
    ivsub,
    lane,
    lanes2,
    mul2,
    nibbles,
    prefetch,
)

# How far ahead of the row it multiplies a product asks for weight bytes: a decode
# product streams its weights from memory once, and one core's hardware prefetchers alone
# left the kernels at about 0.8x the time of the exact ones; with this, about 0.55x
# (SmolLM2's products in forward order, one thread; 2 and 8 KiB did no better).
PREFETCH_BYTES = 4096
# the words of a posted product (:mod:`.pool`), as compile-time constants
_WORDS = pool.WORDS
_A, _NA, _RBA, _B, _NB, _RBB = pool.A, pool.NA, pool.RBA, pool.B, pool.NB, pool.RBB
_C, _NC, _RBC, _X, _K, _N_IN = pool.C, pool.NC, pool.RBC, pool.X, pool.K, pool.N_IN
_OUT, _N_OUT, _CA, _CB, _ROWS = pool.OUT, pool.N_OUT, pool.CA, pool.CB, pool.ROWS


@njit(cache=True)
def quantize(x, buf):  # type: ignore[no-untyped-def]
    """Quantize ``x`` (float32, flat, ``n`` values in whole 32-value blocks) into ``buf``
    (``uint8``, :func:`buffer_bytes` long): int8 quants at bytes ``0 .. n``, then from
    byte ``n`` the int32 sum of each four quants, then from byte ``2 n`` four float32 per
    block: its scale ``d``, and ``d`` times the sum of its 32 quants and of each half.
    A block with a value that is not finite gets ``d = nan`` and zero quants, so that
    products with it are nan, as in float32."""
    n = x.shape[0]
    xq = buf[:n].view(np.int8)
    ls = buf[n : 2 * n].view(np.int32)
    xf = buf[2 * n : 2 * n + n // 2].view(np.float32)
    for b in range(n // 32):
        o = 32 * b
        amax = np.float32(0.0)
        for i in range(32):
            amax = max(amax, abs(x[o + i]))
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        d = amax / np.float32(127.0)
        if not np.isfinite(amax):
            inv, d = np.float32(0.0), np.float32(np.nan)
        for j in range(8):
            s = 0
            for i in range(4 * j, 4 * j + 4):
                q = round(x[o + i] * inv) if inv > 0 else 0
                xq[o + i] = q
                s += q
            ls[8 * b + j] = s
        low = ls[8 * b] + ls[8 * b + 1] + ls[8 * b + 2] + ls[8 * b + 3]
        high = ls[8 * b + 4] + ls[8 * b + 5] + ls[8 * b + 6] + ls[8 * b + 7]
        xf[4 * b] = d
        xf[4 * b + 1] = d * np.float32(low + high)
        xf[4 * b + 2] = d * np.float32(low)
        xf[4 * b + 3] = d * np.float32(high)


@njit(cache=True)
def buffer_bytes(n):  # type: ignore[no-untyped-def]
    """Bytes of :func:`quantize`'s buffer for ``n`` activations."""
    return n * 5 // 2


# -- one 32-value chunk: (int32 lanes, their float scale: the weight's times the
# activation block's, float term) --------------------------------------------------------
# ``o`` is the byte offset of the chunk's block in the flat weights, ``s`` the chunk's
# sub-block in it (K-quants), ``b`` the activation block it meets in the buffer ``q`` of
# :func:`quantize` for ``n`` activations: quants at byte 32 b, sums of four at n + 32 b,
# floats at 2 n + 16 b.


@njit(cache=True)
def _q4_0(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    p = ivsub(dot4(nibbles(w, o + 2), q, 32 * b), ishl(iload(q, n + 32 * b), 3))
    return p, half(w, o) * fload(q, 2 * n + 16 * b), np.float32(0.0)


@njit(cache=True)
def _q4_1(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    p = dot4(nibbles(w, o + 4), q, 32 * b)
    dm = mul2(half2(w, o), fload2(q, 2 * n + 16 * b))  # (d dx, m dx sum(q)) at once
    return p, lane(dm, 0), lane(dm, 1)


@njit(cache=True)
def _q5_0(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    u = bor(nibbles(w, o + 6), bshl(bits32(w, o + 2), 4))
    p = ivsub(dot4(u, q, 32 * b), ishl(iload(q, n + 32 * b), 4))
    return p, half(w, o) * fload(q, 2 * n + 16 * b), np.float32(0.0)


@njit(cache=True)
def _q5_1(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    u = bor(nibbles(w, o + 8), bshl(bits32(w, o + 4), 4))
    p = dot4(u, q, 32 * b)
    dm = mul2(half2(w, o), fload2(q, 2 * n + 16 * b))  # (d dx, m dx sum(q)) at once
    return p, lane(dm, 0), lane(dm, 1)


@njit(cache=True)
def _q8_0(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    # int8 weights as unsigned bytes w + 128
    p = ivsub(dot4(bxor(bload(w, o + 2), 128), q, 32 * b), ishl(iload(q, n + 32 * b), 7))
    return p, half(w, o) * fload(q, 2 * n + 16 * b), np.float32(0.0)


@njit(cache=True)
def _q2_k(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    u = band(bshr(bload(w, o + 16 + 32 * (s // 4)), 2 * (s % 4)), 3)
    sa, sb = w[o + 2 * s], w[o + 2 * s + 1]
    p = imul(dot4(u, q, 32 * b), lanes2(sa & 15, sb & 15))
    f = 2 * n + 16 * b  # the block's floats: the sums of its halves at f + 8, f + 12
    mins = np.float32(sa >> 4) * fload(q, f + 8) + np.float32(sb >> 4) * fload(q, f + 12)
    return p, half(w, o + 80) * fload(q, f), -half(w, o + 82) * mins


@njit(cache=True)
def _q3_k_scale(w, o, i):  # type: ignore[no-untyped-def]
    # as .blocks: six-bit scales, low four bits in scales[0:8], high two in scales[8:12]
    lo = (w[o + i % 8] >> (4 * (i // 8))) & 15
    hi = (w[o + 8 + i % 4] >> (2 * (i // 4))) & 3
    return np.int32(lo | (hi << 4)) - 32


@njit(cache=True)
def _q3_k(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    low = band(bshr(bload(w, o + 32 + 32 * (s // 4)), 2 * (s % 4)), 3)
    u = bor(low, bshl(band(bshr(bload(w, o), s), 1), 2))
    p = ivsub(dot4(u, q, 32 * b), ishl(iload(q, n + 32 * b), 2))
    scales = lanes2(_q3_k_scale(w, o + 96, 2 * s), _q3_k_scale(w, o + 96, 2 * s + 1))
    return imul(p, scales), half(w, o + 108) * fload(q, 2 * n + 16 * b), np.float32(0.0)


@njit(cache=True)
def _k_scale_min(w, o, s):  # type: ignore[no-untyped-def]
    # as .blocks: Q4_K/Q5_K's eight 6-bit scales and mins packed in 12 bytes
    if s < 4:
        return w[o + s] & 63, w[o + 4 + s] & 63
    sc = (w[o + 8 + s - 4] & 15) | ((w[o + s - 4] >> 2) & 48)
    mn = (w[o + 8 + s - 4] >> 4) | ((w[o + s] >> 2) & 48)
    return sc, mn


@njit(cache=True)
def _q4_k(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    sc, mn = _k_scale_min(w, o + 4, s)
    p = dot4(band(bshr(bload(w, o + 16 + 32 * (s // 2)), 4 * (s % 2)), 15), q, 32 * b)
    m = -half(w, o + 2) * np.float32(mn) * fload(q, 2 * n + 16 * b + 4)
    return p, half(w, o) * np.float32(sc) * fload(q, 2 * n + 16 * b), m


@njit(cache=True)
def _q5_k(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    sc, mn = _k_scale_min(w, o + 4, s)
    low = band(bshr(bload(w, o + 48 + 32 * (s // 2)), 4 * (s % 2)), 15)
    p = dot4(bor(low, bshl(band(bshr(bload(w, o + 16), s), 1), 4)), q, 32 * b)
    m = -half(w, o + 2) * np.float32(mn) * fload(q, 2 * n + 16 * b + 4)
    return p, half(w, o) * np.float32(sc) * fload(q, 2 * n + 16 * b), m


@njit(cache=True)
def _q6_k(w, o, s, q, n, b):  # type: ignore[no-untyped-def]
    h, m = s // 4, s % 4
    low = band(bshr(bload(w, o + 64 * h + 32 * (m % 2)), 4 * (m // 2)), 15)
    u = bor(low, bshl(band(bshr(bload(w, o + 128 + 32 * h), 2 * m), 3), 4))
    p = ivsub(dot4(u, q, 32 * b), ishl(iload(q, n + 32 * b), 5))
    scales = lanes2(np.int8(w[o + 192 + 2 * s]), np.int8(w[o + 193 + 2 * s]))
    return imul(p, scales), half(w, o + 208) * fload(q, 2 * n + 16 * b), np.float32(0.0)


@njit(cache=True)
def _qchunk(fmt, w, base, c, q, n, b):  # type: ignore[no-untyped-def]
    # chunk c of the row at byte base of w (flat) against activation block b
    if fmt == 3:
        return _q4_0(w, base + 18 * c, 0, q, n, b)
    if fmt == 4:
        return _q4_1(w, base + 20 * c, 0, q, n, b)
    if fmt == 5:
        return _q5_0(w, base + 22 * c, 0, q, n, b)
    if fmt == 6:
        return _q5_1(w, base + 24 * c, 0, q, n, b)
    if fmt == 7:
        return _q8_0(w, base + 34 * c, 0, q, n, b)
    if fmt == 8:
        return _q2_k(w, base + 84 * (c // 8), c % 8, q, n, b)
    if fmt == 9:
        return _q3_k(w, base + 110 * (c // 8), c % 8, q, n, b)
    if fmt == 10:
        return _q4_k(w, base + 144 * (c // 8), c % 8, q, n, b)
    if fmt == 11:
        return _q5_k(w, base + 176 * (c // 8), c % 8, q, n, b)
    return _q6_k(w, base + 210 * (c // 8), c % 8, q, n, b)


@njit(cache=True)
def _one(fmt, w, base, q, n, first, nb):  # type: ignore[no-untyped-def]
    # the row at byte base of w . activation blocks first .. first + nb - 1; two
    # accumulators so that consecutive chunks' FMAs do not wait on each other
    a0, a1 = vzero(), vzero()
    t0, t1 = np.float32(0.0), np.float32(0.0)
    c = 0
    while c + 2 <= nb:
        b = first + c
        p0, d0, m0 = _qchunk(fmt, w, base, c, q, n, b)
        p1, d1, m1 = _qchunk(fmt, w, base, c + 1, q, n, b + 1)
        a0 = vfma(tofloat(p0), vsplat(d0), a0)
        a1 = vfma(tofloat(p1), vsplat(d1), a1)
        t0 += m0
        t1 += m1
        c += 2
    if c < nb:
        b = first + c
        p0, d0, m0 = _qchunk(fmt, w, base, c, q, n, b)
        a0 = vfma(tofloat(p0), vsplat(d0), a0)
        t0 += m0
    return vsum(a0) + vsum(a1) + (t0 + t1)


@njit(cache=True)
def _four(fmt, w, base, q, n, f0, f1, f2, f3, nb):  # type: ignore[no-untyped-def]
    # the row at byte base of w . four activation rows whose blocks start at f0 .. f3
    # (nb blocks each): the same weight chunk meets the four rows in turn, and LLVM
    # unpacks it once (the four _qchunk calls read the same bytes, no store between)
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    t0, t1, t2, t3 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
    for c in range(nb):
        b0, b1, b2, b3 = f0 + c, f1 + c, f2 + c, f3 + c
        p0, d0, m0 = _qchunk(fmt, w, base, c, q, n, b0)
        p1, d1, m1 = _qchunk(fmt, w, base, c, q, n, b1)
        p2, d2, m2 = _qchunk(fmt, w, base, c, q, n, b2)
        p3, d3, m3 = _qchunk(fmt, w, base, c, q, n, b3)
        a0 = vfma(tofloat(p0), vsplat(d0), a0)
        a1 = vfma(tofloat(p1), vsplat(d1), a1)
        a2 = vfma(tofloat(p2), vsplat(d2), a2)
        a3 = vfma(tofloat(p3), vsplat(d3), a3)
        t0, t1, t2, t3 = t0 + m0, t1 + m1, t2 + m2, t3 + m3
    return vsum(a0) + t0, vsum(a1) + t1, vsum(a2) + t2, vsum(a3) + t3


@njit(cache=True)
def _rows(fmt, raw, q, out, lo, hi, col):  # type: ignore[no-untyped-def]
    # rows lo .. hi - 1 of one part into columns col + lo .. of out; q: quantize's
    # buffer. One activation row alone, else four at a time (a weight row stays in L1
    # while it meets them all).
    k, n = out.shape[0], q.shape[0] * 2 // 5
    nb = n // 32 // k
    w, size = raw.reshape(-1), raw.shape[1]
    for o in range(lo, hi):
        base = o * size
        if base + PREFETCH_BYTES < w.shape[0]:  # the row PREFETCH_BYTES ahead
            for line in range(0, size, 64):
                prefetch(w, base + PREFETCH_BYTES + line)
        for r in range(0, k, 4):  # 2 or 3 rows left: a tile with the last row repeated
            if r == k - 1:
                out[r, col + o] = _one(fmt, w, base, q, n, r * nb, nb)
                break
            r1, r2, r3 = min(r + 1, k - 1), min(r + 2, k - 1), min(r + 3, k - 1)
            s0, s1, s2, s3 = _four(fmt, w, base, q, n, r * nb, r1 * nb, r2 * nb, r3 * nb, nb)
            out[r, col + o], out[r1, col + o] = s0, s1
            out[r2, col + o], out[r3, col + o] = s2, s3


@njit(cache=True)
def quantized(x):  # type: ignore[no-untyped-def]
    """:func:`quantize`'s buffer for ``x`` (flat float32), new."""
    q = np.empty(buffer_bytes(x.shape[0]), np.uint8)
    quantize(x, q)
    return q


def _serial_product(fa: int, fb: int, fc: int) -> Any:
    @njit(cache=True)
    def product(a, b, c, x, out):  # type: ignore[no-untyped-def]
        q = quantized(x)  # here, not a call of its own: a numba call costs microseconds
        ends = (a.shape[0], a.shape[0] + b.shape[0])  # int64, not literal: one _rows each
        _rows(fa, a, q, out, 0, a.shape[0], ends[0] - ends[0])
        _rows(fb, b, q, out, 0, b.shape[0], ends[0])
        _rows(fc, c, q, out, 0, c.shape[0], ends[1])

    return product


def _chunk_product(fa: int, fb: int, fc: int) -> Any:
    @cfunc(types.void(types.int64, types.int64, types.int64), cache=True)
    def chunk(st_addr, who, ch):  # type: ignore[no-untyped-def]
        # as .kernels' chunks; the posted "x" is quantize's buffer, no scratch used
        st = carray(ptr_i64(st_addr), (_WORDS,))
        na, nb, nc, k, rows = st[_NA], st[_NB], st[_NC], st[_K], st[_ROWS]
        q = carray(ptr_u8(st[_X]), (k * st[_N_IN],))
        out = carray(ptr_f32(st[_OUT]), (k, st[_N_OUT]))
        ca, cb = st[_CA], st[_CB]
        if ch < ca:
            a = carray(ptr_u8(st[_A]), (na, st[_RBA]))
            lo = ch * rows
            _rows(fa, a, q, out, lo, min(na, lo + rows), na - na)
        elif ch < ca + cb:
            b = carray(ptr_u8(st[_B]), (nb, st[_RBB]))
            lo = (ch - ca) * rows
            _rows(fb, b, q, out, lo, min(nb, lo + rows), na)
        else:
            c = carray(ptr_u8(st[_C]), (nc, st[_RBC]))
            lo = (ch - ca - cb) * rows
            _rows(fc, c, q, out, lo, min(nc, lo + rows), na + nb)

    return chunk


@functools.cache
def product_kernel(fa: int, fb: int, fc: int) -> Any:
    """``product(a, b, c, x, out)`` as :func:`.kernels.product_kernel`, with ``x``
    quantized first: ``out[r, o] ~ x[r] . row o``, in the calling thread. The formats
    must be in :data:`.q8.Q8_FORMATS`."""
    return _serial_product(fa, fb, fc)


@functools.cache
def chunk_kernel(fa: int, fb: int, fc: int) -> int:
    """The address of the pool's ``chunk(st, who, ch)`` for this product (as
    :func:`.kernels.chunk_kernel`), posted with :func:`quantized`'s buffer as ``x``."""
    return int(_chunk_product(fa, fb, fc).address)
