"""Eight-lane vectors for the numba kernels, written as LLVM vector IR.

LLVM's loop vectorizer leaves the block decoders scalar (the loads are bytes at computed
offsets, the loops are short, and numba's arrays carry no aliasing facts), so the kernels
say what they mean: ``F32x8`` and ``I32x8`` are numba types whose values are LLVM
``<8 x float>`` and ``<8 x i32>`` registers, and each function here is one or a few vector
instructions. LLVM lowers them for the machine it compiles on (one AVX2 register, two SSE
or NEON registers), so nothing here is x86-specific.

Loads take an array and an element offset (bytes for ``uint8`` rows) and do no bounds
checks, like numba's own indexing; the callers keep offsets inside their blocks.
``vfma`` is ``llvm.fmuladd``: fused where the CPU has FMA, else a multiply and an add.

``F32x16`` (sixteen lanes: one AVX-512 register, two AVX2 ones) carries the quantized
formats' decoded values (:mod:`.wide` reads its bytes and bit fields) and the products'
accumulators: the wider vector halves the instructions per value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic as _numba_intrinsic
from numba.extending import models, register_model

__all__ = [
    "INNER",
    "F32x8",
    "F32x16",
    "I32x8",
    "entry",
    "inner",
    "ishl",
    "line_up",
    "lined",
    "load_bf16",
    "load_f16",
    "load_f32",
    "tofloat",
    "vadd",
    "vfma",
    "vload",
    "vsplat",
    "vstore",
    "vsum",
    "vzero",
    "wadd",
    "wfma",
    "wlane",
    "wload",
    "wmul",
    "wsplat",
    "wstore",
    "wsum",
    "wsums",
    "wzero",
]

LANES = 8


# numba's options for a function only compiled code calls: no Python and no C entry
# point, which would cost compile time at a first start and be used by nothing
INNER: Any = {"no_cpython_wrapper": True, "no_cfunc_wrapper": True}


def entry(**options: Any) -> Any:
    """``numba.njit(**options)`` for a function Python calls, cached on disk, without the C
    entry point (a ``cfunc`` wrapper) that nothing calls."""
    jit: Any = njit  # numba's stubs do not list no_cfunc_wrapper
    return jit(cache=True, no_cfunc_wrapper=True, **options)


def inner(fn: Any) -> Any:
    """``numba.njit`` for a function only compiled code calls (the kernels' helpers),
    cached on disk, with the options :data:`INNER`. Python cannot call it: without its
    entry point, numba would jump to a null address."""
    jit: Any = njit  # numba's stubs do not list these options
    return jit(cache=True, **INNER)(fn)


def intrinsic(typer: Any) -> Any:
    """numba's ``intrinsic``, typed ``Any`` so that jitted callers type-check (mypy sees
    the typer's signature, with its ``typingctx``, not the call's)."""
    return _numba_intrinsic(typer)


_F = ir.FloatType()
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F, LANES)
_VI = ir.VectorType(_I32, LANES)


class F32x8Type(types.Type):
    """Eight float32 lanes, one SIMD register (or two) in compiled code."""

    def __init__(self) -> None:
        super().__init__(name="F32x8")


class I32x8Type(types.Type):
    """Eight int32 lanes."""

    def __init__(self) -> None:
        super().__init__(name="I32x8")


class F32x16Type(types.Type):
    """Sixteen float32 lanes (the multi-row products)."""

    def __init__(self) -> None:
        super().__init__(name="F32x16")


F32x8 = F32x8Type()
I32x8 = I32x8Type()
F32x16 = F32x16Type()
_VW = ir.VectorType(_F, 2 * LANES)
_VIW = ir.VectorType(_I32, 2 * LANES)


@register_model(F32x8Type)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _VF)  # type: ignore[no-untyped-call]


@register_model(F32x16Type)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _VW)  # type: ignore[no-untyped-call]


@register_model(I32x8Type)
class _I32x8Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _VI)  # type: ignore[no-untyped-call]


# -- helpers for the code generators -----------------------------------------------------


def _pointer(context: Any, builder: Any, aryty: Any, ary: Any, index: Any, elem: Any) -> Any:
    """Pointer to element ``index`` of ``ary`` cast to ``elem*``."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [index]), elem.as_pointer())


def _splat(builder: Any, value: Any, vty: Any) -> Any:
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_VI, [0] * LANES))


def _i32(context: Any, builder: Any, value: Any, ty: Any) -> Any:
    return context.cast(builder, value, ty, types.int32)


def _is_array(ty: Any, dtype: Any) -> bool:
    # the loads and stores index the data pointer directly: C-contiguous arrays only
    return isinstance(ty, types.Array) and ty.dtype == dtype and ty.layout == "C"


# -- float lanes -------------------------------------------------------------------------


