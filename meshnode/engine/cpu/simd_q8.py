"""Vector operations of the 8-bit-activation kernels (:mod:`.q8_kernels`) whose lanes are
rows: activation rows in the multi-row tiles, weight rows for one activation row.

The multi-row tiles take two 32-value chunks of a weight row at once: ``U8x64`` holds
both chunks' quants unpacked to bytes (:func:`join64`), and :func:`dotw` multiplies the
four bytes of lane ``j`` of each chunk, copied to eight lanes each, with four int8
activations of eight rows (sixteen int32 lanes: the eight rows for chunk ``2 p``, then for
``2 p + 1``), one ``vpdpbusd`` on a 512-bit register where the CPU has AVX512-VNNI (the
same sums written generically elsewhere); :func:`dotw_small` (bytes of at most 128) and
:func:`dotw_signed` (Q8_0's int8 weights) take ``vpmaddubsw`` on each 256-bit half where
the CPU has AVX2 but not AVX512-VNNI, as :func:`.simd_int.dot4s` does. The one-row kernel
sums the eight int32 lanes of eight weight rows' :func:`.simd_int.dot4` into one lane each
(:func:`isums`; integer sums are exact, so any order gives the same bits) and keeps eight
weight rows in the lanes of :data:`.simd.F32x8`. Loads take a ``uint8`` buffer and a byte
offset and do no bounds checks.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import models, register_model

from meshnode.engine.cpu.simd import F32x8, F32x16, I32x8, intrinsic
from meshnode.engine.cpu.simd_int import U8x32, _dot_madd, madd_bytes

__all__ = [
    "I32x16",
    "U8x64",
    "absmax32",
    "bstore",
    "bsum16",
    "dotw",
    "dotw_signed",
    "dotw_small",
    "fload8",
    "fload16",
    "fold",
    "hpairs",
    "iadd16",
    "iload16",
    "imul16",
    "ipair",
    "ishl16",
    "isums",
    "join64",
    "lane8",
    "nonfinite32",
    "quant32",
    "read_only",
    "store16",
    "tofloat16",
    "vec8",
    "vmul",
    "vnni512",
    "wpair",
]

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_F = ir.FloatType()
_VB = ir.VectorType(_I8, 32)
_VI = ir.VectorType(_I32, 8)
_VF = ir.VectorType(_F, 8)
_VW = ir.VectorType(_I32, 32)
_VB64 = ir.VectorType(_I8, 64)
_VI16 = ir.VectorType(_I32, 16)
_VF16 = ir.VectorType(_F, 16)
_VW64 = ir.VectorType(_I32, 64)


def _is_bytes(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.uint8 and ty.layout == "C"


def _pointer(context: Any, builder: Any, aryty: Any, ary: Any, off: Any, vty: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [off]), vty.as_pointer())


def _vector_load(vty: Any, result: Any, doc: str) -> Any:
    # the intrinsic load(buf, off) -> result: the vector vty at byte off of a uint8 buffer,
    # aligned to 4 bytes (one per vector type: fload8, iload16, fload16, simd_tile.wload)
    def typer(typingctx: Any, buf: Any, off: Any) -> Any:
        if not _is_bytes(buf):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = _pointer(context, builder, sig.args[0], args[0], args[1], vty)
            return builder.load(ptr, align=4)

        return result(buf, off), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


fload8 = _vector_load(
    _VF, F32x8, "Eight float32 at byte ``off`` of a ``uint8`` buffer (``off`` a multiple of 4)."
)


@intrinsic
def vmul(typingctx: Any, a: Any, b: Any) -> Any:
    """``a * b`` lane by lane (eight float32)."""
    if a != F32x8 or b != F32x8:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fmul(args[0], args[1])

    return F32x8(a, b), codegen


@intrinsic
def lane8(typingctx: Any, v: Any, i: Any) -> Any:
    """Lane ``i`` of eight float32."""
    if v != F32x8 or not isinstance(i, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        index = context.cast(builder, args[1], sig.args[1], types.int32)
        return builder.extract_element(args[0], index)

    return types.float32(v, i), codegen


@intrinsic
def vec8(typingctx: Any, vs: Any) -> Any:
    """A tuple of eight float32 as the eight lanes of a vector."""
    if not (isinstance(vs, types.UniTuple) and vs.count == 8 and vs.dtype == types.float32):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = ir.Constant(_VF, ir.Undefined)
        for i, x in enumerate(cgutils.unpack_tuple(builder, args[0])):  # type: ignore[no-untyped-call]
            v = builder.insert_element(v, x, ir.Constant(_I32, i))
        return v

    return F32x8(vs), codegen


@intrinsic
def isums(typingctx: Any, vs: Any) -> Any:
    """A tuple of eight int32 vectors to one whose lane ``i`` is the sum of ``vs[i]``'s
    lanes (exact: integer sums do not depend on their order)."""
    if not (isinstance(vs, types.UniTuple) and vs.count == 8 and vs.dtype == I32x8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        level = list(cgutils.unpack_tuple(builder, args[0]))  # type: ignore[no-untyped-call]
        width = 4  # each vector: groups of 2 width lanes, one group per input vector
        while len(level) > 1:
            groups = range(0, 8, 2 * width)
            lo = [g + i for g in groups for i in range(width)]
            hi = [g + width + i for g in groups for i in range(width)]
            nxt = []
            for a, b in zip(level[0::2], level[1::2], strict=True):
                left = builder.shuffle_vector(a, b, ir.Constant(_VI, lo + [8 + i for i in lo]))
                right = builder.shuffle_vector(a, b, ir.Constant(_VI, hi + [8 + i for i in hi]))
                nxt.append(builder.add(left, right))
            level, width = nxt, width // 2
        return level[0]

    return I32x8(vs), codegen


class U8x64Type(types.Type):
    """Sixty-four bytes, one AVX-512 register."""

    def __init__(self) -> None:
        super().__init__(name="U8x64")


class I32x16Type(types.Type):
    """Sixteen int32 lanes."""

    def __init__(self) -> None:
        super().__init__(name="I32x16")


U8x64 = U8x64Type()
I32x16 = I32x16Type()


@register_model(U8x64Type)
class _U8x64Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _VB64)  # type: ignore[no-untyped-call]


@register_model(I32x16Type)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _VI16)  # type: ignore[no-untyped-call]


@cache
def vnni512() -> bool:
    """Whether this CPU has ``vpdpbusd`` on 512-bit registers (AVX512-VNNI)."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    return bool(features.get("avx512vnni")) and bool(features.get("avx512f"))


