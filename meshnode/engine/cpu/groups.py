"""A row's values a group at a time, with the group's scales decoded once: the exact
products' (:mod:`.kernels`) reading of the sixteen-lane formats.

A *group* is a K-quant's super-block (256 values, eight 32-value sub-blocks) or one block
of a 32-value format. :func:`group_chunks` is its count of 32-value chunks (8 or 1);
:func:`group_scales` writes the scales of a row's group ``g`` into a small float32
scratch once, and :func:`group_chunk` returns chunk ``s`` of the group (values ``32 (G g
+ s) ..`` of the row) as two sixteen-lane vectors, reading those scales. A product then
decodes the scales of Q4_K (six-bit scales and mins packed in 12 bytes, two float16
factors) and Q6_K (sixteen int8 scales, one float16) once per super-block, not once per
sub-block as :func:`.wide.wchunk` does.

The values are :func:`.wide.wchunk`'s, bit for bit: the same float32 operations on the
same operands (``d * sc`` and ``-(dmin * m)`` computed once and kept in the scratch are
the numbers wchunk computes each time), so a product of either equals "dequantize, then
multiply". Q6_K's quants are cut 64 at a time (:mod:`.sixbit`) as ``4 (q - 32)`` and
multiplied by ``d * sc / 4``: every step exact, the same float32 as ``(d * sc) * (q -
32)`` (see there).

Formats with no scales to share here (the 32-value blocks, and the K-quants other than
Q4_K and Q6_K, rare in real files) read :func:`.wide.wchunk` directly, a group of one
chunk for the former and eight for the latter; the plain floats (F32, F16, BF16) are
loaded sixteen lanes at a time and widened exactly (:mod:`.blocks`' eight-lane ``chunk``
stays their decoder for whole rows), a group of one chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import overload

from meshnode.engine.cpu.blocks import format_row
from meshnode.engine.cpu.lookup import permutes, wiota, wlookup
from meshnode.engine.cpu.simd import (
    INNER,
    F32x16,
    intrinsic,
    wfma,
    wmul,
    wsplat,
    wstore,
    wzero,
)
from meshnode.engine.cpu.simd_bytes import whigh_nibbles, wlow_nibbles
from meshnode.engine.cpu.sixbit import wq6_join, wq6_quarter, wq6_stored
from meshnode.engine.cpu.wide import wchunk

__all__ = [
    "group_chunk",
    "group_chunk_at",
    "group_chunks",
    "group_rows",
    "group_scales",
    "wlane_splat",
    "wq4k_scales",
    "wq6k_scales",
]

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_V16 = ir.VectorType(_I32, 16)
_F16 = ir.VectorType(ir.FloatType(), 16)


def _ints(values: list[int]) -> Any:
    return ir.Constant(_V16, values)


def _bytes16(context: Any, builder: Any, aryty: Any, ary: Any, off: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    ptr = builder.bitcast(builder.gep(data, [off]), ir.VectorType(_I8, 16).as_pointer())
    return builder.load(ptr, align=1)


def _factors(context: Any, builder: Any, aryty: Any, ary: Any, off: Any, lanes: list[int]) -> Any:
    # the two float16 at byte off (four bytes, one load) as float32, lane i of the result
    # lanes[i] of them. A load that fills a whole register: a scalar float16 load is a
    # vpinsrw into whichever register the allocator picks, keeping its old lanes, and
    # where it picked one the loop wrote last every super-block waited on the one before
    # (.wide.wsplat_f16)
    data = context.make_array(aryty)(context, builder, ary).data
    two = ir.VectorType(ir.HalfType(), 2)
    halves = builder.load(builder.bitcast(builder.gep(data, [off]), two.as_pointer()), align=1)
    floats = builder.fpext(halves, ir.VectorType(ir.FloatType(), 2))
    return builder.shuffle_vector(floats, floats, _ints(lanes))


@intrinsic
def wq4k_scales(typingctx: Any, row: Any, off: Any) -> Any:
    """Q4_K's eight six-bit scales and mins times their factors, of the super-block at byte
    ``off`` (``d`` f16, ``dmin`` f16, the 12 scale bytes): lane ``s`` is ``d * sc[s]``,
    lane ``8 + s`` is ``-dmin * m[s]``, the scalar :func:`.blocks.k_scale_min` of each
    sub-block ``s`` unpacked in integer lanes at once. Each product is one float32
    rounding of the same operands, so the same bits as :func:`.wide._q4_k`'s ``d * sc``
    and ``-(dmin * m)`` (rounding is symmetric, the negation exact)."""
    if not (isinstance(row, types.Array) and row.dtype == types.uint8 and row.layout == "C"):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        at = builder.add(args[1], ir.Constant(args[1].type, 4))
        q = builder.zext(_bytes16(context, builder, sig.args[0], args[0], at), _V16)
        undef = ir.Constant(_V16, ir.Undefined)
        # sc[s < 4] = q[s] & 63, m[s < 4] = q[s + 4] & 63; for s >= 4: sc = q[s + 4] & 15
        # | (q[s - 4] >> 6) << 4, m = q[s + 4] >> 4 | (q[s] >> 6) << 4
        low = builder.shuffle_vector(
            q, undef, _ints([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
        )
        low = builder.and_(
            builder.lshr(low, _ints([0] * 12 + [4] * 4)), _ints(([63] * 4 + [15] * 4) * 2)
        )
        top = builder.shuffle_vector(q, undef, _ints([0, 1, 2, 3] * 2 + [4, 5, 6, 7] * 2))
        top = builder.and_(
            builder.shl(builder.lshr(top, _ints([6] * 16)), _ints([4] * 16)),
            _ints(([0] * 4 + [48] * 4) * 2),
        )
        ints = builder.sitofp(builder.or_(low, top), _F16)
        factors = _factors(context, builder, sig.args[0], args[0], args[1], [0] * 8 + [1] * 8)
        signs = ir.Constant(_F16, [1.0] * 8 + [-1.0] * 8)
        return builder.fmul(ints, builder.fmul(factors, signs))

    return F32x16(row, off), codegen


@intrinsic
def wq6k_scales(typingctx: Any, row: Any, off: Any) -> Any:
    """Q6_K's sixteen int8 scales at byte ``off`` times the float16 ``d`` right after them
    (a super-block's last 18 bytes): lane ``t`` is ``d * sc[t]``, as :func:`.wide._q6_k`
    computes each (exact: at most 18 significant bits)."""
    if not (isinstance(row, types.Array) and row.dtype == types.uint8 and row.layout == "C"):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        sc = builder.sitofp(
            builder.sext(_bytes16(context, builder, sig.args[0], args[0], args[1]), _V16), _F16
        )
        # d with the last two scale bytes before it: a load within the super-block
        at = builder.add(args[1], ir.Constant(args[1].type, 14))
        return builder.fmul(sc, _factors(context, builder, sig.args[0], args[0], at, [1] * 16))

    return F32x16(row, off), codegen


@intrinsic
def wlane_splat(typingctx: Any, v: Any, i: Any) -> Any:
    """Lane ``i`` of ``v`` in all sixteen lanes."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        lane = builder.extract_element(
            args[0], context.cast(builder, args[1], sig.args[1], types.int32)
        )
        undef = ir.Constant(_F16, ir.Undefined)
        one = builder.insert_element(undef, lane, ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, undef, _ints([0] * 16))

    return F32x16(v, i), codegen