@intrinsic
def vzero(typingctx: Any) -> Any:
    """All lanes 0.0."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return ir.Constant(_VF, [0.0] * LANES)

    return F32x8(), codegen


@intrinsic
def vsplat(typingctx: Any, x: Any) -> Any:
    """All lanes ``x`` (a float32)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        return _splat(builder, value, _VF)

    return F32x8(x), codegen


@intrinsic
def vload(typingctx: Any, ary: Any, i: Any) -> Any:
    """``ary[i : i + 8]`` of a float32 array."""
    if not _is_array(ary, types.float32):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _pointer(context, builder, sig.args[0], args[0], args[1], _VF)
        return builder.load(ptr, align=4)

    return F32x8(ary, i), codegen


@intrinsic
def vstore(typingctx: Any, ary: Any, i: Any, v: Any) -> Any:
    """``ary[i : i + 8] = v`` for a float32 array."""
    if not _is_array(ary, types.float32):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _pointer(context, builder, sig.args[0], args[0], args[1], _VF)
        builder.store(args[2], ptr, align=4)
        return context.get_dummy_value()

    return types.none(ary, i, v), codegen


def _float_binary(op: str, doc: str) -> Any:
    def typer(typingctx: Any, a: Any, b: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return getattr(builder, op)(args[0], args[1])

        return F32x8(a, b), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


vadd = _float_binary("fadd", "``a + b`` lane by lane.")


@intrinsic
def vfma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` lane by lane, one rounding where the CPU fuses it (``llvm.fmuladd``)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fnty = ir.FunctionType(_VF, [_VF, _VF, _VF])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.fmuladd.v8f32"
        )
        return builder.call(fn, list(args))

    return F32x8(a, b, c), codegen


def _tree_sum(lanes: int) -> Any:
    """Codegen summing a vector of ``lanes`` float32: halves, then quarters, to one."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = args[0]
        width = lanes
        while width > 1:
            width //= 2
            half = ir.VectorType(_I32, width)
            undef = ir.Constant(v.type, ir.Undefined)
            lo = builder.shuffle_vector(v, undef, ir.Constant(half, list(range(width))))
            hi = builder.shuffle_vector(v, undef, ir.Constant(half, list(range(width, 2 * width))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return codegen


@intrinsic
def vsum(typingctx: Any, v: Any) -> Any:
    """The sum of the eight lanes (as a tree: halves, then quarters), a float32."""
    return types.float32(v), _tree_sum(LANES)


@intrinsic
def wzero(typingctx: Any) -> Any:
    """Sixteen lanes of 0.0."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return ir.Constant(_VW, [0.0] * 2 * LANES)

    return F32x16(), codegen


@intrinsic
def wload(typingctx: Any, ary: Any, i: Any) -> Any:
    """``ary[i : i + 16]`` of a float32 array."""
    if not _is_array(ary, types.float32):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _pointer(context, builder, sig.args[0], args[0], args[1], _VW)
        return builder.load(ptr, align=4)

    return F32x16(ary, i), codegen


@intrinsic
def wstore(typingctx: Any, ary: Any, i: Any, v: Any) -> Any:
    """``ary[i : i + 16] = v`` for a float32 array."""
    if not _is_array(ary, types.float32):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _pointer(context, builder, sig.args[0], args[0], args[1], _VW)
        builder.store(args[2], ptr, align=4)
        return context.get_dummy_value()

    return types.none(ary, i, v), codegen


@intrinsic
def wfma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` over sixteen lanes (``llvm.fmuladd``)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fnty = ir.FunctionType(_VW, [_VW, _VW, _VW])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.fmuladd.v16f32"
        )
        return builder.call(fn, list(args))

    return F32x16(a, b, c), codegen


@intrinsic
def wsum(typingctx: Any, v: Any) -> Any:
    """The sum of the sixteen lanes, as a tree (halves, then quarters...), a float32."""
    return types.float32(v), _tree_sum(2 * LANES)


def _pair_sums(builder: Any, a: Any, b: Any, width: int) -> Any:
    """Two vectors holding sums of groups of ``2 width`` lanes (each of 16 / (2 width)
    vectors) to one holding sums of groups of ``width`` lanes: ``a``'s groups, then ``b``'s."""
    groups = range(0, 2 * LANES, 2 * width)
    lo = [g + i for g in groups for i in range(width)]
    hi = [g + width + i for g in groups for i in range(width)]
    pick_lo = lo + [2 * LANES + i for i in lo]  # lanes of a, then of b
    pick_hi = hi + [2 * LANES + i for i in hi]
    mask = ir.VectorType(_I32, 2 * LANES)
    left = builder.shuffle_vector(a, b, ir.Constant(mask, pick_lo))
    right = builder.shuffle_vector(a, b, ir.Constant(mask, pick_hi))
    return builder.fadd(left, right)


