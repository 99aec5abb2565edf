"""The one-row 8-bit-activation product of K-quant weights, a 256-value super-block at a time.

:func:`.q8_kernels._eight` decodes each 32-value chunk of a weight row on its own: for
Q4_K that is the chunk's six-bit scale and minimum picked out of twelve packed bytes and
the super-block's two float16 factors converted, in scalar code, for every chunk of eight
rows, about as many instructions as the integer dot product of its 32 weights
(``benchmarks/realsize.py``: 0.8 cycles a weight on the Llama-3.2-1B shape, one thread,
where llama.cpp's ``ggml_vec_dot_q4_K_q8_K`` spends about 0.15). Here each super-block of
eight weight rows is decoded once, the eight rows together: Q4_K's 8 x 12 packed bytes
of scales and minimums as bytes in two 512-bit registers, a row per 128-bit lane, moved
so that a chunk pair's sixteen (eight rows, two chunks) sit in one 128-bit lane, widened
and times the rows' ``d`` and ``-dmin`` (:func:`q4_k_scales8`: the same float32 products
as the chunk decoder's); Q6_K's sixteen int8 scales widened to words beside zero words
for ``vpmaddwd`` (:func:`.q8_q6_k.q6_k_scales8`, the Q6_K kernel's module), its ``- 32
sum(q)`` the start of ``vpdpbusd``.
Then each chunk costs only its unpacking, its ``vpdpbusd`` and its share of the sums
across rows. The compiled loop over eight rows' super-block went from 606 to 428
instructions for Q4_K, from 622 to 550 for Q6_K (of which some 150 are register spills
and copies). With numba 0.68 / LLVM 22 the Q4_K loop had grown to 652, a third of them
the widening of one byte shift (:func:`_nibbles`); shifting 16-bit words instead, 459
(0.113 -> 0.071 cycles a weight in cache, one thread).

That form was written for AVX-512's thirty-two 512-bit registers. On AVX2 (sixteen
256-bit registers, no 512-bit ``vpdpbusd``) it compiled to about 780 instructions per
super-block of eight Q4_K rows (140 of them spills) and 1188 for Q6_K (numba 0.68,
llvmlite 0.50, Zen 3): there the step takes :mod:`.q8_rows4`'s order instead, the sums
across the rows inside each 128-bit lane, four rows to a lane, each pair of rows summed
as it comes (Q4_K's in 16-bit lanes), Q4_K's scales decoded straight into that order
(:func:`q4_k_scales8`), Q6_K's multiplying the sums of four rows
(:func:`.q8_q6_k.kscale`): 638 and 1007 instructions, 0.12 -> 0.10 and 0.17 -> 0.14
cycles a weight (``docs/performance.md``). :func:`q4_k_dots8`, :func:`ksum`,
:func:`klanes`, :func:`kpair` and :func:`krows` take either order as the CPU asks.

The arithmetic is :mod:`.q8_kernels`'s, operation for operation (the same float32
products, the same fused multiply-adds in the same order of chunks, even and odd apart),
so a row's result is the same bits as the multi-row tiles give it: the parity rule of
``--dtype q8`` (``tests/engine/test_cpu_q8.py``); in either order (:mod:`.q8_rows4`
moves lanes and sums exact integers in another order, nothing else:
``tests/engine/test_q8_rows4.py``).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.q8_rows4 import (
    by_four,
    dots_by_four,
    lanes,
    pair,
    rows8,
    scales_by_four,
    sums_by_four,
)
from meshnode.engine.cpu.simd import (
    F32x8,
    F32x16,
    inner,
    intrinsic,
    vadd,
    wadd,
    wfma,
    wmul,
    wzero,
)
from meshnode.engine.cpu.simd_int import _dot_madd, fload, madd_bytes, prefetch
from meshnode.engine.cpu.simd_q8 import (
    I32x16,
    _dot_generic,
    _dot_vnni,
    tofloat16,
    vnni512,
)

# by_four (.q8_rows4's) is read through this module, here and in .q8_q6_k, while compiling:
# one patch of q8_superblocks.by_four picks the order of both K-quant steps (the tests)
__all__ = [
    "K_FORMATS",
    "Q4_K_ID",
    "by_four",
    "eight_q4_k",
    "klanes",
    "kpair",
    "krows",
    "ksum",
    "q4_k_dots8",
    "q4_k_scales8",
]

# The formats taken here, by their rows in .formats: Q4_K, Q6_K (kernel ids, and the bytes
# of one 256-value super-block, which the kernels step by)
_Q4_K, _Q6_K = FORMATS["Q4_K"], FORMATS["Q6_K"]
K_FORMATS = (_Q4_K.kernel_id, _Q6_K.kernel_id)
Q4_K_ID = _Q4_K.kernel_id
_Q4_K_BYTES = _Q4_K.type_size

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_F = ir.FloatType()
_VI = ir.VectorType(_I32, 8)
_VF = ir.VectorType(_F, 8)
_VI16 = ir.VectorType(_I32, 16)
_VB64 = ir.VectorType(_I8, 64)
_VW32 = ir.VectorType(ir.IntType(16), 32)  # the same 512 bits as 16-bit words


def _is_bytes(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.uint8 and ty.layout == "C"


def _consts(values: list[int]) -> Any:
    return ir.Constant(_VI, values)


def _k_scale_layout() -> tuple[list[int], list[int], list[int], list[int]]:
    # Per row (16 bytes b, the 12 at o + 4 and 4 more), output byte 4 k + i holds sc[2 k],
    # sc[2 k + 1], mn[2 k], mn[2 k + 1] (i = 0 .. 3), GGML's get_scale_min_k4: s < 4:
    # sc = b[s] & 63, mn = b[s + 4] & 63; s >= 4: sc = (b[s + 4] & 15) | ((b[s - 4] >> 6)
    # << 4), mn = (b[s + 4] >> 4) | ((b[s] >> 6) << 4). Returns the source byte of the low
    # bits (lo), of the two high bits (hi, -1: none), the low bits' mask and their shift.
    lo, hi, mask, shift = [], [], [], []
    for k in range(4):
        for i in range(4):
            s, is_min = 2 * k + i % 2, i >= 2
            if s < 4:
                lo.append(s + 4 if is_min else s)
                hi.append(-1)
                mask.append(63)
            else:
                lo.append(s + 4)
                hi.append(s if is_min else s - 4)
                mask.append(15)
            shift.append(4 if is_min and s >= 4 else 0)
    return lo, hi, mask, shift


@intrinsic
def q4_k_scales8(typingctx: Any, w: Any, bases: Any, o: Any) -> Any:
    """The scales of the Q4_K super-blocks at byte ``o`` of eight rows (byte offsets
    ``bases`` of a ``uint8`` array), decoded together as bytes: eight float32 vectors,
    ``d sc`` of chunk pairs 0 .. 3 then ``-dmin mn`` of them, each with the eight rows'
    chunk ``2 k`` in lanes 0-7 and chunk ``2 k + 1`` in lanes 8-15, or in the order of
    :func:`q4_k_dots8` where that is AVX2's (:func:`.q8_rows4.scales_by_four`). The same
    float32 products as ``half(d) * float(sc)`` chunk by chunk (exact conversions, one
    rounding)."""
    if not _is_bytes(w) or not (isinstance(bases, types.UniTuple) and bases.count == 8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        offs = cgutils.unpack_tuple(builder, args[1])  # type: ignore[no-untyped-call]
        o = context.cast(builder, args[2], sig.args[2], types.int64)
        v16 = ir.VectorType(_I8, 16)
        i32 = ir.IntType(32)

        def at(j: int, extra: int) -> Any:
            base = context.cast(builder, offs[j], sig.args[1].dtype, types.int64)
            return builder.gep(
                data, [builder.add(builder.add(base, o), ir.Constant(o.type, extra))]
            )

        def cat(a: Any, b: Any, n: int) -> Any:
            return builder.shuffle_vector(
                a, b, ir.Constant(ir.VectorType(i32, 2 * n), list(range(2 * n)))
            )

        rows = [
            builder.load(builder.bitcast(at(j, 4), v16.as_pointer()), align=1) for j in range(8)
        ]
        # d and dmin of the eight rows (float16 at o, o + 2): [d, dmin] per row
        heads = ir.Constant(ir.VectorType(i32, 8), ir.Undefined)
        for j in range(8):
            word = builder.load(builder.bitcast(at(j, 0), i32.as_pointer()), align=1)
            heads = builder.insert_element(heads, word, ir.Constant(i32, j))
        f = builder.fpext(
            builder.bitcast(heads, ir.VectorType(ir.HalfType(), 16)), ir.VectorType(_F, 16)
        )
        if by_four():
            dmin8 = builder.shuffle_vector(f, f, ir.Constant(_VI, [2 * j + 1 for j in range(8)]))
            out = scales_by_four(
                builder,
                rows,
                _k_scale_layout(),
                builder.shuffle_vector(f, f, ir.Constant(_VI, [2 * j for j in range(8)])),
                builder.fneg(dmin8),
            )
            return context.make_tuple(builder, sig.return_type, out)
        lo_src, hi_src, mask, shift = _k_scale_layout()
        zero = ir.Constant(_VB64, [0] * 64)
        decoded = []
        for h in range(2):  # rows 0-3, rows 4-7: a row per 128-bit lane
            r = cat(
                cat(rows[4 * h], rows[4 * h + 1], 16), cat(rows[4 * h + 2], rows[4 * h + 3], 16), 32
            )
            a = builder.shuffle_vector(
                r,
                zero,
                ir.Constant(
                    ir.VectorType(i32, 64), [16 * ln + x for ln in range(4) for x in lo_src]
                ),
            )
            counts = [shift[2 * i] for i in range(8)] * 4
            a = builder.bitcast(
                builder.lshr(builder.bitcast(a, _VW32), ir.Constant(_VW32, counts)), _VB64
            )
            a = builder.and_(a, ir.Constant(_VB64, mask * 4))
            pick = [64 if x < 0 else 16 * ln + x for ln in range(4) for x in hi_src]
            b = builder.shuffle_vector(r, zero, ir.Constant(ir.VectorType(i32, 64), pick))
            b = builder.bitcast(
                builder.lshr(builder.bitcast(b, _VW32), ir.Constant(_VW32, [2] * 32)), _VB64
            )
            b = builder.and_(b, ir.Constant(_VB64, [0x30] * 64))
            decoded.append(builder.bitcast(builder.or_(a, b), _VI16))
        # dword k of row j: rows 0-3 in decoded[0] (4 j + k), rows 4-7 in decoded[1]
        pieces = []
        for ks in ((0, 1), (2, 3)):
            idx = [(16 if j >= 4 else 0) + 4 * (j % 4) + k for k in ks for j in range(8)]
            t = builder.shuffle_vector(decoded[0], decoded[1], ir.Constant(_VI16, idx))
            # in each 128-bit lane (four rows of one k): byte 4 i + jj <- byte 4 jj + i
            lanes = [16 * ln + 4 * jj + i for ln in range(4) for i in range(4) for jj in range(4)]
            t = builder.shuffle_vector(
                builder.bitcast(t, _VB64), zero, ir.Constant(ir.VectorType(i32, 64), lanes)
            )
            perm = [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
            t = builder.bitcast(
                builder.shuffle_vector(
                    builder.bitcast(t, _VI16), builder.bitcast(t, _VI16), ir.Constant(_VI16, perm)
                ),
                _VB64,
            )
            for p in range(4):  # sc of pair k, mn of pair k, sc of pair k + 1, mn of it
                piece = builder.shuffle_vector(
                    t, t, ir.Constant(ir.VectorType(i32, 16), list(range(16 * p, 16 * p + 16)))
                )
                pieces.append(builder.uitofp(builder.zext(piece, _VI16), ir.VectorType(_F, 16)))
        d = builder.shuffle_vector(f, f, ir.Constant(_VI16, [2 * j for j in range(8)] * 2))
        dmin = builder.fneg(
            builder.shuffle_vector(f, f, ir.Constant(_VI16, [2 * j + 1 for j in range(8)] * 2))
        )
        sc = [pieces[0], pieces[2], pieces[4], pieces[6]]
        mn = [pieces[1], pieces[3], pieces[5], pieces[7]]
        out = [builder.fmul(d, v) for v in sc] + [builder.fmul(dmin, v) for v in mn]
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(F32x16, 8)(w, bases, o), codegen  # type: ignore[no-untyped-call]


def _isums(builder: Any, level: list[Any]) -> Any:
    # eight vectors (level) of sixteen int32 to one: lane 8 h + j is the sum of lanes 8 h
    # .. 8 h + 7 of level[j] (.simd_q8.isums on each half; exact)
    width = 4
    while len(level) > 1:
        pairs = zip(level[0::2], level[1::2], strict=True)
        level, width = [_isums_level(builder, a, b, width) for a, b in pairs], width // 2
    return level[0]


def _isums_level(builder: Any, a: Any, b: Any, width: int) -> Any:
    # one level of _isums: a's and b's groups of width lanes (of each half) side by side,
    # the low ones plus the high ones
    groups = range(0, 8, 2 * width)
    lo = [g + i for g in groups for i in range(width)]
    hi = [g + width + i for g in groups for i in range(width)]
    pick_lo = [h + x for h in (0, 8) for x in lo + [16 + i for i in lo]]
    pick_hi = [h + x for h in (0, 8) for x in hi + [16 + i for i in hi]]
    left = builder.shuffle_vector(a, b, ir.Constant(_VI16, pick_lo))
    right = builder.shuffle_vector(a, b, ir.Constant(_VI16, pick_hi))
    return builder.add(left, right)


@intrinsic
def ksum(typingctx: Any, a: Any, b: Any, level: Any) -> Any:
    """Level ``level`` (a literal, 1 .. 3) of the sums across eight rows' sixteen int32
    (rows 0, 1 then 2, 3 ... at level 1; their sums at 2; at 3 those of rows 0-3 and 4-7),
    whose last gives each row's sums of lanes 0-7 and of 8-15 in the order of
    :func:`q4_k_dots8`: by :func:`.q8_rows4.sums_by_four` on AVX2 without AVX512-VNNI,
    else in lanes ``j`` and ``8 + j`` for row ``j`` (``.simd_q8.isums`` on each half).
    Exact: a row's sums can be summed up level by level as they come."""
    if a != I32x16 or b != I32x16 or not isinstance(level, types.IntegerLiteral):
        return None
    n = level.literal_value

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if by_four():
            return sums_by_four(builder, args[0], args[1], n)
        return _isums_level(builder, args[0], args[1], 4 >> (n - 1))

    return I32x16(a, b, level), codegen