def _spread(builder: Any, parts: list[Any], pattern: list[int]) -> Any:
    # the float32 scalars ``parts`` into the sixteen lanes that ``pattern`` picks
    v = ir.Constant(_VF16, ir.Undefined)
    for i, part in enumerate(parts):
        v = builder.insert_element(v, part, ir.Constant(_I32, i))
    return builder.shuffle_vector(v, v, ir.Constant(_VI16, pattern))


@intrinsic
def join64(typingctx: Any, a: Any, b: Any) -> Any:
    """``a`` (bytes 0-31) then ``b`` (bytes 32-63)."""
    if a != U8x32 or b != U8x32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.shuffle_vector(args[0], args[1], ir.Constant(_VW64, list(range(64))))

    return U8x64(a, b), codegen


iload16 = _vector_load(
    _VI16, I32x16, "Sixteen int32 at byte ``off`` of a ``uint8`` buffer (``off`` a multiple of 4)."
)
fload16 = _vector_load(
    _VF16,
    F32x16,
    "Sixteen float32 at byte ``off`` of a ``uint8`` buffer (``off`` a multiple of 4).",
)


@intrinsic
def tofloat16(typingctx: Any, v: Any) -> Any:
    """Signed int32 lanes to float32 (exact below 2**24)."""
    if v != I32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.sitofp(args[0], _VF16)

    return F32x16(v), codegen


def _dot_generic(builder: Any, acc: Any, u: Any, x: Any, signed: bool = False) -> Any:
    # signed: the int8 u - 128 (given as u) times x
    if signed:
        w = builder.sext(builder.xor(u, ir.Constant(_VB64, [128] * 64)), _VW64)
    else:
        w = builder.zext(u, _VW64)
    wide = builder.mul(w, builder.sext(x, _VW64))  # exact: |u x| < 2**15
    v = wide
    for width in (32, 16):  # add neighbours twice: lane j sums bytes 4j .. 4j + 3
        half = ir.VectorType(_I32, width)
        undef = ir.Constant(v.type, ir.Undefined)
        even = builder.shuffle_vector(v, undef, ir.Constant(half, list(range(0, 2 * width, 2))))
        odd = builder.shuffle_vector(v, undef, ir.Constant(half, list(range(1, 2 * width, 2))))
        v = builder.add(even, odd)
    return builder.add(acc, v)