@intrinsic
def wsums(typingctx: Any, vs: Any) -> Any:
    """A tuple of sixteen sixteen-lane vectors to one vector whose lane ``i`` is the sum of
    ``vs[i]``'s lanes, each summed as :func:`wsum` does (halves, then quarters...), all
    sixteen in 15 pairs of shuffles (sixteen ``wsum`` take 64)."""
    if not (isinstance(vs, types.UniTuple) and vs.count == 2 * LANES and vs.dtype == F32x16):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        level = list(cgutils.unpack_tuple(builder, args[0]))  # type: ignore[no-untyped-call]
        width = LANES
        while len(level) > 1:
            pairs = range(0, len(level), 2)
            level = [_pair_sums(builder, level[i], level[i + 1], width) for i in pairs]
            width //= 2
        return level[0]

    return F32x16(vs), codegen


@intrinsic
def wlane(typingctx: Any, v: Any, i: Any) -> Any:
    """Lane ``i`` of a sixteen-lane vector."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.extract_element(args[0], _i32(context, builder, args[1], sig.args[1]))

    return types.float32(v, i), codegen


@intrinsic
def wsplat(typingctx: Any, x: Any) -> Any:
    """All sixteen lanes ``x`` (a float32)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        undef = ir.Constant(_VW, ir.Undefined)
        one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, undef, ir.Constant(_VIW, [0] * 2 * LANES))

    return F32x16(x), codegen


def _wide_binary(op: str, doc: str) -> Any:
    def typer(typingctx: Any, a: Any, b: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return getattr(builder, op)(args[0], args[1])

        return F32x16(a, b), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


wadd = _wide_binary("fadd", "``a + b`` over sixteen lanes.")
wmul = _wide_binary("fmul", "``a * b`` over sixteen lanes.")


# -- loads from rows of bytes ------------------------------------------------------------


def _byte_load(elem: Any, convert: str, out: Any, doc: str) -> Any:
    """An intrinsic loading eight ``elem`` at a byte offset of a ``uint8`` row."""
    vty = ir.VectorType(elem, LANES)

    def typer(typingctx: Any, row: Any, off: Any) -> Any:
        if not _is_array(row, types.uint8):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            ptr = builder.bitcast(builder.gep(data, [args[1]]), vty.as_pointer())
            v = builder.load(ptr, align=1)
            if convert == "half":
                return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), LANES)), _VF)
            if convert == "bf16":  # bfloat16 is the top half of a float32
                sixteen = _splat(builder, ir.Constant(_I32, 16), _VI)
                wide = builder.shl(builder.zext(v, _VI), sixteen)
                return builder.bitcast(wide, _VF)
            return v  # float32 as stored

        return out(row, off), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


load_f16 = _byte_load(ir.IntType(16), "half", F32x8, "Eight float16 at ``off``, as float32.")
load_bf16 = _byte_load(ir.IntType(16), "bf16", F32x8, "Eight bfloat16 at ``off``, as float32.")
load_f32 = _byte_load(_F, "none", F32x8, "Eight float32 at byte ``off``.")


# -- integer lanes -----------------------------------------------------------------------


def _int_immediate(op: str, doc: str) -> Any:
    """An intrinsic ``op(v, n)`` with ``n`` a scalar applied to every lane."""

    def typer(typingctx: Any, v: Any, n: Any) -> Any:
        if not isinstance(n, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            scalar = _i32(context, builder, args[1], sig.args[1])
            return getattr(builder, op)(args[0], _splat(builder, scalar, _VI))

        return I32x8(v, n), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


ishl = _int_immediate("shl", "``v << n`` lane by lane.")


@intrinsic
def tofloat(typingctx: Any, v: Any) -> Any:
    """Signed int32 lanes to float32 (exact below 2**24)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.sitofp(args[0], _VF)

    return F32x8(v), codegen


@njit(inline="always")
def line_up(address):  # type: ignore[no-untyped-def]
    # ``address`` rounded up to a 64-byte cache line (at most 15 floats on)
    return (address + 63) & -64


@njit(inline="always")
def lined(n):  # type: ignore[no-untyped-def]
    # n float32 of scratch beginning on a 64-byte line. The scratch of the k-row passes
    # (:mod:`.narrow`'s decoded block and chains) is read as 32-byte vectors: where it began
    # 16 bytes into a line (NumPy's and numba's arrays are 16-byte aligned), every other
    # load straddled two lines, and an 8-row pass took ~1.1-1.2x as long (Q4_K, Q6_K,
    # benchmarks/narrow_parts.py --offsets 0 16; the activations' alignment is the
    # caller's, .matrix._lined: ~1.05x more; .kernels' products)
    buf = np.empty(n + 16, np.float32)
    at = (-(buf.ctypes.data // 4)) % 16
    return buf[at : at + n]
