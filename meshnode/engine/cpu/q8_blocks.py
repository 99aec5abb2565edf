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
Q3_K, Q6_K, MXFP4 as its value + 16) keeps ``z`` out of the bytes: the kernels add
``-(sum of the activation quants) << log2(z)`` to the integer dot product
(:func:`offset_area` says which shift): the one-row kernel as ``z`` bytes dotted with the
activation block, the multi-row one from the sums of each half that
:func:`.q8_quant.quantize` keeps.

Which unpacker, offset, minimum and scales a format has is its row's ``q8``
(:data:`.formats.FORMATS`); the constants below are derived from the rows. An unpacker
lives here or in its format's own module (MXFP4's in :mod:`.fp4`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba.core.errors import TypingError
from numba.extending import overload

from meshnode.engine.cpu.blocks import decoder, format_row, literal_format
from meshnode.engine.cpu.formats import FORMATS, Q8
from meshnode.engine.cpu.simd import INNER, inner
from meshnode.engine.cpu.simd_int import band, bits32, bload, bor, bshl, bshr, bxor, half, nibbles

__all__ = [
    "OFFSET_SHIFTS",
    "SIGNED_BYTES",
    "block_bytes",
    "chunk",
    "e8m0_head",
    "f16_head",
    "minimum_kind",
    "offset_area",
    "per16",
    "signed_bytes",
]

# Every table below is derived from the rows of .formats.FORMATS (their .q8), by kernel id.
_Q8_ROWS = {f.kernel_id: f.q8 for f in FORMATS.values() if f.q8 is not None}
# The shifts of the offsets z (offset areas 0, 1, ...), smallest first: z = 4 (Q3_K),
# 8 (Q4_0), 16 (Q5_0), 32 (Q6_K), 128 (Q8_0).
OFFSET_SHIFTS = tuple(sorted({q.offset.bit_length() - 1 for q in _Q8_ROWS.values() if q.offset}))


def _constant(name: str, table: dict[int, int | bool], doc: str) -> Any:
    """A function of a format that compiled code calls with a compile-time constant
    format (:func:`.blocks.literal_format`): the call is the constant ``table[fmt]``
    (an int or a bool), so the branches on it fold away while compiling."""

    def stub(fmt: int) -> Any:
        raise TypeError(f"{name} is for compiled code")

    stub.__name__ = stub.__qualname__ = name
    stub.__doc__ = doc

    @overload(stub, prefer_literal=True, jit_options=INNER)
    def _typed(fmt):  # type: ignore[no-untyped-def]
        value = table[literal_format(fmt)]
        impl = (lambda fmt: value) if isinstance(value, bool) else (lambda fmt: np.int64(value))
        # each function's own name: one qualified name for every table's constants could
        # be one symbol in two processes (.variants)
        impl.__name__ = impl.__qualname__ = f"{name}_of"
        return impl

    return stub


def _area(q: Q8) -> int:
    return OFFSET_SHIFTS.index(q.offset.bit_length() - 1) if q.offset else -1


offset_area = _constant(
    "offset_area",
    {f: _area(q) for f, q in _Q8_ROWS.items()},
    "The offset area (index into :data:`OFFSET_SHIFTS`) of format ``fmt``, or -1.",
)
minimum_kind = _constant(
    "minimum_kind",
    {f: q.minimum for f, q in _Q8_ROWS.items()},
    "0: no minimum; 1: one per 32-value chunk; 2: one per 16 values (Q2_K).",
)
block_bytes = _constant(
    "block_bytes",
    {f.kernel_id: f.type_size for f in FORMATS.values() if f.q8 is not None},
    "Bytes of a block of format ``fmt`` (Q4_0 .. Q8_0: 32 values; K-quants: 256).",
)
per16 = _constant(
    "per16",
    {f: q.per16 for f, q in _Q8_ROWS.items()},
    "Whether format ``fmt`` has an integer scale per 16 values (Q2_K, Q3_K, Q6_K).",
)
f16_head = _constant(
    "f16_head",
    {f: q.f16_head for f, q in _Q8_ROWS.items()},
    "Whether each chunk of format ``fmt`` is a block led by its float16 scale (and "
    "minimum): Q4_0 .. Q8_0.",
)
# Q8_0's bytes: int8 weights plus 128, the only unpacked bytes above 128 (by kernel id;
# the prefill tiles' dot product reads it while typing, .simd_tile)
SIGNED_BYTES: dict[int, int | bool] = {f: q.offset == 128 for f, q in _Q8_ROWS.items()}
signed_bytes = _constant(
    "signed_bytes",
    SIGNED_BYTES,
    "Whether format ``fmt``'s bytes ``u`` are int8 weights plus 128 (Q8_0): the only "
    "``u`` above 128, which :func:`.simd_int.dot4s` cannot take.",
)
e8m0_head = _constant(
    "e8m0_head",
    {f: q.e8m0_head for f, q in _Q8_ROWS.items()},
    "Whether each chunk of format ``fmt`` is a block led by its E8M0 scale byte: MXFP4.",
)


