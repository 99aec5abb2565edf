"""Row decoders: one GGUF-format row of blocks to float32, exactly as ``gguf.quants`` does.

Each ``_<format>(row, w)`` decodes the blocks in ``row`` (``uint8``) into ``w``
(``float32``, the row's length in values). Every value is computed with the same float32
operations, in the same order, as ``meshnode_packaging.sources.dequantize`` (that is,
``gguf.quants``'s ``dequantize_blocks``), so a kernel that multiplies what these return
equals "dequantize, then multiply" up to summation order. The scale products involved
(a float16 scale times a small integer) are exact in float32, so the compiler may fuse a
product with the one addition that follows it without changing a value.

These functions are compiled without fast-math flags on purpose: the kernels that call
them (:mod:`.kernels`) allow reassociation for their sums, and LLVM's flags are per
instruction, so the decoding keeps its IEEE meaning after inlining.

Block layouts are GGML's (``ggml-common.h``); ``QK_K`` is 256.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_CACHE = True  # compiled code is cached on disk (NUMBA_CACHE_DIR, see .kernels)


def _half_typer(typingctx: Any, bits: Any) -> tuple[Any, Any]:
    """float16 bits (``uint16``) to float32: an exact widening (F16C ``vcvtph2ps``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


def _bits_typer(typingctx: Any, bits: Any) -> tuple[Any, Any]:
    """The float32 whose bit pattern is ``bits`` (``uint32``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


# numba has no float16 on the CPU and no scalar bit casts: two LLVM instructions do it
_half_bits_to_f32: Any = intrinsic(_half_typer)
_f32_from_bits: Any = intrinsic(_bits_typer)


@njit(cache=_CACHE)
def _f16(row, off):  # type: ignore[no-untyped-def]
    return _half_bits_to_f32(np.uint16(np.uint32(row[off]) | (np.uint32(row[off + 1]) << 8)))


@njit(cache=_CACHE)
def _f32(row, w):  # type: ignore[no-untyped-def]
    for j in range(w.shape[0]):
        o = 4 * j
        bits = (
            np.uint32(row[o])
            | (np.uint32(row[o + 1]) << 8)
            | (np.uint32(row[o + 2]) << 16)
            | (np.uint32(row[o + 3]) << 24)
        )
        w[j] = _f32_from_bits(bits)


@njit(cache=_CACHE)
def _f16_row(row, w):  # type: ignore[no-untyped-def]
    for j in range(w.shape[0]):
        w[j] = _f16(row, 2 * j)


@njit(cache=_CACHE)
def _bf16(row, w):  # type: ignore[no-untyped-def]
    # bfloat16 is the top half of a float32
    for j in range(w.shape[0]):
        bits = (np.uint32(row[2 * j]) << 16) | (np.uint32(row[2 * j + 1]) << 24)
        w[j] = _f32_from_bits(bits)


@njit(cache=_CACHE)
def _q4_0(row, w):  # type: ignore[no-untyped-def]
    # block: d f16 | qs[16]; value j < 16 is the low nibble of qs[j], j >= 16 the high one
    for b in range(w.shape[0] // 32):
        o, x = 18 * b, 32 * b
        d = _f16(row, o)
        for j in range(16):
            q = row[o + 2 + j]
            w[x + j] = d * np.float32(np.int32(q & 15) - 8)
            w[x + 16 + j] = d * np.float32(np.int32(q >> 4) - 8)


@njit(cache=_CACHE)
def _q4_1(row, w):  # type: ignore[no-untyped-def]
    # block: d f16 | m f16 | qs[16]
    for b in range(w.shape[0] // 32):
        o, x = 20 * b, 32 * b
        d = _f16(row, o)
        m = _f16(row, o + 2)
        for j in range(16):
            q = row[o + 4 + j]
            w[x + j] = d * np.float32(q & 15) + m
            w[x + 16 + j] = d * np.float32(q >> 4) + m


@njit(cache=_CACHE)
def _qh_bits(row, o):  # type: ignore[no-untyped-def]
    return (
        np.uint32(row[o])
        | (np.uint32(row[o + 1]) << 8)
        | (np.uint32(row[o + 2]) << 16)
        | (np.uint32(row[o + 3]) << 24)
    )


@njit(cache=_CACHE)
def _q5_0(row, w):  # type: ignore[no-untyped-def]
    # block: d f16 | qh u32 (bit j: fifth bit of value j) | qs[16]
    for b in range(w.shape[0] // 32):
        o, x = 22 * b, 32 * b
        d = _f16(row, o)
        qh = _qh_bits(row, o + 2)
        for j in range(16):
            q = np.uint32(row[o + 6 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            w[x + j] = d * np.float32(np.int32(lo) - 16)
            w[x + 16 + j] = d * np.float32(np.int32(hi) - 16)


@njit(cache=_CACHE)
def _q5_1(row, w):  # type: ignore[no-untyped-def]
    # block: d f16 | m f16 | qh u32 | qs[16]
    for b in range(w.shape[0] // 32):
        o, x = 24 * b, 32 * b
        d = _f16(row, o)
        m = _f16(row, o + 2)
        qh = _qh_bits(row, o + 4)
        for j in range(16):
            q = np.uint32(row[o + 8 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            w[x + j] = d * np.float32(lo) + m
            w[x + 16 + j] = d * np.float32(hi) + m


@njit(cache=_CACHE)
def _q8_0(row, w):  # type: ignore[no-untyped-def]
    # block: d f16 | qs int8[32]
    for b in range(w.shape[0] // 32):
        o, x = 34 * b, 32 * b
        d = _f16(row, o)
        for j in range(32):
            w[x + j] = np.float32(np.int8(row[o + 2 + j])) * d


@njit(cache=_CACHE)
def _q2_k(row, w):  # type: ignore[no-untyped-def]
    # block: scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16;
    # value e = 128 h + 32 s + l is bits 2s..2s+1 of qs[32 h + l], in sub-block e // 16
    for b in range(w.shape[0] // 256):
        o, x = 84 * b, 256 * b
        d = _f16(row, o + 80)
        dmin = _f16(row, o + 82)
        for e in range(256):
            h, s, lane = e // 128, (e // 32) % 4, e % 32
            sc = row[o + e // 16]
            dl = d * np.float32(sc & 15)
            ml = dmin * np.float32(sc >> 4)
            q = (row[o + 16 + 32 * h + lane] >> (2 * s)) & 3
            w[x + e] = dl * np.float32(q) - ml


@njit(cache=_CACHE)
def _q3_k_scale(row, o, i):  # type: ignore[no-untyped-def]
    # 16 six-bit scales: low four bits in scales[0:8] (nibbles), high two in scales[8:12]
    lo = (row[o + i % 8] >> (4 * (i // 8))) & 15
    hi = (row[o + 8 + i % 4] >> (2 * (i // 4))) & 3
    return np.int32(lo | (hi << 4)) - 32


@njit(cache=_CACHE)
def _q3_k(row, w):  # type: ignore[no-untyped-def]
    # block: hmask[32] | qs[64] | scales[12] | d f16; value e = 128 h + 32 s + l has its low
    # bits at 2s of qs[32 h + l] and its high bit at bit e // 32 of hmask[l] (set: no offset)
    for b in range(w.shape[0] // 256):
        o, x = 110 * b, 256 * b
        d = _f16(row, o + 108)
        for e in range(256):
            h, s, lane = e // 128, (e // 32) % 4, e % 32
            dl = d * np.float32(_q3_k_scale(row, o + 96, e // 16))
            low = np.int32((row[o + 32 + 32 * h + lane] >> (2 * s)) & 3)
            high = np.int32(((row[o + lane] >> (e // 32)) & 1) ^ 1)
            w[x + e] = dl * np.float32(low - (high << 2))


@njit(cache=_CACHE)
def _k_scale_min(row, o, s):  # type: ignore[no-untyped-def]
    # Q4_K/Q5_K: eight 6-bit scales and mins packed in 12 bytes (gguf Q4_K.get_scale_min)
    if s < 4:
        return row[o + s] & 63, row[o + 4 + s] & 63
    sc = (row[o + 8 + s - 4] & 15) | ((row[o + s - 4] >> 2) & 48)
    mn = (row[o + 8 + s - 4] >> 4) | ((row[o + s] >> 2) & 48)
    return sc, mn


@njit(cache=_CACHE)
def _q4_k(row, w):  # type: ignore[no-untyped-def]
    # block: d f16 | dmin f16 | scales[12] | qs[128]; sub-block s = 2 c + n is nibble n of
    # qs[32 c .. 32 c + 31]
    for b in range(w.shape[0] // 256):
        o, x = 144 * b, 256 * b
        d = _f16(row, o)
        dmin = _f16(row, o + 2)
        for s in range(8):
            sc, mn = _k_scale_min(row, o + 4, s)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(mn)
            c, shift = s // 2, 4 * (s % 2)
            for lane in range(32):
                q = (row[o + 16 + 32 * c + lane] >> shift) & 15
                w[x + 32 * s + lane] = ds * np.float32(q) - dm


@njit(cache=_CACHE)
def _q5_k(row, w):  # type: ignore[no-untyped-def]
    # block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; the fifth bit of sub-block s
    # is bit s of qh[lane]
    for b in range(w.shape[0] // 256):
        o, x = 176 * b, 256 * b
        d = _f16(row, o)
        dmin = _f16(row, o + 2)
        for s in range(8):
            sc, mn = _k_scale_min(row, o + 4, s)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(mn)
            c, shift = s // 2, 4 * (s % 2)
            for lane in range(32):
                q = ((row[o + 48 + 32 * c + lane] >> shift) & 15) | (
                    ((row[o + 16 + lane] >> s) & 1) << 4
                )
                w[x + 32 * s + lane] = ds * np.float32(q) - dm


@njit(cache=_CACHE)
def _q6_k(row, w):  # type: ignore[no-untyped-def]
    # block: ql[128] | qh[64] | scales int8[16] | d f16; value e = 128 h + 64 n + l (l < 64)
    # has low bits nibble n of ql[64 h + l] and high bits 2 ((e % 128) // 32) of
    # qh[32 h + e % 32]; its scale is d * scales[e // 16]
    for b in range(w.shape[0] // 256):
        o, x = 210 * b, 256 * b
        d = _f16(row, o + 208)
        for g in range(16):
            ds = d * np.float32(np.int8(row[o + 192 + g]))
            for i in range(16):
                e = 16 * g + i
                h, rest = e // 128, e % 128
                low = (row[o + 64 * h + rest % 64] >> (4 * (rest // 64))) & 15
                high = (row[o + 128 + 32 * h + rest % 32] >> (2 * (rest // 32))) & 3
                q = np.int32(low | (high << 4)) - 32
                w[x + e] = ds * np.float32(q)


@njit(cache=_CACHE)
def decode_row(fmt, row, w):  # type: ignore[no-untyped-def]
    """Decode ``row`` of format ``fmt`` (a :data:`.formats.FORMATS` kernel id) into ``w``."""
    if fmt == 0:
        _f32(row, w)
    elif fmt == 1:
        _f16_row(row, w)
    elif fmt == 2:
        _bf16(row, w)
    elif fmt == 3:
        _q4_0(row, w)
    elif fmt == 4:
        _q4_1(row, w)
    elif fmt == 5:
        _q5_0(row, w)
    elif fmt == 6:
        _q5_1(row, w)
    elif fmt == 7:
        _q8_0(row, w)
    elif fmt == 8:
        _q2_k(row, w)
    elif fmt == 9:
        _q3_k(row, w)
    elif fmt == 10:
        _q4_k(row, w)
    elif fmt == 11:
        _q5_k(row, w)
    else:
        _q6_k(row, w)
