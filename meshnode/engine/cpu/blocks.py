"""Block decoders: 32 values of a GGUF row as four float32 vectors, exactly as gguf does.

``chunk(fmt, row, c)`` returns values ``32 c .. 32 c + 31`` of ``row`` (the row's bytes,
``uint8``) as four :data:`.simd.F32x8` vectors. For the 32-value formats a chunk is one
block; for the K-quants (256-value super-blocks) it is one 32-value sub-block, whose scale
and minimum come from its super-block's header.

Every value is computed with the same float32 operations, in the same order, as
``meshnode_packaging.sources.dequantize`` (gguf's ``dequantize_blocks``), so a product of
what these return equals "dequantize, then multiply" up to summation order, and a decoded
row is bit-identical to ``dequantize``'s. Where gguf computes ``scale * q + min``, the
product of a float16 scale and a small integer is exact in float32, so ``vfma`` (which
may fuse it with the addition) rounds once, as gguf's two operations do.

Block layouts are GGML's (``ggml-common.h``); ``QK_K`` is 256. The numbers the kernels
dispatch on are :data:`.formats.FORMATS`' kernel ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types

from meshnode.engine.cpu.simd import (
    bits8,
    iand,
    intrinsic,
    ior,
    ishl,
    ishr,
    isub,
    load_bf16,
    load_f16,
    load_f32,
    load_i8,
    load_u8,
    tofloat,
    vfma,
    vmul,
    vneg,
    vsplat,
)

_CACHE = True  # compiled code is cached on disk (NUMBA_CACHE_DIR, see .matrix)


def _half_typer(typingctx: Any, bits: Any) -> tuple[Any, Any]:
    """float16 bits (``uint16``) to float32: an exact widening (F16C ``vcvtph2ps``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


# numba has no float16 on the CPU and no scalar bit casts: two LLVM instructions do it
_half_bits_to_f32: Any = intrinsic(_half_typer)


@njit(cache=_CACHE)
def f16(row, off):  # type: ignore[no-untyped-def]
    """The float16 at byte ``off`` of ``row``, as float32."""
    return _half_bits_to_f32(np.uint16(np.uint32(row[off]) | (np.uint32(row[off + 1]) << 8)))


@njit(cache=_CACHE)
def u32(row, off):  # type: ignore[no-untyped-def]
    return (
        np.uint32(row[off])
        | (np.uint32(row[off + 1]) << 8)
        | (np.uint32(row[off + 2]) << 16)
        | (np.uint32(row[off + 3]) << 24)
    )


# -- plain floats ------------------------------------------------------------------------


@njit(cache=_CACHE)
def _f32(row, c):  # type: ignore[no-untyped-def]
    o = 128 * c
    return load_f32(row, o), load_f32(row, o + 32), load_f32(row, o + 64), load_f32(row, o + 96)


@njit(cache=_CACHE)
def _f16(row, c):  # type: ignore[no-untyped-def]
    o = 64 * c
    return load_f16(row, o), load_f16(row, o + 16), load_f16(row, o + 32), load_f16(row, o + 48)


@njit(cache=_CACHE)
def _bf16(row, c):  # type: ignore[no-untyped-def]
    o = 64 * c
    return (
        load_bf16(row, o),
        load_bf16(row, o + 16),
        load_bf16(row, o + 32),
        load_bf16(row, o + 48),
    )


# -- 32-value blocks: values j < 16 are the low nibbles of qs[j], j >= 16 the high ones ---


@njit(cache=_CACHE)
def _q4_0(row, c):  # type: ignore[no-untyped-def]
    # block: d f16 | qs[16]; value = d * (nibble - 8)
    o = 18 * c
    d = vsplat(f16(row, o))
    q0, q1 = load_u8(row, o + 2), load_u8(row, o + 10)
    return (
        vmul(d, tofloat(isub(iand(q0, 15), 8))),
        vmul(d, tofloat(isub(iand(q1, 15), 8))),
        vmul(d, tofloat(isub(ishr(q0, 4), 8))),
        vmul(d, tofloat(isub(ishr(q1, 4), 8))),
    )


@njit(cache=_CACHE)
def _q4_1(row, c):  # type: ignore[no-untyped-def]
    # block: d f16 | m f16 | qs[16]; value = d * nibble + m
    o = 20 * c
    d, m = vsplat(f16(row, o)), vsplat(f16(row, o + 2))
    q0, q1 = load_u8(row, o + 4), load_u8(row, o + 12)
    return (
        vfma(d, tofloat(iand(q0, 15)), m),
        vfma(d, tofloat(iand(q1, 15)), m),
        vfma(d, tofloat(ishr(q0, 4)), m),
        vfma(d, tofloat(ishr(q1, 4)), m),
    )


@njit(cache=_CACHE)
def _q5_quants(row, qh_at, qs_at):  # type: ignore[no-untyped-def]
    # Q5_0/Q5_1: bit j of the u32 qh is the fifth bit of value j
    qh = u32(row, qh_at)
    q0, q1 = load_u8(row, qs_at), load_u8(row, qs_at + 8)
    return (
        ior(iand(q0, 15), ishl(bits8(qh, 0), 4)),
        ior(iand(q1, 15), ishl(bits8(qh, 8), 4)),
        ior(ishr(q0, 4), ishl(bits8(qh, 16), 4)),
        ior(ishr(q1, 4), ishl(bits8(qh, 24), 4)),
    )


@njit(cache=_CACHE)
def _q5_0(row, c):  # type: ignore[no-untyped-def]
    # block: d f16 | qh u32 | qs[16]; value = d * (q - 16)
    o = 22 * c
    d = vsplat(f16(row, o))
    a, b, e, f = _q5_quants(row, o + 2, o + 6)
    return (
        vmul(d, tofloat(isub(a, 16))),
        vmul(d, tofloat(isub(b, 16))),
        vmul(d, tofloat(isub(e, 16))),
        vmul(d, tofloat(isub(f, 16))),
    )


@njit(cache=_CACHE)
def _q5_1(row, c):  # type: ignore[no-untyped-def]
    # block: d f16 | m f16 | qh u32 | qs[16]; value = d * q + m
    o = 24 * c
    d, m = vsplat(f16(row, o)), vsplat(f16(row, o + 2))
    a, b, e, f = _q5_quants(row, o + 4, o + 8)
    return (
        vfma(d, tofloat(a), m),
        vfma(d, tofloat(b), m),
        vfma(d, tofloat(e), m),
        vfma(d, tofloat(f), m),
    )


@njit(cache=_CACHE)
def _q8_0(row, c):  # type: ignore[no-untyped-def]
    # block: d f16 | qs int8[32]; value = q * d
    o = 34 * c
    d = vsplat(f16(row, o))
    return (
        vmul(tofloat(load_i8(row, o + 2)), d),
        vmul(tofloat(load_i8(row, o + 10)), d),
        vmul(tofloat(load_i8(row, o + 18)), d),
        vmul(tofloat(load_i8(row, o + 26)), d),
    )


# -- K-quants: chunk c is sub-block s = c % 8 of super-block c // 8 ----------------------


@njit(cache=_CACHE)
def _q2_k(row, c):  # type: ignore[no-untyped-def]
    # block: scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16;
    # value 32 s + l is bits 2 (s % 4) of qs[32 (s // 4) + l], with scale byte (32 s + l) // 16
    o, s = 84 * (c // 8), c % 8
    d, dmin = f16(row, o + 80), f16(row, o + 82)
    qs, shift = o + 16 + 32 * (s // 4), 2 * (s % 4)
    sa, sb = row[o + 2 * s], row[o + 2 * s + 1]
    dla, mla = vsplat(d * np.float32(sa & 15)), vneg(vsplat(dmin * np.float32(sa >> 4)))
    dlb, mlb = vsplat(d * np.float32(sb & 15)), vneg(vsplat(dmin * np.float32(sb >> 4)))
    return (
        vfma(dla, tofloat(iand(ishr(load_u8(row, qs), shift), 3)), mla),
        vfma(dla, tofloat(iand(ishr(load_u8(row, qs + 8), shift), 3)), mla),
        vfma(dlb, tofloat(iand(ishr(load_u8(row, qs + 16), shift), 3)), mlb),
        vfma(dlb, tofloat(iand(ishr(load_u8(row, qs + 24), shift), 3)), mlb),
    )


@njit(cache=_CACHE)
def _q3_k_scale(row, o, i):  # type: ignore[no-untyped-def]
    # 16 six-bit scales: low four bits in scales[0:8] (nibbles), high two in scales[8:12]
    lo = (row[o + i % 8] >> (4 * (i // 8))) & 15
    hi = (row[o + 8 + i % 4] >> (2 * (i // 4))) & 3
    return np.int32(lo | (hi << 4)) - 32


@njit(cache=_CACHE)
def _q3_k_q(row, qs, hm, shift, s):  # type: ignore[no-untyped-def]
    # gguf: low - 4 * (1 - hbit), with the low two bits at ``shift`` of qs[l] and hbit bit
    # s of hmask[l]; as one expression, (low | hbit << 2) - 4
    low = iand(ishr(load_u8(row, qs), shift), 3)
    hbit = iand(ishr(load_u8(row, hm), s), 1)
    return tofloat(isub(ior(low, ishl(hbit, 2)), 4))


@njit(cache=_CACHE)
def _q3_k(row, c):  # type: ignore[no-untyped-def]
    # block: hmask[32] | qs[64] | scales[12] | d f16; value 32 s + l has its low bits at
    # 2 (s % 4) of qs[32 (s // 4) + l] and its high bit at bit s of hmask[l]
    o, s = 110 * (c // 8), c % 8
    d = f16(row, o + 108)
    qs, shift = o + 32 + 32 * (s // 4), 2 * (s % 4)
    dla = vsplat(d * np.float32(_q3_k_scale(row, o + 96, 2 * s)))
    dlb = vsplat(d * np.float32(_q3_k_scale(row, o + 96, 2 * s + 1)))
    return (
        vmul(dla, _q3_k_q(row, qs, o, shift, s)),
        vmul(dla, _q3_k_q(row, qs + 8, o + 8, shift, s)),
        vmul(dlb, _q3_k_q(row, qs + 16, o + 16, shift, s)),
        vmul(dlb, _q3_k_q(row, qs + 24, o + 24, shift, s)),
    )


@njit(cache=_CACHE)
def k_scale_min(row, o, s):  # type: ignore[no-untyped-def]
    # Q4_K/Q5_K: eight 6-bit scales and mins packed in 12 bytes (gguf Q4_K.get_scale_min)
    if s < 4:
        return row[o + s] & 63, row[o + 4 + s] & 63
    sc = (row[o + 8 + s - 4] & 15) | ((row[o + s - 4] >> 2) & 48)
    mn = (row[o + 8 + s - 4] >> 4) | ((row[o + s] >> 2) & 48)
    return sc, mn


@njit(cache=_CACHE)
def _k_scales(row, o, s):  # type: ignore[no-untyped-def]
    # Q4_K/Q5_K sub-block s of the super-block at o: d * scale and -(dmin * min), splat
    sc, mn = k_scale_min(row, o + 4, s)
    ds = vsplat(f16(row, o) * np.float32(sc))
    return ds, vneg(vsplat(f16(row, o + 2) * np.float32(mn)))


@njit(cache=_CACHE)
def _q4_k(row, c):  # type: ignore[no-untyped-def]
    # block: d f16 | dmin f16 | scales[12] | qs[128]; sub-block s is nibble s % 2 of
    # qs[32 (s // 2) ..]; value = d * scale * q - dmin * min
    o, s = 144 * (c // 8), c % 8
    ds, dm = _k_scales(row, o, s)
    qs, shift = o + 16 + 32 * (s // 2), 4 * (s % 2)
    return (
        vfma(ds, tofloat(iand(ishr(load_u8(row, qs), shift), 15)), dm),
        vfma(ds, tofloat(iand(ishr(load_u8(row, qs + 8), shift), 15)), dm),
        vfma(ds, tofloat(iand(ishr(load_u8(row, qs + 16), shift), 15)), dm),
        vfma(ds, tofloat(iand(ishr(load_u8(row, qs + 24), shift), 15)), dm),
    )


@njit(cache=_CACHE)
def _q5_k_q(row, qs, qh, shift, s):  # type: ignore[no-untyped-def]
    # nibble at ``shift`` of qs[l], fifth bit s of qh[l]
    low = iand(ishr(load_u8(row, qs), shift), 15)
    return tofloat(ior(low, ishl(iand(ishr(load_u8(row, qh), s), 1), 4)))


@njit(cache=_CACHE)
def _q5_k(row, c):  # type: ignore[no-untyped-def]
    # block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    o, s = 176 * (c // 8), c % 8
    ds, dm = _k_scales(row, o, s)
    qs, qh, shift = o + 48 + 32 * (s // 2), o + 16, 4 * (s % 2)
    return (
        vfma(ds, _q5_k_q(row, qs, qh, shift, s), dm),
        vfma(ds, _q5_k_q(row, qs + 8, qh + 8, shift, s), dm),
        vfma(ds, _q5_k_q(row, qs + 16, qh + 16, shift, s), dm),
        vfma(ds, _q5_k_q(row, qs + 24, qh + 24, shift, s), dm),
    )


@njit(cache=_CACHE)
def _q6_k_q(row, ql, qh, n, m):  # type: ignore[no-untyped-def]
    # low nibble n of ql[l'], high two bits 2 m of qh[l], minus 32
    low = iand(ishr(load_u8(row, ql), 4 * n), 15)
    high = iand(ishr(load_u8(row, qh), 2 * m), 3)
    return tofloat(isub(ior(low, ishl(high, 4)), 32))


@njit(cache=_CACHE)
def _q6_k(row, c):  # type: ignore[no-untyped-def]
    # block: ql[128] | qh[64] | scales int8[16] | d f16; value e = 32 s + l has h = s // 4,
    # m = s % 4: low bits nibble m // 2 of ql[64 h + 32 (m % 2) + l], high bits 2 m of
    # qh[32 h + l]; its scale is d * scales[e // 16]
    o, s = 210 * (c // 8), c % 8
    h, m = s // 4, s % 4
    ql, qh, n = o + 64 * h + 32 * (m % 2), o + 128 + 32 * h, m // 2
    d = f16(row, o + 208)
    da = vsplat(d * np.float32(np.int8(row[o + 192 + 2 * s])))
    db = vsplat(d * np.float32(np.int8(row[o + 193 + 2 * s])))
    return (
        vmul(da, _q6_k_q(row, ql, qh, n, m)),
        vmul(da, _q6_k_q(row, ql + 8, qh + 8, n, m)),
        vmul(db, _q6_k_q(row, ql + 16, qh + 16, n, m)),
        vmul(db, _q6_k_q(row, ql + 24, qh + 24, n, m)),
    )


@njit(cache=_CACHE)
def chunk(fmt, row, c):  # type: ignore[no-untyped-def]
    """Values ``32 c .. 32 c + 31`` of ``row`` (format ``fmt``) as four vectors."""
    if fmt == 0:
        return _f32(row, c)
    if fmt == 1:
        return _f16(row, c)
    if fmt == 2:
        return _bf16(row, c)
    if fmt == 3:
        return _q4_0(row, c)
    if fmt == 4:
        return _q4_1(row, c)
    if fmt == 5:
        return _q5_0(row, c)
    if fmt == 6:
        return _q5_1(row, c)
    if fmt == 7:
        return _q8_0(row, c)
    if fmt == 8:
        return _q2_k(row, c)
    if fmt == 9:
        return _q3_k(row, c)
    if fmt == 10:
        return _q4_k(row, c)
    if fmt == 11:
        return _q5_k(row, c)
    return _q6_k(row, c)
