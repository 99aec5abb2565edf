"""The exponential, the maximum and the quotient over sixteen float32 lanes, for softmax.

numba compiles ``math.exp`` on a float32 to a call of the C library's ``expf``, one
value at a time: in the compiled attention (:mod:`.attention`) the softmax of a query
over 128 keys cost more than its two dot-product passes together. :func:`wexp` is
Cephes' ``expf`` as vector instructions (LLVM lowers them for the machine: one AVX-512
register, two AVX2 or four SSE/NEON ones):

- ``n = round(x log2 e)`` (adding and subtracting 1.5 * 2^23, which rounds to nearest),
- ``r = x - n ln 2`` with ln 2 in two parts (Cody and Waite: ``r`` exact to float32),
- ``e^r = 1 + r + r^2 p(r)`` with Cephes' degree-5 polynomial on ``|r| <= ln 2 / 2``,
- times ``2^n`` built from its exponent bits.

It is within 2 float32 units in the last place of the exact exponential, as NumPy's
``np.exp`` is (measured on 4 million values: 1 for this one, 2 for NumPy's;
``tests/engine/test_cpu_attention.py`` checks it) for ``-87.33 <= x <= 88.72``; below
that it is 0 (``e^x`` is then under the smallest normal
float32, 1.2e-38, which no softmax weight of a finite score can tell from 0), above it
``+inf``. NaN stays NaN.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

from meshnode.engine.cpu.simd import F32x16, intrinsic

__all__ = [
    "EXP_MAX",
    "EXP_MIN",
    "prefetch_f32",
    "wdiv",
    "wexp",
    "wexp_nonpositive",
    "wmax",
    "wmax_lane",
]

LANES = 16
# Where e^x is a normal float32: below EXP_MIN wexp is 0, above EXP_MAX +inf.
EXP_MIN = -87.33654475
EXP_MAX = 88.72283935
_LOG2E = 1.44269504088896341
_MAGIC = 12582912.0  # 1.5 * 2^23: x + MAGIC - MAGIC rounds x to an integer (|x| < 2^22)
_LN2_HI = 0.693359375  # ln 2 = _LN2_HI + _LN2_LO; _LN2_HI has 9 significant bits
_LN2_LO = -2.12194440e-4
# Cephes expf: e^r ~ 1 + r + r^2 (P0 r^5 + ... + P5) on |r| <= ln 2 / 2
_P = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)

_F = ir.FloatType()
_I32 = ir.IntType(32)
_VW = ir.VectorType(_F, LANES)
_VIW = ir.VectorType(_I32, LANES)


def _const(value: float) -> ir.Constant:
    return ir.Constant(_VW, [value] * LANES)


def _fma(builder: Any, a: Any, b: Any, c: Any) -> Any:
    fnty = ir.FunctionType(_VW, [_VW, _VW, _VW])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fmuladd.v16f32")  # type: ignore[no-untyped-call]
    return builder.call(fn, [a, b, c])


def _exp(builder: Any, x: Any, nonpositive: bool = False) -> Any:
    """The IR of :func:`wexp` on the ``<16 x float>`` value ``x`` (``nonpositive``: of
    :func:`wexp_nonpositive`, for ``x <= 0`` or NaN only)."""
    low = builder.fcmp_ordered("<", x, _const(EXP_MIN))
    # clamped so that n stays in -126 .. 128 (NaN passes through the selects and fmas)
    xc = builder.select(low, _const(EXP_MIN), x)
    if nonpositive:  # x <= 0: never above EXP_MAX, n <= 0
        return _scaled(builder, xc, low, None)
    high = builder.fcmp_ordered(">", x, _const(EXP_MAX))
    xc = builder.select(high, _const(EXP_MAX), xc)
    return _scaled(builder, xc, low, high)


def _scaled(builder: Any, xc: Any, low: Any, high: Any) -> Any:
    """:func:`_exp` from its clamped argument ``xc``, ``low`` and ``high`` its lanes below
    EXP_MIN and above EXP_MAX (``high`` None: none above, and n <= 0: the steps for
    n = 128 and the select of +inf left out, each a no-op there)."""
    n = builder.fsub(_fma(builder, xc, _const(_LOG2E), _const(_MAGIC)), _const(_MAGIC))
    r = _fma(builder, n, _const(-_LN2_HI), xc)
    r = _fma(builder, n, _const(-_LN2_LO), r)
    p = _const(_P[0])
    for c in _P[1:]:
        p = _fma(builder, p, r, _const(c))
    y = builder.fadd(_fma(builder, p, builder.fmul(r, r), r), _const(1.0))
    if high is not None:
        # 2^n as bits: n = 128 (only at EXP_MAX) would be +inf's exponent; use 2^127 * 2
        top = builder.fcmp_ordered(">", n, _const(127.0))
        n = builder.select(top, _const(127.0), n)
        y = builder.select(top, builder.fmul(y, _const(2.0)), y)
    bits = builder.shl(
        builder.add(builder.fptosi(n, _VIW), ir.Constant(_VIW, [127] * LANES)),
        ir.Constant(_VIW, [23] * LANES),
    )
    out = builder.fmul(y, builder.bitcast(bits, _VW))
    out = builder.select(low, _const(0.0), out)
    if high is None:
        return out
    return builder.select(high, _const(float("inf")), out)


@intrinsic
def wexp(typingctx: Any, v: Any) -> Any:
    """``e^v`` lane by lane (see the module's docstring for its accuracy and range)."""
    if v != F32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _exp(builder, args[0])

    return F32x16(v), codegen


@intrinsic
def wexp_nonpositive(typingctx: Any, v: Any) -> Any:
    """:func:`wexp` of lanes that are at most 0 (or NaN), the same bits, without its
    handling of large arguments (a softmax's ``s - max``: ~a fifth fewer instructions)."""
    if v != F32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _exp(builder, args[0], nonpositive=True)

    return F32x16(v), codegen


@intrinsic
def wmax(typingctx: Any, a: Any, b: Any) -> Any:
    """The larger of ``a`` and ``b`` lane by lane (``a`` where either is NaN)."""
    if a != F32x16 or b != F32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.select(builder.fcmp_ordered(">", args[1], args[0]), args[1], args[0])

    return F32x16(a, b), codegen


@intrinsic
def wmax_lane(typingctx: Any, v: Any) -> Any:
    """The largest of the sixteen lanes (halves, then quarters...), a float32."""
    if v != F32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        x = args[0]
        width = LANES
        while width > 1:
            width //= 2
            half = ir.VectorType(_I32, width)
            undef = ir.Constant(x.type, ir.Undefined)
            lo = builder.shuffle_vector(x, undef, ir.Constant(half, list(range(width))))
            hi = builder.shuffle_vector(x, undef, ir.Constant(half, list(range(width, 2 * width))))
            x = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
        return builder.extract_element(x, ir.Constant(_I32, 0))

    return types.float32(v), codegen


@intrinsic
def wdiv(typingctx: Any, a: Any, b: Any) -> Any:
    """``a / b`` lane by lane (correctly rounded, as a scalar division)."""
    if a != F32x16 or b != F32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fdiv(args[0], args[1])

    return F32x16(a, b), codegen


@intrinsic
def prefetch_f32(typingctx: Any, ary: Any, i: Any) -> Any:
    """Ask for the cache line holding element ``i`` of a float32 array (a hint: no fault,
    no effect on results; past the array's end it is harmless)."""
    if not (isinstance(ary, types.Array) and ary.dtype == types.float32 and ary.layout == "C"):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i8 = ir.IntType(8)
        ptr = builder.bitcast(builder.gep(data, [args[1]]), i8.as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [i8.as_pointer(), _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")  # type: ignore[no-untyped-call]
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(ary, i), codegen
