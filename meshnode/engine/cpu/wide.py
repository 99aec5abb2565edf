"""Sixteen-lane block decoders: 32 values of a GGUF row as two :data:`.simd.F32x16` vectors.

``wchunk(fmt, row, c)`` returns values ``32 c .. 32 c + 31`` of ``row`` (the row's bytes,
``uint8``) as two sixteen-lane vectors (one AVX-512 register each, or two AVX2/NEON ones:
LLVM lowers them for the machine). For the 32-value formats a chunk is one block; for the
K-quants (256-value super-blocks) it is one 32-value sub-block, whose scales come from its
super-block's header.

Every value is computed with the same float32 operations, in the same order, as
``meshnode_packaging.sources.dequantize`` (gguf's ``dequantize_blocks``), so a product of
what these return equals "dequantize, then multiply" up to summation order, and a decoded
row is bit-identical to ``dequantize``'s. Where gguf computes ``scale * q + min``, the
product of a float16 scale (times a K-quant's small integer scale) and a quant is exact in
float32, so ``wfma`` (which may fuse it with the addition) rounds once, as gguf's two
operations do.

The K-quants' scales cover sixteen values each (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K), so
a sixteen-lane vector never straddles two scales. Their quants are bit fields of byte
arrays: :func:`wbits` reads sixteen bytes as ``(byte >> shift) & mask`` in int32 lanes,
and :func:`wior`, :func:`wishl`, :func:`wisub` and :func:`wtof` combine them, as
:mod:`.simd`'s eight-lane integer functions do.

The formats whose rows (:data:`.formats.FORMATS`) name a decoder here are the quantized
ones; the plain floats stay with :mod:`.blocks`' eight-lane loads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import models, overload, register_model

from meshnode.engine.cpu.blocks import decoder, f16, format_row, k_scale_min, q3_k_scale, u32
from meshnode.engine.cpu.simd import INNER, F32x16, inner, intrinsic, wadd, wfma, wmul, wsplat
from meshnode.engine.cpu.simd_bytes import (
    whigh_nibbles,
    wload_i8,
    wlow_nibbles,
    wq5_high,
    wq5_low,
    wq5c_high,
    wq5c_low,
)

__all__ = [
    "I32x16",
    "wbits",
    "wchunk",
    "wior",
    "wishl",
    "wisub",
    "wq6",
    "wsplat_f16",
    "wtof",
]

_I32 = ir.IntType(32)
_LANES = 16
_VI = ir.VectorType(_I32, _LANES)
_VF = ir.VectorType(ir.FloatType(), _LANES)
_BYTES = ir.VectorType(ir.IntType(8), _LANES)


class I32x16Type(types.Type):
    """Sixteen int32 lanes (bit fields of sixteen bytes)."""

    def __init__(self) -> None:
        super().__init__(name="I32x16")


I32x16 = I32x16Type()


@register_model(I32x16Type)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _VI)  # type: ignore[no-untyped-call]


def _splat(context: Any, builder: Any, value: Any, ty: Any) -> Any:
    scalar = context.cast(builder, value, ty, types.int32)
    undef = ir.Constant(_VI, ir.Undefined)
    one = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_VI, [0] * _LANES))


@intrinsic
def wsplat_f16(typingctx: Any, row: Any, off: Any) -> Any:
    """All sixteen lanes the float16 at byte ``off`` of a ``uint8`` row, as float32 (a
    block's scale): one ``vpbroadcastw`` from memory and a sixteen-lane ``vcvtph2ps``. A
    scalar float16 load is a ``vpinsrw`` into whatever register the allocator picks, and
    keeps that register's old lanes: where it picked the register the loop's last multiply
    wrote, every block's scale waited on the block before (Q8_0's k-row decode 0.65-0.77x
    as fast in one build, the same code otherwise). A broadcast writes all of it."""
    if not (isinstance(row, types.Array) and row.dtype == types.uint8 and row.layout == "C"):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i16 = ir.IntType(16)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), i16.as_pointer())
        bits = builder.load(ptr, align=1)
        undef = ir.Constant(ir.VectorType(i16, _LANES), ir.Undefined)
        one = builder.insert_element(undef, bits, ir.Constant(_I32, 0))
        splat = builder.shuffle_vector(one, undef, ir.Constant(_VI, [0] * _LANES))
        return builder.fpext(builder.bitcast(splat, ir.VectorType(ir.HalfType(), _LANES)), _VF)

    return F32x16(row, off), codegen


@intrinsic
def wbits(typingctx: Any, row: Any, off: Any, shift: Any, mask: Any) -> Any:
    """Lane ``i`` is ``(row[off + i] >> shift) & mask`` (``row`` a ``uint8`` array)."""
    if not (isinstance(row, types.Array) and row.dtype == types.uint8 and row.layout == "C"):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), _BYTES.as_pointer())
        wide = builder.zext(builder.load(ptr, align=1), _VI)
        wide = builder.lshr(wide, _splat(context, builder, args[2], sig.args[2]))
        return builder.and_(wide, _splat(context, builder, args[3], sig.args[3]))

    return I32x16(row, off, shift, mask), codegen


@intrinsic
def wior(typingctx: Any, a: Any, b: Any) -> Any:
    """``a | b`` lane by lane."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.or_(args[0], args[1])

    return I32x16(a, b), codegen