def _nibbles(builder: Any, ptr: Any) -> Any:
    # the 32 bytes at ptr (i8*) as 64 values: their low nibbles, then their high nibbles
    # (a Q4_K super-block's two chunks 2 k, 2 k + 1)
    vb = ir.VectorType(_I8, 32)
    v = builder.load(builder.bitcast(ptr, vb.as_pointer()), align=1)
    # shifted as 16-bit words, then masked: the same nibbles. x86 has no byte shift by a
    # count per byte; LLVM widened such a 512-bit shift to words and packed it back
    # (unpack low and high, two shifts, a pack: seven instructions where vpsrlvw is one),
    # and this kernel took 0.113 cycles a weight in cache instead of 0.071
    # (benchmarks/ggml_kernels.py, Q4_K 2048 x 1536, one thread)
    both = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2))
    shifts = ir.Constant(_VW32, [0] * 16 + [4] * 16)
    words = builder.bitcast(builder.lshr(builder.bitcast(both, _VW32), shifts), _VB64)
    return builder.and_(words, ir.Constant(_VB64, [15] * 64))


def _dot_small(builder: Any, acc: Any, u: Any, x: Any) -> Any:
    # acc + lane j (of sixteen int32): the sum over i < 4 of u[4 j + i] (unsigned) times
    # x[4 j + i] (int8), exact for bytes u of at most 128 (Q4_K's and Q6_K's, their offset
    # 32), two 32-value chunks as .simd_int.dot4 does one: vpdpbusd where the CPU has
    # AVX512-VNNI; else, with AVX2, each 256-bit half by vpmaddubsw and vpmaddwd
    # (.simd_int.dot4s: no pair of products passes int16); else the portable code
    if vnni512():
        return _dot_vnni(builder, acc, u, x)
    if not madd_bytes():
        return _dot_generic(builder, acc, u, x)
    halves = []
    for h in range(2):
        pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
        undef = ir.Constant(_VB64, ir.Undefined)
        halves.append(
            _dot_madd(
                builder,
                builder.shuffle_vector(u, undef, pick),
                builder.shuffle_vector(x, undef, pick),
            )
        )
    both = builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI16, list(range(16))))
    return builder.add(acc, both)