def _dot_vnni(builder: Any, acc: Any, u: Any, x: Any) -> Any:
    fnty = ir.FunctionType(_VI16, [_VI16, _VI16, _VI16])
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512"
    )
    return builder.call(fn, [acc, builder.bitcast(u, _VI16), builder.bitcast(x, _VI16)])


def _dot_halves(builder: Any, acc: Any, u: Any, x: Any, signed: bool) -> Any:
    # acc + the sums of _dot_generic for bytes u of at most 128 (signed: for the int8
    # u - 128, given as u) where the CPU has AVX2 but not AVX512-VNNI: each 256-bit half
    # by vpmaddubsw and vpmaddwd (.simd_int.dot4s; signed: |w| times x given w's sign,
    # .simd_int.sdot4), exact
    undef = ir.Constant(_VB64, ir.Undefined)
    halves = []
    for h in range(2):
        pick = ir.Constant(_VW, list(range(32 * h, 32 * h + 32)))
        w, xh = builder.shuffle_vector(u, undef, pick), builder.shuffle_vector(x, undef, pick)
        if signed:
            w = builder.xor(w, ir.Constant(_VB, [128] * 32))
            w, xh = _psign(builder, w, w), _psign(builder, xh, w)
        halves.append(_dot_madd(builder, w, xh))
    return builder.add(
        acc, builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI16, list(range(16))))
    )


def _psign(builder: Any, v: Any, s: Any) -> Any:
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, ir.FunctionType(_VB, [_VB, _VB]), "llvm.x86.avx2.psign.b"
    )
    return builder.call(fn, [v, s])


def _dotw(kind: str, doc: str) -> Any:
    def typer(typingctx: Any, acc: Any, u: Any, j: Any, xq: Any, off: Any) -> Any:
        ok = acc == I32x16 and u == U8x64 and _is_bytes(xq)
        if not ok or not isinstance(j, types.IntegerLiteral):
            return None
        lane = j.literal_value

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            words = builder.bitcast(args[1], _VI16)
            pick = ir.Constant(_VI16, [lane] * 8 + [8 + lane] * 8)
            w = builder.bitcast(builder.shuffle_vector(words, words, pick), _VB64)
            ptr = _pointer(context, builder, sig.args[3], args[3], args[4], _VB64)
            x = builder.load(ptr, align=1)
            if kind == "any" or vnni512():
                if kind == "signed" and vnni512():  # vpdpbusd of u, less 128 sum(x)
                    ones = ir.Constant(_VB64, [128] * 64)
                    minus = _dot_vnni(builder, ir.Constant(_VI16, [0] * 16), ones, x)
                    return builder.sub(_dot_vnni(builder, args[0], w, x), minus)
                return (_dot_vnni if vnni512() else _dot_generic)(builder, args[0], w, x)
            if madd_bytes():
                return _dot_halves(builder, args[0], w, x, kind == "signed")
            return _dot_generic(builder, args[0], w, x, kind == "signed")

        return I32x16(acc, u, j, xq, off), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


dotw = _dotw(
    "any",
    """``acc`` plus, in lane ``8 h + r`` (``h`` 0, 1), the sum over ``i < 4`` of
    ``u[32 h + 4 j + i]`` (unsigned; ``j`` a literal 0 .. 7) times the int8 at byte
    ``off + 32 h + 4 r + i`` of ``xq`` (a ``uint8`` buffer): exact int32.""",
)
dotw_small = _dotw(
    "small",
    """:func:`dotw` for bytes ``u`` of at most 128 (every format's but Q8_0's): the same
    sums, by ``vpmaddubsw`` where the CPU has AVX2 but not AVX512-VNNI.""",
)
dotw_signed = _dotw(
    "signed",
    """:func:`dotw` of the int8 weights ``u - 128`` (Q8_0's, given as its bytes ``u``):
    the same sums less ``128`` times the activations' (so no offset term), by
    ``vpsignb`` and ``vpmaddubsw`` where the CPU has AVX2 but not AVX512-VNNI.""",
)


