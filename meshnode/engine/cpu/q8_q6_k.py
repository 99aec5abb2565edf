"""The one-row 8-bit-activation product of Q6_K weights, a 256-value super-block at a time.

Cut from :mod:`.q8_superblocks` (which has the design, and Q4_K's kernel): eight weight rows'
super-block decoded together, each chunk pair's sixteen int8 scales as lanes
(:func:`q6_k_scales8`), the chunks' exact integer dots with ``- 32 sum(q)`` and each half
of a chunk times its scale (:func:`q6_dot`), then :mod:`.q8_kernels`'s float32 steps.

:func:`q6_dot` takes one of three paths, each giving the same int32 lanes: on AVX-512 VNNI
``vpdpbusd`` from ``- 32 sum(q)`` then ``vpmaddwd`` with the scale beside a zero word
(:func:`madd16`); on AVX2 (no VNNI) as llama.cpp's ``ggml_vec_dot_q6_K_q8_K`` does, the
int16 pair sums of ``vpmaddubsw`` less those of ``32 x`` (``(u - 32) x`` pairs, within
+-8128), then ``vpmaddwd`` with the scale in both words of each lane; elsewhere portable
code. On AVX2 that is three instructions a 32-value chunk and row (``vpmaddubsw``,
``vpsubw``, ``vpmaddwd``) where the other path took six (``vpmaddubsw``, ``vpmaddwd`` with
ones, ``vpsubd``, a shift pair to sign-extend the scale, ``vpmulld``), beside the scale's
shuffles both take: the loop over a super-block of eight rows went from 1432 to 1188
instructions (numba 0.68, llvmlite 0.50, Zen 3), about 250 of them register spills and
reloads. In AVX2's four-row order (:mod:`.q8_rows4`) the ``vpmaddwd`` is with ones and
the scales multiply the sums of four rows' half chunks instead (:func:`kq6`,
:func:`q6_k_scales4`, :func:`kscale`: ``vpmulld`` on 16 lanes where each row took 128
shuffles a super-block to spread its scales), the same integers: 1007 instructions.
Now the step takes a whole chunk pair of eight rows at once there (:func:`q6_k_rows4`,
:func:`.q8_rows4.q6_dots_by_four`): the sums across four rows stay in int16 for two levels
and one ``vpmaddwd`` a chunk and four rows applies the scales (no ``vpmaddwd`` with ones
per row, no ``vpmulld``): 966 instructions, 10-15 % less time in cache, the same integers
(``tests/engine/test_q8_rows4.py``); the other order keeps :func:`kq6` and :func:`kscale`
(:func:`kpick` chooses while compiling). About 160 of the 966 are still spills and
reloads: chunk pairs ``c`` and ``c + 2`` read the same weight bytes, which LLVM loads once
and keeps (keeping them apart by a compiler barrier, or hiding the second offset behind
an empty ``asm``, took 5-10 % off the time in cache but not streamed, where the early
loads of the later pairs seem to help: not kept).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

from meshnode.engine.cpu import q8_superblocks
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.q8_rows4 import bytes_by_four, q6_dots_by_four
from meshnode.engine.cpu.q8_superblocks import (
    _dot_small,
    _is_bytes,
    ahead8,
    klanes,
    kpair,
    krows,
    ksum,
)
from meshnode.engine.cpu.simd import F32x8, F32x16, inner, intrinsic, wfma, wmul, wzero
from meshnode.engine.cpu.simd_int import _x86, fload, half, madd_bytes
from meshnode.engine.cpu.simd_q8 import I32x16, U8x64, tofloat16, vec8, vnni512

__all__ = [
    "eight_q6_k",
    "kq6",
    "kscale",
    "madd16",
    "q6_dot",
    "q6_k_pair",
    "q6_k_scales4",
    "q6_k_scales8",
    "scaled_pairs",
]

_Q6_K_BYTES = FORMATS["Q6_K"].type_size
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_VI = ir.VectorType(_I32, 8)
_VI16 = ir.VectorType(_I32, 16)
_VB64 = ir.VectorType(_I8, 64)
_VH = ir.VectorType(_I16, 16)


def scaled_pairs() -> bool:
    """Whether :func:`q6_dot` multiplies ``vpmaddubsw``'s int16 pair sums by the scales
    (AVX2 without AVX512-VNNI; :func:`q6_k_scales8` then puts a scale in both words of a
    lane), read while compiling."""
    return madd_bytes() and not vnni512()


@intrinsic
def q6_k_scales8(typingctx: Any, w: Any, bases: Any, off: Any, c: Any) -> Any:
    """Of Q6_K's sixteen int8 scales at byte ``off`` past each of eight rows' ``bases``
    (of a ``uint8`` array), those of chunks ``c``, ``c + 1`` (``c`` an even literal):
    eight vectors of sixteen int32, lanes ``4 i .. 4 i + 3`` scale ``2 c + i`` (each half
    of a 32-value chunk times its own, as :func:`.simd_int.lanes2`), as a signed 16-bit
    word beside a zero word (what :func:`madd16` multiplies by), or where
    :func:`scaled_pairs` in both words of the lane (what ``vpmaddwd`` multiplies a lane's
    two int16 pair sums by)."""
    ok = _is_bytes(w) and isinstance(bases, types.UniTuple) and bases.count == 8
    if not ok or not isinstance(c, types.IntegerLiteral):
        return None
    # word 2 l: scale 2 c + l // 4 (of the sixteen), word 2 l + 1: a zero (word 16), or
    # the same scale again
    pick = [2 * c.literal_value + lane // 4 for lane in range(16)]

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        offs = cgutils.unpack_tuple(builder, args[1])  # type: ignore[no-untyped-call]
        off = context.cast(builder, args[2], sig.args[2], types.int64)
        vb, vh = ir.VectorType(_I8, 16), ir.VectorType(ir.IntType(16), 16)
        zero = ir.Constant(vh, [0] * 16)
        both = scaled_pairs()
        words = [x for s in pick for x in ((s, s) if both else (s, 16))]
        mask = ir.Constant(ir.VectorType(_I32, 32), words)
        out = []
        for j in range(8):
            at = builder.add(context.cast(builder, offs[j], sig.args[1].dtype, types.int64), off)
            b = builder.load(builder.bitcast(builder.gep(data, [at]), vb.as_pointer()), align=1)
            v = builder.shuffle_vector(builder.sext(b, vh), zero, mask)
            out.append(builder.bitcast(v, _VI16))
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(I32x16, 8)(w, bases, off, c), codegen  # type: ignore[no-untyped-call]


@intrinsic
def madd16(typingctx: Any, p: Any, s: Any) -> Any:
    """``p * s`` lane by lane, exact, for ``p`` within int16 and ``s`` a :func:`q6_k_scales8`
    lane (a signed word beside a zero word): one ``vpmaddwd`` where the CPU has AVX-512."""
    if p != I32x16 or s != I32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _madd16(builder, args[0], args[1])

    return I32x16(p, s), codegen


def _madd16(builder: Any, p: Any, s: Any) -> Any:
    # madd16's lanes: vpmaddwd on a 512-bit register where the CPU has AVX-512, else
    # a multiply by the sign-extended low word
    if vnni512():
        vw = ir.VectorType(_I16, 32)
        fnty = ir.FunctionType(_VI16, [vw, vw])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.x86.avx512.pmaddw.d.512"
        )
        return builder.call(fn, [builder.bitcast(a, vw) for a in (p, s)])
    return builder.mul(p, builder.sext(builder.trunc(s, _VH), _VI16))


@intrinsic
def q6_dot(typingctx: Any, u: Any, xq: Any, off: Any, s: Any) -> Any:
    """Lane ``j`` (of sixteen int32): ``s[j]`` times the sum over ``i < 4`` of ``(u[4 j +
    i] - 32)`` times the int8 at byte ``off + 4 j + i`` of ``xq``, exactly, for Q6_K's
    six-bit quants ``u`` (at most 63, :func:`q6_k_pair`), activation quants within +-127
    and ``s`` a :func:`q6_k_scales8` lane (two 32-value chunks' four halves, each times
    its int8 scale): by ``vpmaddubsw`` pair sums where :func:`scaled_pairs`, else
    ``vpdpbusd`` (or portable code) and :func:`madd16`."""
    if u != U8x64 or not _is_bytes(xq) or s != I32x16:
        return None

    return I32x16(u, xq, off, s), _q6_dot


def _q6_dot(context: Any, builder: Any, sig: Any, args: Any) -> Any:
    # q6_dot's code
    data = context.make_array(sig.args[1])(context, builder, args[1]).data
    ptr = builder.bitcast(builder.gep(data, [args[2]]), _VB64.as_pointer())
    x = builder.load(ptr, align=1)
    if not scaled_pairs():
        thirty_two = ir.Constant(_VB64, [32] * 64)
        zero = ir.Constant(_VI16, [0] * 16)
        offs = builder.sub(zero, _dot_small(builder, zero, thirty_two, x))
        return _madd16(builder, _dot_small(builder, offs, args[0], x), args[3])
    return _q6_pairs(builder, args[0], x, args[3])


@intrinsic
def kq6(typingctx: Any, u: Any, xq: Any, off: Any, s: Any) -> Any:
    """:func:`q6_dot`, or in AVX2's four-row order (:func:`.q8_rows4.by_four`) its lanes
    before the scales (``s`` unused): those are applied to the sums across the rows
    (:func:`kscale`), four rows and a half chunk a lane, as the same integers."""
    if u != U8x64 or not _is_bytes(xq) or s != I32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if not q8_superblocks.by_four():
            return _q6_dot(context, builder, sig, args)
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        ptr = builder.bitcast(builder.gep(data, [args[2]]), _VB64.as_pointer())
        return _q6_pairs(builder, args[0], builder.load(ptr, align=1), None)

    return I32x16(u, xq, off, s), codegen


def _q6_pairs(builder: Any, u: Any, x: Any, s: Any) -> Any:
    # q6_dot's lanes on AVX2: the int16 pair sums of (u - 32) x, vpmaddwd with the
    # scales s (None: with ones, the sums before the scales)
    thirty_two = ir.Constant(_VB64, [32] * 64)
    halves = []
    undef = ir.Constant(_VB64, ir.Undefined)
    for h in range(2):
        pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
        xh = builder.shuffle_vector(x, undef, pick)
        uh = builder.shuffle_vector(u, undef, pick)
        # (u - 32) x in pairs: |u - 32| <= 32, so each pair sum is within +-8128 and
        # the int16 subtraction of the exact pair sums (<= 2 * 63 * 127) is exact
        pairs = builder.sub(
            _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _VH, uh, xh),
            _x86(
                builder,
                "llvm.x86.avx2.pmadd.ub.sw",
                _VH,
                builder.shuffle_vector(thirty_two, undef, pick),
                xh,
            ),
        )
        if s is None:
            scale = ir.Constant(_VH, [1] * 16)
        else:
            lanes = builder.shuffle_vector(s, s, ir.Constant(_VI, list(range(8 * h, 8 * h + 8))))
            scale = builder.bitcast(lanes, _VH)
        halves.append(_x86(builder, "llvm.x86.avx2.pmadd.wd", _VI, pairs, scale))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI16, list(range(16))))


@intrinsic
def q6_k_scales4(typingctx: Any, w: Any, bases: Any, off: Any, c: Any) -> Any:
    """In AVX2's four-row order (:func:`.q8_rows4.by_four`), the int8 scales at byte
    ``off`` past eight rows' ``bases`` that chunks ``c``, ``c + 1`` (``c`` an even
    literal) take, as :func:`kscale` multiplies the sums of rows 0-3 and of rows 4-7 by
    them: lane ``4 i + r`` scale ``2 c + i`` of row ``r`` (of the four), sign-extended to
    int32 (by :func:`.q8_rows4.bytes_by_four`); zeros in the other order (unused there)."""
    ok = _is_bytes(w) and isinstance(bases, types.UniTuple) and bases.count == 8
    if not ok or not isinstance(c, types.IntegerLiteral):
        return None
    q = c.literal_value // 2  # scales 4 q .. 4 q + 3

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if not q8_superblocks.by_four():
            zero = ir.Constant(_VI16, [0] * 16)
            return context.make_tuple(builder, sig.return_type, [zero, zero])
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        offs = cgutils.unpack_tuple(builder, args[1])  # type: ignore[no-untyped-call]
        off = context.cast(builder, args[2], sig.args[2], types.int64)
        vb = ir.VectorType(_I8, 16)
        rows = []
        for j in range(8):
            at = builder.add(context.cast(builder, offs[j], sig.args[1].dtype, types.int64), off)
            rows.append(
                builder.load(builder.bitcast(builder.gep(data, [at]), vb.as_pointer()), align=1)
            )
        t = builder.bitcast(bytes_by_four(builder, rows)[q], ir.VectorType(_I8, 32))
        out = []
        for g in range(2):
            pick = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * g, 16 * g + 16)))
            out.append(builder.sext(builder.shuffle_vector(t, t, pick), _VI16))
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(I32x16, 2)(w, bases, off, c), codegen  # type: ignore[no-untyped-call]


@intrinsic
def kscale(typingctx: Any, p: Any, s: Any) -> Any:
    """``p * s`` lane by lane in AVX2's four-row order (:func:`q6_k_scales4`'s scales
    on the sums of four rows; exact: at most ``16 * 32 * 127 * 128`` a lane), else ``p``
    (:func:`q6_dot` took the scales)."""
    if p != I32x16 or s != I32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.mul(args[0], args[1]) if q8_superblocks.by_four() else args[0]

    return I32x16(p, s), codegen


@intrinsic
def q6_k_pair(typingctx: Any, w: Any, low: Any, high: Any, m: Any) -> Any:
    """Chunks ``c`` and ``c + 1`` (``c`` even, ``m = c % 4``) of a Q6_K super-block as 64
    unsigned bytes: the low four bits from the 64 bytes at ``low`` (``ql``, shifted by
    ``2 m``), the high two from the 32 bytes at ``high`` (``qh``, shifted by ``2 m`` for
    chunk ``c``, ``2 m + 2`` for chunk ``c + 1``), as :func:`.q8_blocks._q6_k` each."""
    if not _is_bytes(w):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        m = context.cast(builder, args[3], sig.args[3], types.uint16)
        two_m = builder.shl(m, ir.Constant(ir.IntType(16), 1))
        return _q6_bytes(builder, data, args[1], args[2], two_m)

    return U8x64(w, low, high, m), codegen


def _q6_bytes(builder: Any, data: Any, low: Any, high: Any, two_m: Any) -> Any:
    # q6_k_pair's 64 bytes from the 64 bytes at data + low and the 32 at data + high
    # (two_m: 2 m, an i16)
    vw = ir.VectorType(ir.IntType(16), 32)

    def load(off: Any, vty: Any) -> Any:
        return builder.load(builder.bitcast(builder.gep(data, [off]), vty.as_pointer()), align=1)

    def splat16(value: Any) -> Any:
        one = builder.insert_element(ir.Constant(vw, ir.Undefined), value, ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 32), [0] * 32))

    lo = builder.lshr(builder.bitcast(load(low, _VB64), vw), splat16(two_m))
    lo = builder.and_(lo, ir.Constant(vw, [0x0F0F] * 32))
    h = load(high, ir.VectorType(_I8, 32))
    both = builder.shuffle_vector(h, h, ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2))
    counts = builder.add(splat16(two_m), ir.Constant(vw, [0] * 16 + [2] * 16))
    hi = builder.and_(
        builder.lshr(builder.bitcast(both, vw), counts), ir.Constant(vw, [0x0303] * 32)
    )
    hi = builder.shl(hi, ir.Constant(vw, [4] * 32))
    return builder.bitcast(builder.or_(lo, hi), _VB64)


@intrinsic
def q6_k_rows4(typingctx: Any, w: Any, bases: Any, o: Any, c: Any, xq: Any, xo: Any) -> Any:
    """In AVX2's four-row order (:func:`.q8_rows4.by_four`), chunks ``c``, ``c + 1`` (``c``
    an even literal) of the Q6_K super-blocks at byte ``o`` of eight rows (byte offsets
    ``bases`` of ``w``) times the activation quants at byte ``xo`` of ``xq``: each row's
    and chunk's ``s_lo D_lo + s_hi D_hi`` by :func:`.q8_rows4.q6_dots_by_four` (the
    integers :func:`kq6`, ``ksum`` and :func:`kscale` give, in their lanes); zeros in the
    other order (unused there)."""
    ok = _is_bytes(w) and _is_bytes(xq) and isinstance(bases, types.UniTuple)
    if not ok or bases.count != 8 or not isinstance(c, types.IntegerLiteral):
        return None
    h, m = c.literal_value // 4, c.literal_value % 4

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if not q8_superblocks.by_four():
            return ir.Constant(_VI16, [0] * 16)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        xdata = context.make_array(sig.args[4])(context, builder, args[4]).data
        offs = cgutils.unpack_tuple(builder, args[1])  # type: ignore[no-untyped-call]
        o = context.cast(builder, args[2], sig.args[2], types.int64)
        starts = [
            builder.add(context.cast(builder, b, sig.args[1].dtype, types.int64), o) for b in offs
        ]
        i64 = ir.IntType(64)
        two_m = ir.Constant(ir.IntType(16), 2 * m)

        def row(j: int) -> Any:
            low = builder.add(starts[j], ir.Constant(i64, 64 * h))
            high = builder.add(starts[j], ir.Constant(i64, 128 + 32 * h))
            return _q6_bytes(builder, data, low, high, two_m)

        words = ir.Constant(ir.VectorType(_I32, 8), ir.Undefined)
        for j in range(8):  # row j's four scales of chunks c, c + 1
            at = builder.add(starts[j], ir.Constant(i64, 192 + 2 * c.literal_value))
            word = builder.load(
                builder.bitcast(builder.gep(data, [at]), _I32.as_pointer()), align=1
            )
            words = builder.insert_element(words, word, ir.Constant(_I32, j))
        scales = builder.bitcast(words, ir.VectorType(_I8, 32))
        x = builder.gep(xdata, [context.cast(builder, args[5], sig.args[5], types.int64)])
        return q6_dots_by_four(builder, row, x, scales)

    return I32x16(w, bases, o, c, xq, xo), codegen


@intrinsic
def kpick(typingctx: Any, four: Any, eight: Any) -> Any:
    """``four`` in AVX2's four-row order (:func:`.q8_rows4.by_four`), else ``eight``: the
    other is not used (and its code is dropped)."""
    if four != I32x16 or eight != I32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return args[0] if q8_superblocks.by_four() else args[1]

    return I32x16(four, eight), codegen


@intrinsic
def wjoin(typingctx: Any, a: Any, b: Any) -> Any:
    """Lanes 0-7 ``a``, lanes 8-15 ``b`` (float32)."""
    if a != F32x8 or b != F32x8:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.shuffle_vector(args[0], args[1], ir.Constant(_VI16, list(range(16))))

    return F32x16(a, b), codegen


@inner
def _q6_k_pair(w, bases, o, c, q, xo, dx, ss, ts, dws, acc, four):  # type: ignore[no-untyped-def]
    # chunks c, c + 1 of a Q6_K super-block (at byte o of each row) of eight rows:
    # each row's exact dots of u - 32, each half of a chunk times its integer scale (ss:
    # q6_k_scales8's, by q6_dot; in AVX2's four-row order ts: q6_k_scales4's, on the
    # sums of four rows), summed across the rows as q4_k_dots8's, into acc
    b0, b1, b2, b3, b4, b5, b6, b7 = bases
    s0, s1, s2, s3, s4, s5, s6, s7 = ss
    t0, t1 = ts
    h, m = c // 4, c % 4
    low, high = o + 64 * h, o + 128 + 32 * h
    # summed a pair of rows at a time as they come (ksum), so that few are live at once
    p0 = kq6(q6_k_pair(w, b0 + low, b0 + high, m), q, xo, s0)
    p1 = kq6(q6_k_pair(w, b1 + low, b1 + high, m), q, xo, s1)
    p01 = ksum(p0, p1, 1)
    p2 = kq6(q6_k_pair(w, b2 + low, b2 + high, m), q, xo, s2)
    p3 = kq6(q6_k_pair(w, b3 + low, b3 + high, m), q, xo, s3)
    p03 = kscale(ksum(p01, ksum(p2, p3, 1), 2), t0)
    p4 = kq6(q6_k_pair(w, b4 + low, b4 + high, m), q, xo, s4)
    p5 = kq6(q6_k_pair(w, b5 + low, b5 + high, m), q, xo, s5)
    p45 = ksum(p4, p5, 1)
    p6 = kq6(q6_k_pair(w, b6 + low, b6 + high, m), q, xo, s6)
    p7 = kq6(q6_k_pair(w, b7 + low, b7 + high, m), q, xo, s7)
    p = kpick(four, ksum(p03, kscale(ksum(p45, ksum(p6, p7, 1), 2), t1), 3))
    dxs = kpair(fload(q, dx), fload(q, dx + 32))
    return wfma(tofloat16(p), wmul(dws, dxs), acc)


@inner
def eight_q6_k(w, bases, q, xo, dx, sx, nb):  # type: ignore[no-untyped-def]
    """As :func:`.q8_superblocks.eight_q4_k` for Q6_K rows (``sx`` unused: no minimums)."""
    b0, b1, b2, b3, b4, b5, b6, b7 = bases
    acc = wzero()  # lanes 0-7: the even chunks, 8-15: the odd ones
    for s in range(nb // 8):
        o = _Q6_K_BYTES * s
        d = o + 208
        ahead8(w, bases, o)  # the super-block's 210 bytes (q8_superblocks.LANE_AHEAD)
        ahead8(w, bases, o + 64)
        ahead8(w, bases, o + 128)
        ahead8(w, bases, o + 192)
        dw = vec8((half(w, b0 + d), half(w, b1 + d), half(w, b2 + d), half(w, b3 + d),
                   half(w, b4 + d), half(w, b5 + d), half(w, b6 + d), half(w, b7 + d)))  # fmt: skip
        dws = klanes(wjoin(dw, dw))  # in the order of ksum's sums
        i = 256 * s  # the super-block's first activation block, in bytes
        # chunk pairs 0, 2, 4, 6 (c literal: their scales' lanes are compile-time shuffles)
        ss, ts = q6_k_scales8(w, bases, o + 192, 0), q6_k_scales4(w, bases, o + 192, 0)
        four = q6_k_rows4(w, bases, o, 0, q, xo + i)
        acc = _q6_k_pair(w, bases, o, 0, q, xo + i, dx + i, ss, ts, dws, acc, four)
        ss, ts, i = q6_k_scales8(w, bases, o + 192, 2), q6_k_scales4(w, bases, o + 192, 2), i + 64
        four = q6_k_rows4(w, bases, o, 2, q, xo + i)
        acc = _q6_k_pair(w, bases, o, 2, q, xo + i, dx + i, ss, ts, dws, acc, four)
        ss, ts, i = q6_k_scales8(w, bases, o + 192, 4), q6_k_scales4(w, bases, o + 192, 4), i + 64
        four = q6_k_rows4(w, bases, o, 4, q, xo + i)
        acc = _q6_k_pair(w, bases, o, 4, q, xo + i, dx + i, ss, ts, dws, acc, four)
        ss, ts, i = q6_k_scales8(w, bases, o + 192, 6), q6_k_scales4(w, bases, o + 192, 6), i + 64
        four = q6_k_rows4(w, bases, o, 6, q, xo + i)
        acc = _q6_k_pair(w, bases, o, 6, q, xo + i, dx + i, ss, ts, dws, acc, four)
    return krows(acc)
