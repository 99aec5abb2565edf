"""One 32-value chunk of a GGUF weight row, unpacked for the 8-bit-activation kernels.

:func:`chunk` reads chunk ``c`` of the row at byte ``base`` of the flat weights ``w`` and
returns ``(u, dw, m, m2, sa, sb)``:

- ``u`` (:data:`.simd_int.U8x32`): the 32 quants as unsigned bytes;
- ``dw``: the chunk's weight scale (float32; Q4_K/Q5_K: ``d`` times the sub-block's
  six-bit scale, in float);
- ``m``, ``m2``: for the formats with a minimum (``s u + m``: Q4_1, Q5_1, Q4_K, Q5_K),
  the chunk's minimum, to meet the sum of the quantized activations; Q2_K's minimums of
  its first and last 16 values (zeros for the formats without);
- ``sa``, ``sb``: the integer scales of the first and last 16 values (Q2_K, Q3_K, Q6_K;
  1 otherwise), applied to the exact integer dot products of each half.

A weight ``s (u - z)`` with an integer offset ``z`` (Q4_0, Q5_0, Q8_0 as ``w + 128``,
Q3_K, Q6_K) keeps ``z`` out of the bytes: the kernels add ``-(sum of the activation
quants) << log2(z)`` to the integer dot product (:func:`offset_area` says which shift):
the one-row kernel as ``z`` bytes dotted with the activation block, the multi-row one
from the sums of each half that :func:`.q8_kernels.quantize` keeps.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from meshnode.engine.cpu.simd_int import band, bits32, bload, bor, bshl, bshr, bxor, half, nibbles

__all__ = ["OFFSET_SHIFTS", "block_bytes", "chunk", "minimum_kind", "offset_area", "per16"]

# The shifts of the offsets (offset areas 0 .. 4): z = 4 (Q3_K), 8 (Q4_0), 16 (Q5_0),
# 32 (Q6_K), 128 (Q8_0).
OFFSET_SHIFTS = (2, 3, 4, 5, 7)


@njit(cache=True)
def offset_area(fmt):  # type: ignore[no-untyped-def]
    """The offset area (index into :data:`OFFSET_SHIFTS`) of format ``fmt``, or -1."""
    if fmt == 9:
        return 0
    if fmt == 3:
        return 1
    if fmt == 5:
        return 2
    if fmt == 12:
        return 3
    if fmt == 7:
        return 4
    return -1


@njit(cache=True)
def minimum_kind(fmt):  # type: ignore[no-untyped-def]
    """0: no minimum; 1: one per 32-value chunk; 2: one per 16 values (Q2_K)."""
    if fmt == 4 or fmt == 6 or fmt == 10 or fmt == 11:
        return 1
    if fmt == 8:
        return 2
    return 0


@njit(cache=True)
def block_bytes(fmt):  # type: ignore[no-untyped-def]
    """Bytes of a block of format ``fmt`` (Q4_0 .. Q8_0: 32 values; K-quants: 256)."""
    if fmt <= 7:
        return (18, 20, 22, 24, 34)[fmt - 3]
    return (84, 110, 144, 176, 210)[fmt - 8]


@njit(cache=True)
def per16(fmt):  # type: ignore[no-untyped-def]
    """Whether format ``fmt`` has an integer scale per 16 values (Q2_K, Q3_K, Q6_K)."""
    return fmt == 8 or fmt == 9 or fmt == 12


@njit(cache=True)
def _q3_k_scale(w, o, i):  # type: ignore[no-untyped-def]
    # as .blocks: six-bit scales, low four bits in scales[0:8], high two in scales[8:12]
    lo = (w[o + i % 8] >> (4 * (i // 8))) & 15
    hi = (w[o + 8 + i % 4] >> (2 * (i // 4))) & 3
    return np.int32(np.int32(lo | (hi << 4)) - 32)


@njit(cache=True)
def _k_scale_min(w, o, s):  # type: ignore[no-untyped-def]
    # as .blocks: Q4_K/Q5_K's eight 6-bit scales and mins packed in 12 bytes
    if s < 4:
        return w[o + s] & 63, w[o + 4 + s] & 63
    sc = (w[o + 8 + s - 4] & 15) | ((w[o + s - 4] >> 2) & 48)
    mn = (w[o + 8 + s - 4] >> 4) | ((w[o + s] >> 2) & 48)
    return sc, mn


@njit(cache=True)
def _simple(fmt, w, o):  # type: ignore[no-untyped-def]
    # Q4_0 .. Q8_0: one block per chunk, at byte o
    z, one = np.float32(0.0), np.int32(1)
    if fmt == 3:
        return nibbles(w, o + 2), half(w, o), z, z, one, one
    if fmt == 4:
        return nibbles(w, o + 4), half(w, o), half(w, o + 2), z, one, one
    if fmt == 5:
        return bor(nibbles(w, o + 6), bshl(bits32(w, o + 2), 4)), half(w, o), z, z, one, one
    if fmt == 6:
        u = bor(nibbles(w, o + 8), bshl(bits32(w, o + 4), 4))
        return u, half(w, o), half(w, o + 2), z, one, one
    # Q8_0: int8 weights as unsigned bytes w + 128
    return bxor(bload(w, o + 2), 128), half(w, o), z, z, one, one


@njit(cache=True)
def _k_quant(fmt, w, o, s):  # type: ignore[no-untyped-def]
    # sub-block s of the super-block at byte o
    z = np.float32(0.0)
    if fmt == 8:  # Q2_K
        u = band(bshr(bload(w, o + 16 + 32 * (s // 4)), 2 * (s % 4)), 3)
        sa, sb = w[o + 2 * s], w[o + 2 * s + 1]
        dmin = -half(w, o + 82)
        ma, mb = dmin * np.float32(sa >> 4), dmin * np.float32(sb >> 4)
        return u, half(w, o + 80), ma, mb, np.int32(sa & 15), np.int32(sb & 15)
    if fmt == 9:  # Q3_K
        low = band(bshr(bload(w, o + 32 + 32 * (s // 4)), 2 * (s % 4)), 3)
        u = bor(low, bshl(band(bshr(bload(w, o), s), 1), 2))
        sa, sb = _q3_k_scale(w, o + 96, 2 * s), _q3_k_scale(w, o + 96, 2 * s + 1)
        return u, half(w, o + 108), z, z, sa, sb
    if fmt == 12:  # Q6_K
        h, m = s // 4, s % 4
        low = band(bshr(bload(w, o + 64 * h + 32 * (m % 2)), 4 * (m // 2)), 15)
        u = bor(low, bshl(band(bshr(bload(w, o + 128 + 32 * h), 2 * m), 3), 4))
        sa, sb = np.int32(np.int8(w[o + 192 + 2 * s])), np.int32(np.int8(w[o + 193 + 2 * s]))
        return u, half(w, o + 208), z, z, sa, sb
    sc, mn = _k_scale_min(w, o + 4, s)
    dw, m, one = half(w, o) * np.float32(sc), -half(w, o + 2) * np.float32(mn), np.int32(1)
    if fmt == 10:  # Q4_K
        return band(bshr(bload(w, o + 16 + 32 * (s // 2)), 4 * (s % 2)), 15), dw, m, z, one, one
    low = band(bshr(bload(w, o + 48 + 32 * (s // 2)), 4 * (s % 2)), 15)  # Q5_K
    return bor(low, bshl(band(bshr(bload(w, o + 16), s), 1), 4)), dw, m, z, one, one


@njit(cache=True)
def chunk(fmt, w, base, c):  # type: ignore[no-untyped-def]
    """Chunk ``c`` of the row at byte ``base`` of ``w`` (flat uint8), format ``fmt`` (a
    kernel id of :data:`.q8.Q8_FORMATS`): ``(u, dw, m, m2, sa, sb)``."""
    if fmt == 3:
        return _simple(fmt, w, base + 18 * c)
    if fmt == 4:
        return _simple(fmt, w, base + 20 * c)
    if fmt == 5:
        return _simple(fmt, w, base + 22 * c)
    if fmt == 6:
        return _simple(fmt, w, base + 24 * c)
    if fmt == 7:
        return _simple(fmt, w, base + 34 * c)
    if fmt == 8:
        return _k_quant(fmt, w, base + 84 * (c // 8), c % 8)
    if fmt == 9:
        return _k_quant(fmt, w, base + 110 * (c // 8), c % 8)
    if fmt == 10:
        return _k_quant(fmt, w, base + 144 * (c // 8), c % 8)
    if fmt == 11:
        return _k_quant(fmt, w, base + 176 * (c // 8), c % 8)
    return _k_quant(fmt, w, base + 210 * (c // 8), c % 8)