def _int16_binary(op: str, doc: str) -> Any:
    def typer(typingctx: Any, a: Any, b: Any) -> Any:
        if a != I32x16 or b != I32x16:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return getattr(builder, op)(args[0], args[1])

        return I32x16(a, b), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


iadd16 = _int16_binary("add", "``a + b`` lane by lane (sixteen int32).")
imul16 = _int16_binary("mul", "``a * b`` lane by lane (sixteen int32, wrapping).")


@intrinsic
def ipair(typingctx: Any, a: Any, b: Any) -> Any:
    """Lanes 0-7 ``a``, lanes 8-15 ``b`` (int32)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = ir.Constant(_VI16, ir.Undefined)
        for i, (x, t) in enumerate(zip(args, sig.args, strict=True)):
            v = builder.insert_element(
                v, context.cast(builder, x, t, types.int32), ir.Constant(_I32, i)
            )
        return builder.shuffle_vector(v, v, ir.Constant(_VI16, [0] * 8 + [1] * 8))

    return I32x16(a, b), codegen


@intrinsic
def fold(typingctx: Any, v: Any) -> Any:
    """Lanes 0-7 plus lanes 8-15 of sixteen float32: eight lanes."""
    if v != F32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        undef = ir.Constant(_VF16, ir.Undefined)
        lo = builder.shuffle_vector(args[0], undef, ir.Constant(_VI, list(range(8))))
        hi = builder.shuffle_vector(args[0], undef, ir.Constant(_VI, list(range(8, 16))))
        return builder.fadd(lo, hi)

    return F32x8(v), codegen


@intrinsic
def wpair(typingctx: Any, a: Any, b: Any) -> Any:
    """Lanes 0-7 ``a``, lanes 8-15 ``b`` (float32): a scale per 32-value chunk."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        parts = [
            context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args, strict=True)
        ]
        return _spread(builder, parts, [0] * 8 + [1] * 8)

    return F32x16(a, b), codegen


@intrinsic
def store16(typingctx: Any, buf: Any, off: Any, v: Any) -> Any:
    """Sixteen int32 ``v`` to byte ``off`` of a ``uint8`` buffer."""
    if not _is_bytes(buf) or v != I32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.store(
            args[2], _pointer(context, builder, sig.args[0], args[0], args[1], _VI16), align=4
        )
        return context.get_dummy_value()

    return types.none(buf, off, v), codegen


# -- the quantizer: a 32-value block of float32 activations to int8 -----------------------

_VF32 = ir.VectorType(_F, 32)


def _block32(context: Any, builder: Any, sig: Any, args: Any) -> Any:
    # the 32 float32 at element args[1] of the float32 array args[0]
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    ptr = builder.bitcast(builder.gep(data, [args[1]]), _VF32.as_pointer())
    return builder.load(ptr, align=4)