@intrinsic
def q4_k_dots8(typingctx: Any, w: Any, bases: Any, at: Any, xq: Any, xo: Any) -> Any:
    """Chunks ``2 k`` and ``2 k + 1`` of eight Q4_K rows (their nibbles at byte ``at``
    of each row's offset ``bases`` in ``w``) times the activation blocks at byte ``xo``
    of ``xq``: the exact integer dot products, sixteen int32 in the step's order
    (:func:`klanes`): by :func:`.q8_rows4.dots_by_four` on AVX2 without AVX512-VNNI,
    else each row's two chunks by one ``vpdpbusd`` on a 512-bit register (``_dot_small``)
    and the sums of each row's lanes across the rows (lanes 0-7: the rows for chunk
    ``2 k``, 8-15: for chunk ``2 k + 1``)."""
    if not (_is_bytes(w) and _is_bytes(xq)):
        return None
    if not (isinstance(bases, types.UniTuple) and bases.count == 8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        xdata = context.make_array(sig.args[3])(context, builder, args[3]).data
        offs = cgutils.unpack_tuple(builder, args[1])  # type: ignore[no-untyped-call]
        at = context.cast(builder, args[2], sig.args[2], types.int64)
        ptrs = [
            builder.gep(
                data, [builder.add(context.cast(builder, b, sig.args[1].dtype, types.int64), at)]
            )
            for b in offs
        ]
        x = builder.gep(xdata, [context.cast(builder, args[4], sig.args[4], types.int64)])
        if by_four():
            return dots_by_four(builder, ptrs, x)
        xv = builder.load(builder.bitcast(x, _VB64.as_pointer()), align=1)
        zero = ir.Constant(_VI16, [0] * 16)
        return _isums(builder, [_dot_small(builder, zero, _nibbles(builder, p), xv) for p in ptrs])

    return I32x16(w, bases, at, xq, xo), codegen


def _f16_op(doc: str, build: Any) -> Any:
    def typer(typingctx: Any, v: Any) -> Any:
        if v != F32x16:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return build(builder, args[0]) if by_four() else args[0]

        return F32x16(v), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


klanes = _f16_op(
    "Sixteen float32 (lanes 0-7: the rows for chunk ``2 k``, 8-15: for ``2 k + 1``) in "
    "the order of :func:`q4_k_dots8` (:func:`.q8_rows4.lanes` on AVX2, else as they are).",
    lanes,
)


@intrinsic
def kpair(typingctx: Any, a: Any, b: Any) -> Any:
    """``a`` in the lanes of chunk ``2 k``, ``b`` in those of ``2 k + 1``, in the order of
    :func:`q4_k_dots8` (float32)."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if by_four():
            return pair(builder, args[0], args[1])
        undef = ir.Constant(ir.VectorType(_F, 16), ir.Undefined)
        v = builder.insert_element(undef, args[0], ir.Constant(_I32, 0))
        v = builder.insert_element(v, args[1], ir.Constant(_I32, 1))
        return builder.shuffle_vector(v, v, ir.Constant(_VI16, [0] * 8 + [1] * 8))

    return F32x16(a, b), codegen


@intrinsic
def krows(typingctx: Any, v: Any) -> Any:
    """Each row's chunk ``2 k`` plus its chunk ``2 k + 1`` (lane ``j``: row ``j``) of
    sixteen float32 in the order of :func:`q4_k_dots8` (:func:`.simd_q8.fold`'s sums)."""
    if v != F32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if by_four():
            return rows8(builder, args[0])
        undef = ir.Constant(ir.VectorType(_F, 16), ir.Undefined)
        lo = builder.shuffle_vector(args[0], undef, ir.Constant(_VI, list(range(8))))
        hi = builder.shuffle_vector(args[0], undef, ir.Constant(_VI, list(range(8, 16))))
        return builder.fadd(lo, hi)

    return F32x8(v), codegen


@inner
def _q4_k_pair(w, bases, at, q, xo, dx, sx, dws, ms, acc, t):  # type: ignore[no-untyped-def]
    # chunks c, c + 1 of a super-block (their nibbles at byte at of each row, their
    # activation block at byte xo, their dx and dx sum(q) at dx, sx) into acc and t, all
    # in q4_k_dots8's order
    d = q4_k_dots8(w, bases, at, q, xo)
    dxs = kpair(fload(q, dx), fload(q, dx + 32))
    acc = wfma(tofloat16(d), wmul(dws, dxs), acc)
    sxs = kpair(fload(q, sx), fload(q, sx + 32))
    return acc, wadd(t, wmul(ms, sxs))


# How far ahead in its own rows each of the eight lanes of a one-row product asks for
# weight bytes. A lane streams a long run of contiguous rows (q8_kernels._rows), but eight
# runs side by side are more streams than some cores' hardware prefetchers follow: on a
# Zen 5 (AMD EPYC, AVX-512) one thread read 30-40 GB/s from one or two streams and 9-15
# GB/s from four to sixteen (scratch loops touching every line); with these hints the
# eight lanes read as fast as one stream. ggml_kernels.py, one thread, streamed, the
# product's time against ggml's vec_dot: Q4_K 2048 x 8192 1.15x -> 0.67-0.77x, Q6_K 8192 x
# 2048 (ffn_down) 1.62x -> 0.92-0.94x (1,024 and 2,048 bytes ahead alike; 512: 0.83x,
# 1.09x; 4,096: 0.91x, 1.02x)
LANE_AHEAD = 2048


@inner
def ahead8(w, bases, at):  # type: ignore[no-untyped-def]
    # ask for the line LANE_AHEAD bytes past byte at of each of the eight lanes' rows
    # (bases: their byte offsets in w); a hint past the end of w does not fault
    b0, b1, b2, b3, b4, b5, b6, b7 = bases
    at = at + LANE_AHEAD
    prefetch(w, b0 + at)
    prefetch(w, b1 + at)
    prefetch(w, b2 + at)
    prefetch(w, b3 + at)
    prefetch(w, b4 + at)
    prefetch(w, b5 + at)
    prefetch(w, b6 + at)
    prefetch(w, b7 + at)


@inner
def eight_q4_k(w, bases, q, xo, dx, sx, nb):  # type: ignore[no-untyped-def]
    """Eight Q4_K weight rows (at the byte offsets ``bases`` of ``w``) times one
    activation row (its quants at byte ``xo`` of quantize's buffer ``q``, its blocks'
    scale ``d`` and ``d sum(q)`` at bytes ``dx`` and ``sx``, 32 bytes apart from one
    block to the next): as :func:`.q8_kernels._eight`, with the even chunks in lanes 0-7
    of the accumulators and the odd ones in lanes 8-15."""
    acc, t = wzero(), wzero()
    for s in range(nb // 8):
        o = _Q4_K_BYTES * s
        ahead8(w, bases, o)  # a super-block's 144 bytes: the next one's hints go on
        ahead8(w, bases, o + 64)
        ahead8(w, bases, o + 128)
        d0, d1, d2, d3, m0, m1, m2, m3 = q4_k_scales8(w, bases, o)
        i = 256 * s  # the super-block's first activation block, in bytes
        acc, t = _q4_k_pair(w, bases, o + 16, q, xo + i, dx + i, sx + i, d0, m0, acc, t)
        i += 64
        acc, t = _q4_k_pair(w, bases, o + 48, q, xo + i, dx + i, sx + i, d1, m1, acc, t)
        i += 64
        acc, t = _q4_k_pair(w, bases, o + 80, q, xo + i, dx + i, sx + i, d2, m2, acc, t)
        i += 64
        acc, t = _q4_k_pair(w, bases, o + 112, q, xo + i, dx + i, sx + i, d3, m3, acc, t)
    return vadd(krows(acc), krows(t))
