"""Byte vectors for the 8-bit-activation kernels (:mod:`.q8`), written as LLVM vector IR.

``U8x32`` is an LLVM ``<32 x i8>``: the 32 quantized weights of one block, unpacked to one
unsigned byte each. :func:`dot4` multiplies them with 32 int8 activations and sums each
four consecutive products into one of eight int32 lanes (lane ``j``: bytes ``4j .. 4j+3``,
so lanes 0-3 are the block's first 16 values and lanes 4-7 its last 16), the result an
:data:`.simd.I32x8` that the float lanes of :mod:`.simd` take from there.

Where the CPU has VNNI (AVX512-VNNI with AVX512VL, or AVX-VNNI) :func:`dot4` is one
``vpdpbusd``; elsewhere the same sums are written generically (widen to int32, multiply,
add neighbours), which LLVM lowers for the machine it compiles on (``pmaddwd`` on x86,
``smull``/``addp`` on ARM). Products are exact int32 either way: an unsigned byte times an
int8 is at most 32,640 in magnitude and a lane sums four. On x86 without VNNI that
widening costs some ten instructions a block; :func:`dot4s` (weight bytes of at most 128:
every format's but Q8_0's) and :func:`sdot4` (Q8_0's int8 weights, signed) take
``vpmaddubsw`` and ``vpmaddwd`` there instead (AVX2: two, and two ``vpsignb``), as
llama.cpp does, exact because no pair of products passes int16 (the activation quants
are within +-127): the one-row q8 products about 1.8x faster on an AMD EPYC (Zen 3).

``F32x2`` (two float lanes) carries a Q4_1/Q5_1 block's scale and minimum through one
load, one conversion and one multiply with the activation block's scale and sum.

Loads take a ``uint8`` array and a byte offset (the quantized activations, their sums and
scales share one buffer) and do no bounds checks, like numba's own indexing.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import models, register_model

from meshnode.engine.cpu.simd import F32x8, I32x8, intrinsic

__all__ = [
    "F32x2",
    "U8x32",
    "band",
    "bits32",
    "bload",
    "bor",
    "bshl",
    "bshr",
    "bsplat",
    "bxor",
    "dot4",
    "dot4s",
    "fload",
    "fload2",
    "gather8",
    "half",
    "half2",
    "half8",
    "iload",
    "imul",
    "is_bases8",
    "ivsub",
    "lane",
    "lanes2",
    "madd_bytes",
    "mul2",
    "nibbles",
    "prefetch",
    "sdot4",
    "vnni",
]

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_VB = ir.VectorType(_I8, 32)
_VB16 = ir.VectorType(_I8, 16)
_VI = ir.VectorType(_I32, 8)
_VW = ir.VectorType(_I32, 32)
_VI16 = ir.VectorType(_I32, 16)  # shuffle masks of 16 lanes


class U8x32Type(types.Type):
    """Thirty-two bytes, one AVX2 register (two SSE or NEON ones)."""

    def __init__(self) -> None:
        super().__init__(name="U8x32")


U8x32 = U8x32Type()


@register_model(U8x32Type)
class _U8x32Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _VB)  # type: ignore[no-untyped-call]


@cache
def vnni() -> bool:
    """Whether this CPU has ``vpdpbusd`` on 256-bit registers (what numba compiles for)."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    has = {name for name in ("avx512vnni", "avx512vl", "avxvnni") if features.get(name)}
    return "avxvnni" in has or {"avx512vnni", "avx512vl"} <= has


def _is_array(ty: Any, dtype: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == dtype and ty.layout == "C"


def _byte_pointer(context: Any, builder: Any, aryty: Any, ary: Any, off: Any, vty: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [off]), vty.as_pointer())


def _splat8(context: Any, builder: Any, value: Any, ty: Any) -> Any:
    scalar = context.cast(builder, value, ty, types.uint8)
    undef = ir.Constant(_VB, ir.Undefined)
    one = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_VW, [0] * 32))


# -- loads -------------------------------------------------------------------------------


