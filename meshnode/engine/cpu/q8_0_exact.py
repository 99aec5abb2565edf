"""The exact products' Q8_0 decoder for :mod:`.narrow`'s passes: each weight's float32 by an
integer add and one fused multiply-add, no conversion.

A Q8_0 weight is ``d * q`` (a float16 ``d`` a block of 32, an int8 ``q``), exact in float32
(at most 8 + 11 significant bits). The plain decoder (:func:`.wide._q8_0`) sign-extends
``q``, converts it (``vcvtdq2ps``) and multiplies by ``d``; on the Zen 3 that decode took
about 0.29 cycles a weight beside the 8-row tiles' 0.5 (``benchmarks/narrow_parts.py``).
Here the conversion is an integer add: ``C + q`` for ``C = 1.5 * 2**23`` is the float32 whose
bits are ``C``'s plus ``q`` (every value from ``C - 128`` to ``C + 127`` has the exponent of
``C``, ulp 1), and the weight is ``fma(C + q, d, -(C * d))``:

- ``C * d`` is exact (``C`` has two significant bits, ``d`` eleven), so ``-(C * d)`` is the
  exact negation, computed once a block;
- ``(C + q) * d - C * d`` is exactly ``q * d``, which float32 holds, so the fused
  multiply-add's one rounding returns it unchanged: the same float32 the plain decoder
  makes, bit for bit, for every finite ``d`` (``tests/engine/test_cpu_q8_0_exact.py``; a
  zero weight may come out +0 where the plain one is -0, which no FMA chain from +0 can
  tell apart). An infinite or NaN scale (no real file has one) gives NaN for every weight
  of its block where the plain decoder gives infinities for those with ``q != 0``.

``llvm.fma`` (never split into two roundings) makes the weight, not the products' own
``llvm.fmuladd``. 8 rows, 2048-value rows, in the L2: ~0.79 -> ~0.66 cycles a weight.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils

from meshnode.engine.cpu.simd import F32x8, intrinsic, vstore

__all__ = ["MAGIC", "decode_block", "magic8", "q8_0_block"]

#: ``1.5 * 2**23``: the float32 whose low mantissa bits take an int8 by an integer add
MAGIC = 12582912.0
_BYTES = 34  # a block: d (float16), then 32 int8

_VF = ir.VectorType(ir.FloatType(), 8)
_VI = ir.VectorType(ir.IntType(32), 8)
_VB = ir.VectorType(ir.IntType(8), 8)


def _is_bytes(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.uint8 and ty.layout == "C"


def _at(context: Any, builder: Any, sig: Any, args: Any, elem: Any) -> Any:
    # pointer to byte args[1] of the uint8 array args[0], as elem*
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    at = context.cast(builder, args[1], sig.args[1], types.int64)
    return builder.bitcast(builder.gep(data, [at]), elem.as_pointer())


@intrinsic
def magic8(typingctx: Any, row: Any, off: Any) -> Any:
    """The eight int8 ``q`` at byte ``off`` of a ``uint8`` row as the float32 ``MAGIC + q``
    (exact: ``q`` added to ``MAGIC``'s bits)."""
    if not _is_bytes(row):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        q = builder.sext(builder.load(_at(context, builder, sig, args, _VB), align=1), _VI)
        bits = builder.add(q, ir.Constant(_VI, [0x4B400000] * 8))  # MAGIC's bits
        return builder.bitcast(bits, _VF)

    return F32x8(row, off), codegen


@intrinsic
def _scales(typingctx: Any, row: Any, off: Any) -> Any:
    # the float16 d at byte off (off >= 0: no wraparound of negative indices) as float32
    # in all eight lanes, and -(MAGIC * d) likewise (exact)
    if not _is_bytes(row):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        half = builder.load(_at(context, builder, sig, args, ir.HalfType()), align=1)
        one = builder.fpext(half, ir.FloatType())
        undef = ir.Constant(_VF, ir.Undefined)
        v = builder.insert_element(undef, one, ir.Constant(ir.IntType(32), 0))
        d = builder.shuffle_vector(v, undef, ir.Constant(_VI, [0] * 8))
        neg = builder.fmul(d, ir.Constant(_VF, [-MAGIC] * 8))
        return context.make_tuple(builder, sig.return_type, [d, neg])

    return types.UniTuple(F32x8, 2)(row, off), codegen  # type: ignore[no-untyped-call]


@intrinsic
def _fused(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    # a * b + c with one rounding, always (llvm.fma: never split into two roundings)
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v8f32"
        )
        return builder.call(fn, list(args))

    return F32x8(a, b, c), codegen


@njit(inline="always")
def q8_0_block(row, c):  # type: ignore[no-untyped-def]
    """Block ``c`` of a Q8_0 ``row`` (bytes) as four eight-lane vectors, values ``0-7``,
    ``8-15``, ``16-23``, ``24-31``: :func:`.wide._q8_0`'s float32 (see the module)."""
    b = _BYTES * c
    d, neg = _scales(row, b)
    return (
        _fused(magic8(row, b + 2), d, neg),
        _fused(magic8(row, b + 10), d, neg),
        _fused(magic8(row, b + 18), d, neg),
        _fused(magic8(row, b + 26), d, neg),
    )


@njit(inline="always")
def decode_block(raw, o, w, j0, m, stride):  # type: ignore[no-untyped-def]
    """Values ``j0 .. j0 + m - 1`` (whole blocks) of the Q8_0 weight rows ``o .. o + 3``
    of ``raw`` into ``w[stride i ..]`` (row ``i``), :mod:`.narrow`'s decoded block."""
    for i in range(4):
        row = raw[o + i]
        for c in range(j0 // 32, (j0 + m) // 32):
            w0, w1, w2, w3 = q8_0_block(row, c)
            at = stride * i + 32 * c - j0
            vstore(w, at, w0)
            vstore(w, at + 8, w1)
            vstore(w, at + 16, w2)
            vstore(w, at + 24, w3)