def _immediate(op: str, doc: str) -> Any:
    def typer(typingctx: Any, v: Any, n: Any) -> Any:
        if not isinstance(n, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return getattr(builder, op)(args[0], _splat(context, builder, args[1], sig.args[1]))

        return I32x16(v, n), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


wishl = _immediate("shl", "``v << n`` lane by lane.")
wisub = _immediate("sub", "``v - n`` lane by lane.")


@intrinsic
def wtof(typingctx: Any, v: Any) -> Any:
    """Signed int32 lanes to float32 (exact below 2**24)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.sitofp(args[0], _VF)

    return F32x16(v), codegen


_I8 = ir.IntType(8)
_BYTES32 = ir.VectorType(_I8, 2 * _LANES)
_VI32 = ir.VectorType(_I32, 2 * _LANES)


def _splat_bytes(context: Any, builder: Any, value: Any, ty: Any) -> Any:
    scalar = context.cast(builder, value, ty, types.uint8)
    undef = ir.Constant(_BYTES32, ir.Undefined)
    one = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_VI32, [0] * 2 * _LANES))


@intrinsic
def wq6(typingctx: Any, row: Any, ql: Any, qh: Any, shift: Any, hshift: Any) -> Any:
    """Q6_K's 32 quants of one sub-block minus 32, as two float32 vectors: lane ``i`` is
    ``((row[ql + i] >> shift) & 15 | ((row[qh + i] >> hshift) & 3) << 4) - 32``.

    The bit fields are cut, joined and centred as 32 bytes at once (one 256-bit vector:
    a fraction of the instructions of sixteen int32 lanes twice), then widened; every
    step is exact, so the values are :func:`_q6_k`'s earlier int32 ones."""
    if not (isinstance(row, types.Array) and row.dtype == types.uint8 and row.layout == "C"):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data

        def load(off: Any) -> Any:
            ptr = builder.bitcast(builder.gep(data, [off]), _BYTES32.as_pointer())
            return builder.load(ptr, align=1)

        def const(value: int) -> Any:
            return ir.Constant(_BYTES32, [value] * 2 * _LANES)

        shift = _splat_bytes(context, builder, args[3], sig.args[3])
        hshift = _splat_bytes(context, builder, args[4], sig.args[4])
        low = builder.and_(builder.lshr(load(args[1]), shift), const(15))
        high = builder.and_(builder.lshr(load(args[2]), hshift), const(3))
        centred = builder.sub(builder.or_(low, builder.shl(high, const(4))), const(32))
        undef = ir.Constant(_BYTES32, ir.Undefined)
        halves = []
        for first in (0, _LANES):
            idx = ir.Constant(ir.VectorType(_I32, _LANES), list(range(first, first + _LANES)))
            part = builder.shuffle_vector(centred, undef, idx)
            halves.append(builder.sitofp(builder.sext(part, _VI), _VF))
        return context.make_tuple(builder, sig.return_type, halves)

    pair = types.UniTuple(F32x16, 2)  # type: ignore[no-untyped-call]
    return pair(row, ql, qh, shift, hshift), codegen


# -- the 32-value blocks -------------------------------------------------------------------


def _q4_0(fmt, row, c):  # type: ignore[no-untyped-def]
    b = 18 * c  # d f16 | qs[16]: d * (nibble - 8)
    d, minus8 = wsplat_f16(row, b), wsplat(np.float32(-8.0))
    return (
        wmul(d, wadd(wlow_nibbles(row, b + 2), minus8)),
        wmul(d, wadd(whigh_nibbles(row, b + 2), minus8)),
    )


def _q4_1(fmt, row, c):  # type: ignore[no-untyped-def]
    b = 20 * c  # d f16 | m f16 | qs[16]: d * nibble + m
    d, m = wsplat_f16(row, b), wsplat_f16(row, b + 2)
    return wfma(d, wlow_nibbles(row, b + 4), m), wfma(d, whigh_nibbles(row, b + 4), m)


def _q5_0(fmt, row, c):  # type: ignore[no-untyped-def]
    b = 22 * c  # d f16 | qh u32 | qs[16]: d * (q - 16), gguf's Q5_0
    d, qh = wsplat_f16(row, b), u32(row, b + 2)
    return wmul(d, wq5c_low(row, b + 6, qh)), wmul(d, wq5c_high(row, b + 6, qh))


def _q5_1(fmt, row, c):  # type: ignore[no-untyped-def]
    b = 24 * c  # d f16 | m f16 | qh u32 | qs[16]: d * q + m, gguf's Q5_1
    d, m = wsplat_f16(row, b), wsplat_f16(row, b + 2)
    qh = u32(row, b + 4)
    return wfma(d, wq5_low(row, b + 8, qh), m), wfma(d, wq5_high(row, b + 8, qh), m)


def _q8_0(fmt, row, c):  # type: ignore[no-untyped-def]
    b = 34 * c  # d f16 | qs int8[32]: q * d
    d = wsplat_f16(row, b)
    return wmul(wload_i8(row, b + 2), d), wmul(wload_i8(row, b + 18), d)


# -- K-quants: chunk c is sub-block s = c % 8 of super-block c // 8 ------------------------


def _q2_k(fmt, row, c):  # type: ignore[no-untyped-def]
    # scales[16] | qs[64] | d f16 | dmin f16: d * (sc & 15) * q - dmin * (sc >> 4)
    o, s = 84 * (c // 8), c % 8
    d, dmin = f16(row, o + 80), f16(row, o + 82)
    qs, shift = o + 16 + 32 * (s // 4), 2 * (s % 4)
    sa, sb = row[o + 2 * s], row[o + 2 * s + 1]
    dla, mla = wsplat(d * np.float32(sa & 15)), wsplat(-(dmin * np.float32(sa >> 4)))
    dlb, mlb = wsplat(d * np.float32(sb & 15)), wsplat(-(dmin * np.float32(sb >> 4)))
    return (
        wfma(dla, wtof(wbits(row, qs, shift, 3)), mla),
        wfma(dlb, wtof(wbits(row, qs + 16, shift, 3)), mlb),
    )


def _q3_k(fmt, row, c):  # type: ignore[no-untyped-def]
    # hmask[32] | qs[64] | scales[12] | d f16: d * scale * ((low | hbit << 2) - 4)
    o, s = 110 * (c // 8), c % 8
    d = f16(row, o + 108)
    qs, shift = o + 32 + 32 * (s // 4), 2 * (s % 4)
    dla = wsplat(d * np.float32(q3_k_scale(row, o + 96, 2 * s)))
    dlb = wsplat(d * np.float32(q3_k_scale(row, o + 96, 2 * s + 1)))
    qa = wior(wbits(row, qs, shift, 3), wishl(wbits(row, o, s, 1), 2))
    qb = wior(wbits(row, qs + 16, shift, 3), wishl(wbits(row, o + 16, s, 1), 2))
    return wmul(dla, wtof(wisub(qa, 4))), wmul(dlb, wtof(wisub(qb, 4)))


@inner
def _q45_k_scales(row, o, s):  # type: ignore[no-untyped-def]
    # Q4_K/Q5_K sub-block s of the super-block at o: d * scale and -(dmin * min), splat
    sc, mn = k_scale_min(row, o + 4, s)
    return wsplat(f16(row, o) * np.float32(sc)), wsplat(-(f16(row, o + 2) * np.float32(mn)))


def _q4_k(fmt, row, c):  # type: ignore[no-untyped-def]
    # d f16 | dmin f16 | scales[12] | qs[128]: nibble s % 2 of qs[32 (s // 2) ..]
    o, s = 144 * (c // 8), c % 8
    ds, dm = _q45_k_scales(row, o, s)
    qs = o + 16 + 32 * (s // 2)
    if s % 2 == 0:
        return wfma(ds, wlow_nibbles(row, qs), dm), wfma(ds, wlow_nibbles(row, qs + 16), dm)
    return wfma(ds, whigh_nibbles(row, qs), dm), wfma(ds, whigh_nibbles(row, qs + 16), dm)


def _q5_k(fmt, row, c):  # type: ignore[no-untyped-def]
    # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]: nibble s % 2 of qs[32 (s // 2) ..]
    # with bit s of qh[l] as the fifth
    o, s = 176 * (c // 8), c % 8
    ds, dm = _q45_k_scales(row, o, s)
    qs, qh, shift = o + 48 + 32 * (s // 2), o + 16, 4 * (s % 2)
    qa = wior(wbits(row, qs, shift, 15), wishl(wbits(row, qh, s, 1), 4))
    qb = wior(wbits(row, qs + 16, shift, 15), wishl(wbits(row, qh + 16, s, 1), 4))
    return wfma(ds, wtof(qa), dm), wfma(ds, wtof(qb), dm)


def _q6_k(fmt, row, c):  # type: ignore[no-untyped-def]
    # ql[128] | qh[64] | scales int8[16] | d f16: d * scale * ((low | high << 4) - 32)
    o, s = 210 * (c // 8), c % 8
    h, m = s // 4, s % 4
    ql, qh, n = o + 64 * h + 32 * (m % 2), o + 128 + 32 * h, 4 * (m // 2)
    d = f16(row, o + 208)
    da = wsplat(d * np.float32(np.int8(row[o + 192 + 2 * s])))
    db = wsplat(d * np.float32(np.int8(row[o + 193 + 2 * s])))
    qa, qb = wq6(row, ql, qh, n, 2 * m)
    return wmul(da, qa), wmul(db, qb)


def wchunk(fmt: int, row: Any, c: int) -> Any:
    """Values ``32 c .. 32 c + 31`` of ``row`` (a format of sixteen-lane decoders: the
    quantized ones) as two vectors.

    Compiled code only, ``fmt`` a compile-time constant (:func:`.blocks.literal_format`):
    the call is the format's own decoder (its row's ``exact``, compiled as this, its
    ``fmt`` unused), so a kernel compiles its formats' decoders only.
    """
    raise TypeError("wchunk is for compiled code")


@overload(wchunk, prefer_literal=True, jit_options=INNER)
def _wchunk(fmt, row, c):  # type: ignore[no-untyped-def]
    row_format = format_row(fmt)
    if row_format.lanes != 16:
        raise TypingError(f"{row_format.name} has eight-lane decoders (.blocks' chunk)")
    return decoder(row_format.exact)