def _is_floats(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.float32 and ty.layout == "C"


@intrinsic
def nonfinite32(typingctx: Any, x: Any, off: Any) -> Any:
    """Whether one of the 32 float32 at element ``off`` of ``x`` is inf or nan (all
    exponent bits set)."""
    if not _is_floats(x):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        bits = builder.bitcast(_block32(context, builder, sig, args), _VW)
        top = ir.Constant(_VW, [0x7F800000] * 32)
        hit = builder.icmp_unsigned("==", builder.and_(bits, top), top)
        word = builder.bitcast(hit, ir.IntType(32))
        return builder.icmp_unsigned("!=", word, ir.Constant(ir.IntType(32), 0))

    return types.boolean(x, off), codegen


@intrinsic
def absmax32(typingctx: Any, x: Any, off: Any) -> Any:
    """``max |x[off : off + 32]|`` (float32; the values finite: :func:`nonfinite32`)."""
    if not _is_floats(x):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        bits = builder.bitcast(_block32(context, builder, sig, args), _VW)
        v = builder.bitcast(builder.and_(bits, ir.Constant(_VW, [0x7FFFFFFF] * 32)), _VF32)
        width = 32
        while width > 1:  # a max is exact: any order gives the same value
            width //= 2
            vty = ir.VectorType(_I32, width)
            lo = builder.shuffle_vector(v, v, ir.Constant(vty, list(range(width))))
            hi = builder.shuffle_vector(v, v, ir.Constant(vty, list(range(width, 2 * width))))
            v = builder.select(builder.fcmp_ordered(">", lo, hi), lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(x, off), codegen


@intrinsic
def quant32(typingctx: Any, x: Any, off: Any, inv: Any) -> Any:
    """The 32 float32 at element ``off`` of ``x`` times ``inv`` (a float32), rounded to
    the nearest integer (ties to even, as ``round``), as int8 bytes (``|x inv| <= 127``)."""
    if not _is_floats(x) or inv != types.float32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = _block32(context, builder, sig, args)
        undef = ir.Constant(_VF32, ir.Undefined)
        one = builder.insert_element(undef, args[2], ir.Constant(_I32, 0))
        scaled = builder.fmul(v, builder.shuffle_vector(one, undef, ir.Constant(_VW, [0] * 32)))
        rint = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(_VF32, [_VF32]), "llvm.rint.v32f32"
        )
        return builder.trunc(builder.fptosi(builder.call(rint, [scaled]), _VW), _VB)

    return U8x32(x, off, inv), codegen


@intrinsic
def bstore(typingctx: Any, buf: Any, off: Any, v: Any) -> Any:
    """The 32 bytes ``v`` to byte ``off`` of a ``uint8`` buffer."""
    if not _is_bytes(buf) or v != U8x32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _pointer(context, builder, sig.args[0], args[0], args[1], _VB)
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()

    return types.none(buf, off, v), codegen


@intrinsic
def bsum16(typingctx: Any, v: Any, h: Any) -> Any:
    """The sum of bytes ``16 h .. 16 h + 15`` of ``v`` as int8 (``h`` a literal 0 or 1):
    an int32."""
    if v != U8x32 or not isinstance(h, types.IntegerLiteral):
        return None
    first = 16 * h.literal_value

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        half = builder.shuffle_vector(
            args[0], args[0], ir.Constant(_VI16, list(range(first, first + 16)))
        )
        wide = builder.sext(half, _VI16)
        add = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(_I32, [_VI16]), "llvm.vector.reduce.add.v16i32"
        )
        return builder.call(add, [wide])

    return types.int32(v, h), codegen


@intrinsic
def ishl16(typingctx: Any, v: Any, n: Any) -> Any:
    """``v << n`` lane by lane (sixteen int32; ``n`` an integer, the same for all)."""
    if v != I32x16 or not isinstance(n, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        count = context.cast(builder, args[1], sig.args[1], types.int32)
        one = builder.insert_element(ir.Constant(_VI16, ir.Undefined), count, ir.Constant(_I32, 0))
        return builder.shl(args[0], builder.shuffle_vector(one, one, ir.Constant(_VI16, [0] * 16)))

    return I32x16(v, n), codegen


@intrinsic
def hpairs(typingctx: Any, w: Any, o0: Any, o1: Any) -> Any:
    """The float16 pairs at bytes ``o0`` and ``o1`` of a ``uint8`` row, ``(a0, b0)`` and
    ``(a1, b1)`` (two blocks' scale and minimum), as float32 (exact, one conversion for
    the four): ``(wpair(a0, a1), wpair(b0, b1))``."""
    if not _is_bytes(w):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        words = ir.Constant(ir.VectorType(_I32, 2), ir.Undefined)
        for i, off in enumerate(args[1:]):
            ptr = _pointer(context, builder, sig.args[0], args[0], off, _I32)
            word = builder.load(ptr, align=1)
            words = builder.insert_element(words, word, ir.Constant(_I32, i))
        halves = builder.bitcast(words, ir.VectorType(ir.HalfType(), 4))  # a0 b0 a1 b1
        f = builder.fpext(halves, ir.VectorType(_F, 4))
        a = builder.shuffle_vector(f, f, ir.Constant(_VI16, [0] * 8 + [2] * 8))
        b = builder.shuffle_vector(f, f, ir.Constant(_VI16, [1] * 8 + [3] * 8))
        return context.make_tuple(builder, sig.return_type, (a, b))

    return types.UniTuple(F32x16, 2)(w, o0, o1), codegen  # type: ignore[no-untyped-call]


@intrinsic
def read_only(typingctx: Any, ary: Any) -> Any:
    """The same array typed read-only, as memory-mapped weights are (so that the pool's
    chunks and the serial products share one compiled kernel per format)."""
    if not isinstance(ary, types.Array):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return impl_ret_borrowed(context, builder, sig.return_type, args[0])  # type: ignore[no-untyped-call]

    return ary.copy(readonly=True)(ary), codegen