@inner
def _q3_k_scale(w, o, i):  # type: ignore[no-untyped-def]
    # as .blocks: six-bit scales, low four bits in scales[0:8], high two in scales[8:12]
    lo = (w[o + i % 8] >> (4 * (i // 8))) & 15
    hi = (w[o + 8 + i % 4] >> (2 * (i // 4))) & 3
    return np.int32(np.int32(lo | (hi << 4)) - 32)


@inner
def _k_scale_min(w, o, s):  # type: ignore[no-untyped-def]
    # as .blocks: Q4_K/Q5_K's eight 6-bit scales and mins packed in 12 bytes
    if s < 4:
        return w[o + s] & 63, w[o + 4 + s] & 63
    sc = (w[o + 8 + s - 4] & 15) | ((w[o + s - 4] >> 2) & 48)
    mn = (w[o + 8 + s - 4] >> 4) | ((w[o + s] >> 2) & 48)
    return sc, mn


# -- one decoder per format (the chunk at byte base of w, chunk c), each compiled only
# into the kernels of its format (:func:`chunk`); Q4_0 .. Q8_0: one block per chunk


def _q4_0(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, z, one = base + 18 * c, np.float32(0.0), np.int32(1)
    return nibbles(w, o + 2), half(w, o), z, z, one, one


def _q4_1(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, z, one = base + 20 * c, np.float32(0.0), np.int32(1)
    return nibbles(w, o + 4), half(w, o), half(w, o + 2), z, one, one


def _q5_0(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, z, one = base + 22 * c, np.float32(0.0), np.int32(1)
    return bor(nibbles(w, o + 6), bshl(bits32(w, o + 2), 4)), half(w, o), z, z, one, one


def _q5_1(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, z, one = base + 24 * c, np.float32(0.0), np.int32(1)
    u = bor(nibbles(w, o + 8), bshl(bits32(w, o + 4), 4))
    return u, half(w, o), half(w, o + 2), z, one, one


def _q8_0(fmt, w, base, c):  # type: ignore[no-untyped-def]
    # int8 weights as unsigned bytes w + 128
    o, z, one = base + 34 * c, np.float32(0.0), np.int32(1)
    return bxor(bload(w, o + 2), 128), half(w, o), z, z, one, one


# K-quants: sub-block s = c % 8 of the super-block at byte o


def _q2_k(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, s = base + 84 * (c // 8), c % 8
    u = band(bshr(bload(w, o + 16 + 32 * (s // 4)), 2 * (s % 4)), 3)
    sa, sb = w[o + 2 * s], w[o + 2 * s + 1]
    dmin = -half(w, o + 82)
    ma, mb = dmin * np.float32(sa >> 4), dmin * np.float32(sb >> 4)
    return u, half(w, o + 80), ma, mb, np.int32(sa & 15), np.int32(sb & 15)


def _q3_k(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, s, z = base + 110 * (c // 8), c % 8, np.float32(0.0)
    low = band(bshr(bload(w, o + 32 + 32 * (s // 4)), 2 * (s % 4)), 3)
    u = bor(low, bshl(band(bshr(bload(w, o), s), 1), 2))
    sa, sb = _q3_k_scale(w, o + 96, 2 * s), _q3_k_scale(w, o + 96, 2 * s + 1)
    return u, half(w, o + 108), z, z, sa, sb


def _q4_k(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, s, z = base + 144 * (c // 8), c % 8, np.float32(0.0)
    sc, mn = _k_scale_min(w, o + 4, s)
    dw, m, one = half(w, o) * np.float32(sc), -half(w, o + 2) * np.float32(mn), np.int32(1)
    return band(bshr(bload(w, o + 16 + 32 * (s // 2)), 4 * (s % 2)), 15), dw, m, z, one, one


def _q5_k(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, s, z = base + 176 * (c // 8), c % 8, np.float32(0.0)
    sc, mn = _k_scale_min(w, o + 4, s)
    dw, m, one = half(w, o) * np.float32(sc), -half(w, o + 2) * np.float32(mn), np.int32(1)
    low = band(bshr(bload(w, o + 48 + 32 * (s // 2)), 4 * (s % 2)), 15)
    return bor(low, bshl(band(bshr(bload(w, o + 16), s), 1), 4)), dw, m, z, one, one


def _q6_k(fmt, w, base, c):  # type: ignore[no-untyped-def]
    o, s, z = base + 210 * (c // 8), c % 8, np.float32(0.0)
    h, m = s // 4, s % 4
    low = band(bshr(bload(w, o + 64 * h + 32 * (m % 2)), 4 * (m // 2)), 15)
    u = bor(low, bshl(band(bshr(bload(w, o + 128 + 32 * h), 2 * m), 3), 4))
    sa, sb = np.int32(np.int8(w[o + 192 + 2 * s])), np.int32(np.int8(w[o + 193 + 2 * s]))
    return u, half(w, o + 208), z, z, sa, sb


def chunk(fmt: int, w: Any, base: int, c: int) -> Any:
    """Chunk ``c`` of the row at byte ``base`` of ``w`` (flat uint8), format ``fmt`` (a
    kernel id of :data:`.q8.Q8_FORMATS`): ``(u, dw, m, m2, sa, sb)``.

    Compiled code only, ``fmt`` a compile-time constant (:func:`.blocks.literal_format`):
    the call is the format's own unpacker (its row's ``q8.unpack``), so a kernel compiles
    its format's only."""
    raise TypeError("chunk is for compiled code")


@overload(chunk, prefer_literal=True, jit_options=INNER)
def _chunk(fmt, w, base, c):  # type: ignore[no-untyped-def]
    q8 = format_row(fmt).q8
    if q8 is None:
        raise TypingError(f"{format_row(fmt).name} has no 8-bit-activation kernels")
    return decoder(q8.unpack)
