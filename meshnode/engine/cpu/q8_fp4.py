"""The one-row 8-bit-activation product of MXFP4 weights, two rows a register.

:func:`.q8_kernels._eight` unpacks each 32-value chunk of a weight row into one 256-bit
register (the sixteen code bytes, their high nibbles moved to the upper half, then the
table), one ``vpmaddubsw`` and ``vpmaddwd`` each, subtracts the offset term from each
row's eight lanes and sums every row's lanes across eight registers. Here two rows'
chunks share a register: rows ``i`` and ``i + 4`` of the eight, each one's sixteen code
bytes in one half (:func:`fp4_pair`); their low nibbles (values 0-15) and their high
nibbles (16-31) are picked by ``vpshufb`` apart and meet the activation block's first and
last sixteen quants, each copied into both halves; the two ``vpmaddubsw`` results are
added as int16 (each at most 2 x 28 x 127 in magnitude, their sum within int16), then one
``vpmaddwd``. Four such registers hold the eight rows; :func:`pair_sums` sums each row's
four lanes and adds the offset term ``-16 sum(q)``, the same for the eight rows (one
activation row), from the sums :func:`.q8_quant.quantize` keeps. Every step is integer
and exact, so ``D`` is the same integer as ``_eight``'s, and the float arithmetic after it
is ``_eight``'s, operation for operation (the same ``dw * dx``, the same fused
multiply-adds, even and odd chunks apart): a row's result is the same bits as the
multi-row kernels give it, the parity rule of ``--dtype q8``.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types

from meshnode.engine.cpu.fp4 import Q8_OFFSET, _pick_bytes, e8m0_half8
from meshnode.engine.cpu.q8_superblocks import ahead8
from meshnode.engine.cpu.simd import I32x8, inner, intrinsic, tofloat, vadd, vfma, vsplat, vzero
from meshnode.engine.cpu.simd_int import (
    _dot_generic,
    _dot_madd,
    _dot_vnni,
    fload,
    madd_bytes,
    vnni,
)
from meshnode.engine.cpu.simd_q8 import vmul

__all__ = ["eight_mxfp4", "fp4_pair", "fp4_pair2", "pair_sums", "two_mxfp4"]

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_VB16, _VB = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_VI = ir.VectorType(_I32, 8)
_BLOCK = 17  # bytes of an MXFP4 block: the scale byte, then sixteen code bytes
_SHIFT = Q8_OFFSET.bit_length() - 1  # the offset term is -(sum of the quants) << _SHIFT


def _is_bytes(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.uint8 and ty.layout == "C"


def _pointer(context: Any, builder: Any, aryty: Any, ary: Any, ty: Any, off: Any, to: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    at = context.cast(builder, off, ty, types.int64)
    return builder.bitcast(builder.gep(data, [at]), to.as_pointer())


def _pair_codegen(context: Any, builder: Any, sig: Any, args: Any) -> list[Any]:
    # fp4_pair's lanes for (w, a, b, q, xo, xo2, ...): the two rows' codes unpacked
    # once, then their dot products with each activation block at xo, xo2, ...
    wty, aty, bty, qty = sig.args[:4]
    w, a, b, q = args[:4]

    def load(aryty: Any, ary: Any, ty: Any, off: Any) -> Any:
        ptr = _pointer(context, builder, aryty, ary, ty, off, _VB16)
        return builder.load(ptr, align=1)

    both = builder.shuffle_vector(
        load(wty, w, aty, a),
        load(wty, w, bty, b),
        ir.Constant(ir.VectorType(_I32, 32), list(range(32))),
    )
    u_low = _pick_bytes(builder, builder.and_(both, ir.Constant(_VB, [15] * 32)))
    u_high = _pick_bytes(builder, builder.lshr(both, ir.Constant(_VB, [4] * 32)))
    copies = ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2)
    out = []
    for xty, xo in zip(sig.args[4:], args[4:], strict=True):
        x = load(qty, q, xty, xo)
        x_low = builder.shuffle_vector(x, x, copies)  # quants 0-15 in both halves
        x = load(qty, q, xty, builder.add(xo, ir.Constant(xo.type, 16)))
        x_high = builder.shuffle_vector(x, x, copies)  # quants 16-31
        if madd_bytes() and not vnni():
            out.append(_dot_madd(builder, u_low, x_low, u_high, x_high))
        else:
            dot = _dot_vnni if vnni() else _dot_generic
            out.append(builder.add(dot(builder, u_low, x_low), dot(builder, u_high, x_high)))
    return out


@intrinsic
def fp4_pair(typingctx: Any, w: Any, a: Any, b: Any, q: Any, xo: Any) -> Any:
    """Eight int32 lanes: lanes 0-3 sum to ``u . x`` for the MXFP4 block codes at bytes
    ``a .. a + 15`` of ``w`` (``u = KVALUES[code] + 16``, values 0-15 the low nibbles,
    16-31 the high ones) and the 32 int8 quants at byte ``xo`` of ``q``; lanes 4-7 for
    the codes at ``b``; exact."""
    ok = _is_bytes(w) and _is_bytes(q)
    if not ok or not all(isinstance(t, types.Integer) for t in (a, b, xo)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _pair_codegen(context, builder, sig, args)[0]

    return I32x8(w, a, b, q, xo), codegen


@intrinsic
def fp4_pair2(typingctx: Any, w: Any, a: Any, b: Any, q: Any, xo: Any, xo2: Any) -> Any:
    """:func:`fp4_pair` of the same codes with two activation blocks, at ``xo`` and at
    ``xo2`` (the codes unpacked once): the same two sets of lanes, exact."""
    ok = _is_bytes(w) and _is_bytes(q)
    if not ok or not all(isinstance(t, types.Integer) for t in (a, b, xo, xo2)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        lanes = _pair_codegen(context, builder, sig, args)
        return context.make_tuple(builder, sig.return_type, lanes)

    pair = types.UniTuple(I32x8, 2)  # type: ignore[no-untyped-call]
    return pair(w, a, b, q, xo, xo2), codegen


@intrinsic
def pair_sums(typingctx: Any, p0: Any, p1: Any, p2: Any, p3: Any, q: Any, lo: Any, hi: Any) -> Any:
    """Lane ``i`` (of eight int32): the sum of the four lanes of row ``i`` (rows ``j`` and
    ``j + 4`` in :func:`fp4_pair`'s ``p_j``, lanes 0-3 and 4-7) plus ``(s_lo + s_hi) <<
    4``, ``s_lo`` and ``s_hi`` the int32 at bytes ``lo`` and ``hi`` of ``q`` (quantize's
    ``-sum`` of the block's first and last sixteen quants); exact (integer sums)."""
    if not (all(p == I32x8 for p in (p0, p1, p2, p3)) and _is_bytes(q)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        def hadd(a: Any, b: Any) -> Any:
            # lanes [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (vphaddd)
            even = builder.shuffle_vector(a, b, ir.Constant(_VI, [0, 2, 8, 10, 4, 6, 12, 14]))
            odd = builder.shuffle_vector(a, b, ir.Constant(_VI, [1, 3, 9, 11, 5, 7, 13, 15]))
            return builder.add(even, odd)

        # rows 0, 2, 4, 6 of p0..p3's lanes 0-3, then 1, 3, 5, 7 of their lanes 4-7: in
        # the order of hadd's lanes, rows 0, 1, 2, 3 and 4, 5, 6, 7
        sums = hadd(hadd(args[0], args[1]), hadd(args[2], args[3]))
        words = [
            builder.load(_pointer(context, builder, sig.args[4], args[4], ty, at, _I32), align=4)
            for ty, at in ((sig.args[5], args[5]), (sig.args[6], args[6]))
        ]
        offset = builder.shl(builder.add(*words), ir.Constant(_I32, _SHIFT))
        one = builder.insert_element(ir.Constant(_VI, ir.Undefined), offset, ir.Constant(_I32, 0))
        return builder.add(sums, builder.shuffle_vector(one, one, ir.Constant(_VI, [0] * 8)))

    return I32x8(p0, p1, p2, p3, q, lo, hi), codegen


@inner
def eight_mxfp4(w, bases, q, xo, dx, lo, hi, nb):  # type: ignore[no-untyped-def]
    """Eight MXFP4 weight rows (at the byte offsets ``bases`` of ``w``) times one
    activation row (its quants at byte ``xo`` of quantize's buffer ``q``; its blocks'
    scale ``d`` at byte ``dx``, the ``-sum`` of their first and last sixteen quants at
    ``lo`` and ``hi``, each 32 bytes apart from one block to the next): as
    :func:`.q8_kernels._eight` computes each row (lanes: the weight rows)."""
    b0, b1, b2, b3, b4, b5, b6, b7 = bases
    acc, acc1 = vzero(), vzero()
    for c in range(nb):
        acc, acc1 = acc1, acc  # chunk c's parity: acc even, acc1 odd
        ahead8(w, bases, _BLOCK * c)  # 17 bytes a block (.q8_superblocks.LANE_AHEAD)
        o, x, i = _BLOCK * c + 1, xo + 32 * c, 32 * c
        p0 = fp4_pair(w, b0 + o, b4 + o, q, x)
        p1 = fp4_pair(w, b1 + o, b5 + o, q, x)
        p2 = fp4_pair(w, b2 + o, b6 + o, q, x)
        p3 = fp4_pair(w, b3 + o, b7 + o, q, x)
        d = pair_sums(p0, p1, p2, p3, q, lo + i, hi + i)
        dw = e8m0_half8(w, bases, _BLOCK * c)
        acc = vfma(tofloat(d), vmul(dw, vsplat(fload(q, dx + i))), acc)
    if nb % 2:
        acc, acc1 = acc1, acc
    return vadd(acc1, acc)  # the odd chunks' + the even chunks'


@inner
def two_mxfp4(w, bases, q, xo, dx, lo, hi, xo2, dx2, lo2, hi2, nb):  # type: ignore[no-untyped-def]
    """:func:`eight_mxfp4` of the same eight weight rows for two activation rows (the
    second one's quants, scales and sums at ``xo2``, ``dx2``, ``lo2``, ``hi2``), the
    weights read and unpacked once, their block scales converted once: each row's lanes
    are the same bits as :func:`eight_mxfp4` gives it alone (the same integers, the same
    float operations in the same order)."""
    b0, b1, b2, b3, b4, b5, b6, b7 = bases
    acc, acc1, bcc, bcc1 = vzero(), vzero(), vzero(), vzero()
    for c in range(nb):
        acc, acc1 = acc1, acc  # chunk c's parity: acc, bcc even, acc1, bcc1 odd
        bcc, bcc1 = bcc1, bcc
        ahead8(w, bases, _BLOCK * c)
        o, x, x2, i = _BLOCK * c + 1, xo + 32 * c, xo2 + 32 * c, 32 * c
        p0, r0 = fp4_pair2(w, b0 + o, b4 + o, q, x, x2)
        p1, r1 = fp4_pair2(w, b1 + o, b5 + o, q, x, x2)
        p2, r2 = fp4_pair2(w, b2 + o, b6 + o, q, x, x2)
        p3, r3 = fp4_pair2(w, b3 + o, b7 + o, q, x, x2)
        dw = e8m0_half8(w, bases, _BLOCK * c)
        d = pair_sums(p0, p1, p2, p3, q, lo + i, hi + i)
        acc = vfma(tofloat(d), vmul(dw, vsplat(fload(q, dx + i))), acc)
        d = pair_sums(r0, r1, r2, r3, q, lo2 + i, hi2 + i)
        bcc = vfma(tofloat(d), vmul(dw, vsplat(fload(q, dx2 + i))), bcc)
    if nb % 2:
        acc, acc1 = acc1, acc
        bcc, bcc1 = bcc1, bcc
    return vadd(acc1, acc), vadd(bcc1, bcc)