@intrinsic
def bload(typingctx: Any, row: Any, off: Any) -> Any:
    """The 32 bytes at ``off`` of a ``uint8`` row."""
    if not _is_array(row, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], _VB)
        return builder.load(ptr, align=1)

    return U8x32(row, off), codegen


@intrinsic
def nibbles(typingctx: Any, row: Any, off: Any) -> Any:
    """The 16 bytes at ``off`` as 32 values: their low nibbles, then their high nibbles
    (the ``qs`` of Q4_0, Q4_1, Q5_0 and Q5_1 blocks)."""
    if not _is_array(row, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], _VB16)
        v = builder.load(ptr, align=1)
        low = builder.and_(v, ir.Constant(_VB16, [15] * 16))
        high = builder.lshr(v, ir.Constant(_VB16, [4] * 16))
        return builder.shuffle_vector(low, high, ir.Constant(_VW, list(range(32))))

    return U8x32(row, off), codegen


@intrinsic
def bits32(typingctx: Any, row: Any, off: Any) -> Any:
    """Byte ``j`` is bit ``j`` (0 or 1) of the little-endian 32-bit word at ``off``
    (Q5_0/Q5_1's ``qh``)."""
    if not _is_array(row, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        vty = ir.VectorType(_I8, 4)
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], vty)
        v = builder.load(ptr, align=1)
        spread = builder.shuffle_vector(v, v, ir.Constant(_VW, [j // 8 for j in range(32)]))
        masks = ir.Constant(_VB, [1 << (j % 8) for j in range(32)])
        hit = builder.icmp_unsigned("!=", builder.and_(spread, masks), ir.Constant(_VB, [0] * 32))
        return builder.zext(hit, _VB)

    return U8x32(row, off), codegen


@intrinsic
def iload(typingctx: Any, buf: Any, off: Any) -> Any:
    """Eight int32 at byte ``off`` of a ``uint8`` buffer (``off`` a multiple of 4)."""
    if not _is_array(buf, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], _VI)
        return builder.load(ptr, align=4)

    return I32x8(buf, off), codegen


@intrinsic
def half(typingctx: Any, row: Any, off: Any) -> Any:
    """The float16 at byte ``off`` of a ``uint8`` row, as float32 (exact)."""
    if not _is_array(row, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], ir.HalfType())
        return builder.fpext(builder.load(ptr, align=1), ir.FloatType())

    return types.float32(row, off), codegen


def gather8(context: Any, builder: Any, sig: Any, args: Any, ty: Any) -> Any:
    """In an intrinsic's codegen of ``(row, bases, off)`` (a ``uint8`` row, eight int
    offsets, an int): the vector of eight ``ty`` whose lane ``i`` is the value at byte
    ``bases[i] + off`` of the row (eight rows' block scales)."""
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    off = context.cast(builder, args[2], sig.args[2], types.int64)
    v = ir.Constant(ir.VectorType(ty, 8), ir.Undefined)
    bases = cgutils.unpack_tuple(builder, args[1])  # type: ignore[no-untyped-call]
    for i, base in enumerate(bases):
        at = builder.add(context.cast(builder, base, sig.args[1].dtype, types.int64), off)
        ptr = builder.bitcast(builder.gep(data, [at]), ty.as_pointer())
        v = builder.insert_element(v, builder.load(ptr, align=1), ir.Constant(_I32, i))
    return v


def is_bases8(ty: Any) -> bool:
    """Whether ``ty`` is a tuple of eight integers (eight rows' byte offsets)."""
    return isinstance(ty, types.UniTuple) and ty.count == 8 and isinstance(ty.dtype, types.Integer)


@intrinsic
def half8(typingctx: Any, row: Any, bases: Any, off: Any) -> Any:
    """Lane ``i`` the float16 at byte ``bases[i] + off`` of a ``uint8`` row, as float32
    (exact; eight rows' block scales, one conversion)."""
    if not (_is_array(row, types.uint8) and is_bases8(bases)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        halves = gather8(context, builder, sig, args, ir.HalfType())
        return builder.fpext(halves, ir.VectorType(ir.FloatType(), 8))

    return F32x8(row, bases, off), codegen


@intrinsic
def fload(typingctx: Any, buf: Any, off: Any) -> Any:
    """The float32 at byte ``off`` of a ``uint8`` buffer (``off`` a multiple of 4)."""
    if not _is_array(buf, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], ir.FloatType())
        return builder.load(ptr, align=4)

    return types.float32(buf, off), codegen


# -- byte lanes --------------------------------------------------------------------------


def _byte_immediate(op: str, doc: str) -> Any:
    def typer(typingctx: Any, v: Any, n: Any) -> Any:
        if v != U8x32 or not isinstance(n, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return getattr(builder, op)(args[0], _splat8(context, builder, args[1], sig.args[1]))

        return U8x32(v, n), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


band = _byte_immediate("and_", "``v & n`` byte by byte.")
bxor = _byte_immediate("xor", "``v ^ n`` byte by byte.")


def _byte_shift(left: bool, doc: str) -> Any:
    # x86 has no byte shifts: shift 16-bit lanes by the same count, then clear the bits
    # that crossed from the neighbouring byte (one shift and one and, for any count < 8)
    words = ir.VectorType(ir.IntType(16), 16)

    def typer(typingctx: Any, v: Any, n: Any) -> Any:
        if v != U8x32 or not isinstance(n, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            count = context.cast(builder, args[1], sig.args[1], types.uint16)
            undef = ir.Constant(words, ir.Undefined)
            one = builder.insert_element(undef, count, ir.Constant(_I32, 0))
            counts = builder.shuffle_vector(one, undef, ir.Constant(_VI16, [0] * 16))
            w = builder.bitcast(args[0], words)
            shifted = builder.shl(w, counts) if left else builder.lshr(w, counts)
            n8 = context.cast(builder, args[1], sig.args[1], types.uint8)
            ff = ir.Constant(_I8, 0xFF)
            mask = builder.shl(ff, n8) if left else builder.lshr(ff, n8)  # a scalar, splat
            keep = _splat8(context, builder, mask, types.uint8)
            return builder.and_(builder.bitcast(shifted, _VB), keep)

        return U8x32(v, n), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


bshr = _byte_shift(False, "``v >> n`` (logical) byte by byte, ``n < 8``.")
bshl = _byte_shift(True, "``v << n`` byte by byte (bits shifted out are lost), ``n < 8``.")


@intrinsic
def bor(typingctx: Any, a: Any, b: Any) -> Any:
    """``a | b`` byte by byte."""
    if a != U8x32 or b != U8x32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.or_(args[0], args[1])

    return U8x32(a, b), codegen


# -- the integer dot product -------------------------------------------------------------


def _dot_generic(builder: Any, w: Any, x: Any) -> Any:
    wide = builder.mul(builder.zext(w, _VW), builder.sext(x, _VW))  # exact: |w x| < 2**15
    return _add_fours(builder, wide)


def _add_fours(builder: Any, wide: Any) -> Any:
    # 32 int32 products to eight lanes, lane j the sum of products 4j .. 4j + 3
    v = wide
    for width in (16, 8):  # add neighbours twice: lane j sums bytes 4j .. 4j + 3
        half = ir.VectorType(_I32, width)
        undef = ir.Constant(v.type, ir.Undefined)
        even = builder.shuffle_vector(v, undef, ir.Constant(half, list(range(0, 2 * width, 2))))
        odd = builder.shuffle_vector(v, undef, ir.Constant(half, list(range(1, 2 * width, 2))))
        v = builder.add(even, odd)
    return v


def _dot_vnni(builder: Any, w: Any, x: Any) -> Any:
    fnty = ir.FunctionType(_VI, [_VI, _VI, _VI])
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, fnty, "llvm.x86.avx512.vpdpbusd.256"
    )
    zero = ir.Constant(_VI, [0] * 8)
    return builder.call(fn, [zero, builder.bitcast(w, _VI), builder.bitcast(x, _VI)])


@intrinsic
def dot4(typingctx: Any, w: Any, xq: Any, off: Any) -> Any:
    """Lane ``j`` = the sum over ``i < 4`` of ``w[4j + i]`` (unsigned) times the int8 at
    byte ``off + 4j + i`` of ``xq`` (a ``uint8`` buffer): eight exact int32 sums."""
    if w != U8x32 or not _is_array(xq, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        x = builder.load(
            _byte_pointer(context, builder, sig.args[1], args[1], args[2], _VB), align=1
        )  # no alignment assumed: an aligned move on a 16-byte-aligned buffer faults
        return (_dot_vnni if vnni() else _dot_generic)(builder, args[0], x)

    return I32x8(w, xq, off), codegen


@cache
def madd_bytes() -> bool:
    """Whether this CPU multiplies unsigned by signed bytes and adds pairs of products
    into int16 in one instruction on 256-bit registers (``vpmaddubsw``: AVX2)."""
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("avx2"))


def _x86(builder: Any, name: str, result: Any, *args: Any) -> Any:
    fnty = ir.FunctionType(result, [a.type for a in args])
    fn = cgutils.get_or_insert_function(builder.module, fnty, name)  # type: ignore[no-untyped-call]
    return builder.call(fn, list(args))


def _dot_madd(builder: Any, w: Any, x: Any, *more: Any) -> Any:
    # vpmaddubsw (w unsigned times x signed, each pair of products summed into an int16
    # lane, saturating) then vpmaddwd with ones (each pair of those into an int32 lane):
    # exact where a pair's sum stays within int16, as for bytes w <= 128 and |x| <= 127;
    # more: another (w, x) whose int16 pairs are added first (their sums too within int16)
    vh = ir.VectorType(ir.IntType(16), 16)
    pairs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", vh, w, x)
    if more:
        pairs = builder.add(pairs, _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", vh, *more))
    return _x86(builder, "llvm.x86.avx2.pmadd.wd", _VI, pairs, ir.Constant(vh, [1] * 16))


@intrinsic
def dot4s(typingctx: Any, w: Any, xq: Any, off: Any) -> Any:
    """:func:`dot4` for small weight bytes (every byte of ``w`` at most 128, the
    activation quants within +-127, as :func:`.q8_quant.quantize` makes them): the same
    sums, where the CPU has no VNNI by ``vpmaddubsw`` and ``vpmaddwd`` (AVX2; two
    products' sum stays below 2**15, so nothing saturates), else as :func:`dot4`."""
    if w != U8x32 or not _is_array(xq, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        x = builder.load(
            _byte_pointer(context, builder, sig.args[1], args[1], args[2], _VB), align=1
        )
        if vnni():
            return _dot_vnni(builder, args[0], x)
        return (_dot_madd if madd_bytes() else _dot_generic)(builder, args[0], x)

    return I32x8(w, xq, off), codegen


@intrinsic
def sdot4(typingctx: Any, w: Any, xq: Any, off: Any) -> Any:
    """As :func:`dot4` with the bytes of ``w`` signed (int8, Q8_0's weights; the
    activation quants within +-127): lane ``j`` the exact sum over ``i < 4`` of ``w[4j +
    i]`` times the int8 at byte ``off + 4j + i`` of ``xq``. Where the CPU has
    ``vpmaddubsw`` (AVX2), as llama.cpp does: ``|w|`` (unsigned: 128 for -128) times ``x``
    given ``w``'s sign (``vpsignb``; a zero ``w`` zeroes it), then as :func:`dot4s`."""
    if w != U8x32 or not _is_array(xq, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        x = builder.load(
            _byte_pointer(context, builder, sig.args[1], args[1], args[2], _VB), align=1
        )
        w = args[0]
        if not madd_bytes():
            wide = builder.mul(builder.sext(w, _VW), builder.sext(x, _VW))
            return _add_fours(builder, wide)
        size = _x86(builder, "llvm.x86.avx2.psign.b", _VB, w, w)
        signed = _x86(builder, "llvm.x86.avx2.psign.b", _VB, x, w)
        if vnni():
            return _dot_vnni(builder, size, signed)
        return _dot_madd(builder, size, signed)

    return I32x8(w, xq, off), codegen


# -- int32 lanes -------------------------------------------------------------------------


@intrinsic
def lanes2(typingctx: Any, a: Any, b: Any) -> Any:
    """Lanes 0-3 ``a``, lanes 4-7 ``b`` (two int32): a per-16-values weight scale."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = ir.Constant(_VI, ir.Undefined)
        lo = context.cast(builder, args[0], sig.args[0], types.int32)
        hi = context.cast(builder, args[1], sig.args[1], types.int32)
        v = builder.insert_element(v, lo, ir.Constant(_I32, 0))
        v = builder.insert_element(v, hi, ir.Constant(_I32, 4))
        return builder.shuffle_vector(v, v, ir.Constant(_VI, [0, 0, 0, 0, 4, 4, 4, 4]))

    return I32x8(a, b), codegen


@intrinsic
def imul(typingctx: Any, a: Any, b: Any) -> Any:
    """``a * b`` lane by lane (int32, wrapping)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.mul(args[0], args[1])

    return I32x8(a, b), codegen


@intrinsic
def ivsub(typingctx: Any, a: Any, b: Any) -> Any:
    """``a - b`` lane by lane (int32)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.sub(args[0], args[1])

    return I32x8(a, b), codegen


@intrinsic
def prefetch(typingctx: Any, row: Any, off: Any) -> Any:
    """Ask for the cache line holding byte ``off`` of a ``uint8`` array (a hint: no fault,
    no effect on results)."""
    if not _is_array(row, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], _I8)
        fnty = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.prefetch.p0"
        )
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(row, off), codegen


# -- two float lanes: a block's scale and minimum together (Q4_1, Q5_1) --------------------

_V2 = ir.VectorType(ir.FloatType(), 2)


class F32x2Type(types.Type):
    """Two float32 lanes (half an SSE register)."""

    def __init__(self) -> None:
        super().__init__(name="F32x2")


F32x2 = F32x2Type()


@register_model(F32x2Type)
class _F32x2Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _V2)  # type: ignore[no-untyped-call]


@intrinsic
def half2(typingctx: Any, row: Any, off: Any) -> Any:
    """The two float16 at byte ``off`` of a ``uint8`` row as float32 lanes (one load, one
    ``vcvtph2ps``: a Q4_1/Q5_1 block's ``d`` and ``m``)."""
    if not _is_array(row, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        vty = ir.VectorType(ir.HalfType(), 2)
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], vty)
        return builder.fpext(builder.load(ptr, align=1), _V2)

    return F32x2(row, off), codegen


@intrinsic
def fload2(typingctx: Any, buf: Any, off: Any) -> Any:
    """The two float32 at byte ``off`` of a ``uint8`` buffer."""
    if not _is_array(buf, types.uint8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _byte_pointer(context, builder, sig.args[0], args[0], args[1], _V2)
        return builder.load(ptr, align=4)

    return F32x2(buf, off), codegen


@intrinsic
def mul2(typingctx: Any, a: Any, b: Any) -> Any:
    """``a * b`` lane by lane (two lanes)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fmul(args[0], args[1])

    return F32x2(a, b), codegen


@intrinsic
def lane(typingctx: Any, v: Any, i: Any) -> Any:
    """Lane ``i`` (a literal 0 or 1) of two."""
    if not isinstance(i, types.IntegerLiteral):
        return None
    index = i.literal_value

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.extract_element(args[0], ir.Constant(_I32, index))

    return types.float32(v, i), codegen


@intrinsic
def bsplat(typingctx: Any, n: Any) -> Any:
    """All 32 bytes ``n`` (an integer 0-255)."""
    if not isinstance(n, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _splat8(context, builder, args[0], sig.args[0])

    return U8x32(n), codegen