def _q4_k_scales(fmt, row, g):  # type: ignore[no-untyped-def]
    o = 144 * g  # d f16 | dmin f16 | scales[12] | qs[128]
    return wq4k_scales(row, o)


def _q4_k_chunk(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    # as wide._q4_k: nibble s % 2 of qs[32 (s // 2) ..], d sc q - dmin m in one fma
    qs = 144 * g + 16 + 32 * (s // 2)
    ds, dm = wlane_splat(sc, s), wlane_splat(sc, 8 + s)
    if s % 2 == 0:
        return wfma(ds, wlow_nibbles(row, qs), dm), wfma(ds, wlow_nibbles(row, qs + 16), dm)
    return wfma(ds, whigh_nibbles(row, qs), dm), wfma(ds, whigh_nibbles(row, qs + 16), dm)


def _q4_k_looked_up(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    # the same values by table: lane k is d sc k - dmin m, wfma's operation on a nibble k
    qs = 144 * g + 16 + 32 * (s // 2)
    table = wfma(wlane_splat(sc, s), wiota(0), wlane_splat(sc, 8 + s))
    if s % 2 == 0:
        return wlookup(table, row, qs, False), wlookup(table, row, qs + 16, False)
    return wlookup(table, row, qs, True), wlookup(table, row, qs + 16, True)


def _q6_k_quarter_scales(fmt, row, g):  # type: ignore[no-untyped-def]
    # d sc / 4 per sixteen values: sixbit's quants are 4 (q - 32) (exact, see there)
    o = 210 * g
    return wmul(wq6k_scales(row, o + 192), wsplat(np.float32(0.25)))


def _q6_k_quarters(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    # sub-block s as sixbit cuts it: quarter s % 4 of half s // 4
    o, h = 210 * g, s // 4
    qa, qb = wq6_quarter(row, o + 64 * h, o + 128 + 32 * h, s % 4)
    return wmul(wlane_splat(sc, 2 * s), qa), wmul(wlane_splat(sc, 2 * s + 1), qb)


def _float_load(kind: str, doc: str) -> Any:
    """An intrinsic: sixteen float32, float16 or bfloat16 at byte ``off`` of a ``uint8``
    row, as float32 (exact widenings)."""
    elem = {"f32": ir.FloatType(), "f16": ir.HalfType(), "bf16": ir.IntType(16)}[kind]

    def typer(typingctx: Any, row: Any, off: Any) -> Any:
        if not (isinstance(row, types.Array) and row.dtype == types.uint8):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            vty = ir.VectorType(elem, 16)
            v = builder.load(
                builder.bitcast(builder.gep(data, [args[1]]), vty.as_pointer()), align=1
            )
            if kind == "f16":
                return builder.fpext(v, _F16)
            if kind == "bf16":  # bfloat16 is the top half of a float32
                return builder.bitcast(builder.shl(builder.zext(v, _V16), _ints([16] * 16)), _F16)
            return v

        return F32x16(row, off), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


wload_f32 = _float_load("f32", "Sixteen float32 at byte ``off``.")
wload_f16 = _float_load("f16", "Sixteen float16 at byte ``off``, as float32.")
wload_bf16 = _float_load("bf16", "Sixteen bfloat16 at byte ``off``, as float32.")


def _f32_chunk(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    return wload_f32(row, 128 * g), wload_f32(row, 128 * g + 64)


def _f16_chunk(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    return wload_f16(row, 64 * g), wload_f16(row, 64 * g + 32)


def _bf16_chunk(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    return wload_bf16(row, 64 * g), wload_bf16(row, 64 * g + 32)


def _no_scales(fmt, row, g):  # type: ignore[no-untyped-def]
    return wzero()


def _whole_chunk(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    return wchunk(fmt, row, g)


def _k_chunk(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    return wchunk(fmt, row, 8 * g + s)


_FLOATS = {"F32": _f32_chunk, "F16": _f16_chunk, "BF16": _bf16_chunk}
_SHARED = {
    "Q4_K": (_q4_k_scales, _q4_k_chunk),
    "Q6_K": (_q6_k_quarter_scales, _q6_k_quarters),
}


def _chunks(fmt: Any) -> int:
    return 8 if format_row(fmt).block_size == 256 else 1


def group_chunks(fmt: int) -> int:
    """32-value chunks in a group of ``fmt`` (compile-time constant): 8 or 1."""
    raise TypeError("for compiled code")


@overload(group_chunks, prefer_literal=True, jit_options=INNER)
def _group_chunks(fmt):  # type: ignore[no-untyped-def]
    n = _chunks(fmt)
    return lambda fmt: n


def group_scales(fmt: int, row: Any, g: int) -> Any:
    """The scales of group ``g`` of ``row`` times their factors, a sixteen-lane vector (Q4_K:
    ``d sc`` then ``-dmin m`` per sub-block; Q6_K: ``d sc`` per sixteen values; zeros for a
    format that reads its scales in :func:`group_chunk`)."""
    raise TypeError("for compiled code")


@overload(group_scales, prefer_literal=True, jit_options=INNER)
def _group_scales(fmt, row, g):  # type: ignore[no-untyped-def]
    return _SHARED.get(format_row(fmt).name, (_no_scales,))[0]


def group_chunk(fmt: int, row: Any, g: int, s: int, sc: Any) -> Any:
    """Chunk ``s`` of group ``g`` of ``row`` as two sixteen-lane vectors, with the scales
    ``sc`` :func:`group_scales` returned: :func:`.wide.wchunk`'s values."""
    raise TypeError("for compiled code")


@overload(group_chunk, prefer_literal=True, jit_options=INNER)
def _group_chunk(fmt, row, g, s, sc):  # type: ignore[no-untyped-def]
    name = format_row(fmt).name
    if name in _FLOATS:
        return _FLOATS[name]
    if name == "Q4_K" and permutes():
        return _q4_k_looked_up
    if name in _SHARED:
        return _SHARED[name][1]
    return _k_chunk if _chunks(fmt) == 8 else _whole_chunk


def _q4_k_chunk_at(fmt, row, g, s, buf, at):  # type: ignore[no-untyped-def]
    # _q4_k_chunk with the scales read from buf[at ..] (group_scales' lanes, stored)
    qs = 144 * g + 16 + 32 * (s // 2)
    ds, dm = wsplat(buf[at + s]), wsplat(buf[at + 8 + s])
    if s % 2 == 0:
        return wfma(ds, wlow_nibbles(row, qs), dm), wfma(ds, wlow_nibbles(row, qs + 16), dm)
    return wfma(ds, whigh_nibbles(row, qs), dm), wfma(ds, whigh_nibbles(row, qs + 16), dm)


def _q6_k_quarters_at(fmt, row, g, s, buf, at):  # type: ignore[no-untyped-def]
    # _q6_k_quarters with the scales read from buf[at ..], and the half's quarters joined
    # once, at its first, into buf[64 + 2 at ..] (32 float32 a row: 128 bytes, past the
    # four rows' scales) and read back from there by the rest (.sixbit.wq6_join)
    o, h, joined = 210 * g, s // 4, 64 + 2 * at
    if s % 4 == 0:
        wq6_join(row, o + 64 * h, o + 128 + 32 * h, buf, joined)
    qa, qb = wq6_stored(buf, joined, s % 4)
    return wmul(wsplat(buf[at + 2 * s]), qa), wmul(wsplat(buf[at + 2 * s + 1]), qb)


def _chunk_no_buf(fmt, row, g, s, buf, at):  # type: ignore[no-untyped-def]
    return group_chunk(fmt, row, g, s, wzero())


def group_chunk_at(fmt: int, row: Any, g: int, s: int, buf: Any, at: Any) -> Any:
    """:func:`group_chunk` with the scales read from ``buf[at : at + 16]`` (a float32
    array where a caller stored :func:`group_scales`' vector): the same values, bit for
    bit (a stored float32 is read back as it was). Each scale is then one broadcast from
    memory, a load, where picking a lane of a register takes a shuffle or two; and the
    four rows' scales need no registers between the chunks (AVX2 has sixteen). Q6_K
    also keeps its quants there: ``buf`` holds at least ``64 + 2 at + 32`` float32, and
    the chunks of a half come in order from its first (``s % 4 == 0``), which stores
    them."""
    raise TypeError("for compiled code")


@overload(group_chunk_at, prefer_literal=True, jit_options=INNER)
def _group_chunk_at(fmt, row, g, s, buf, at):  # type: ignore[no-untyped-def]
    name = format_row(fmt).name
    if name == "Q4_K":
        return _q4_k_chunk_at
    if name == "Q6_K":
        return _q6_k_quarters_at
    return _chunk_no_buf


@njit(inline="always")
def group_rows(fmt, raw, o, rows, w, j0, m, stride):  # type: ignore[no-untyped-def]
    """Values ``j0 .. j0 + m - 1`` of weight rows ``o .. o + rows - 1`` of ``raw`` (format
    ``fmt``) into ``w[stride i ..]`` (row ``i``), a group at a time (``j0`` and ``m`` whole
    groups: a K-quant's super-block, a 32-value block): the k-row passes' decoded blocks
    (:mod:`.narrow`, :mod:`.panels`)."""
    n = group_chunks(fmt)
    size = 32 * n
    for i in range(rows):
        row = raw[o + i]
        for g in range(j0 // size, (j0 + m) // size):
            sc = group_scales(fmt, row, g)
            for s in range(n):
                w0, w1 = group_chunk(fmt, row, g, s, sc)
                at = stride * i + 32 * (n * g + s) - j0
                wstore(w, at, w0)
                wstore(w, at + 16, w1)
