"""Four-bit quants decoded by table lookup: sixteen nibbles to sixteen float32 in one permute.

A 4-bit format's value is one of sixteen floats per block (Q4_K: per 32-value sub-block):
``d * q + m`` for ``q = 0 .. 15``. Instead of widening each nibble to a float and
dequantizing it (an int-to-float conversion and a multiply or FMA per sixteen values),
the kernels compute the block's sixteen values once (one FMA on :func:`wiota`'s lanes
``0 .. 15``) and pick them with the nibbles (:func:`wlookup`: ``vpermps``,
a full-width permute whose indices are the nibbles themselves).

**The same bits**: lane ``k`` of a table is the float32 operation the decoders apply to a
nibble of value ``k`` (the same operation on the same operands: ``fmuladd(d, k, m)``), so
a value looked up is the value computed. Nothing is reordered.

The nibbles of sixteen bytes are widened to sixteen int32 lanes once for both lookups
that read them (a sub-block's low nibbles and the next one's high nibbles: one load, one
``vpmovzxbd``, the high lookup shifting the lanes), and ``vpermps`` reads only the low
four bits of each index.

Used for Q4_K only (:mod:`.groups`): 1.1x fewer cycles a weight at one activation row,
1.0-1.2x at eight (min of 6-8 rounds, load 1-3; docs/performance.md). Q4_0 and Q4_1
(``d * (k - 8)``, ``fmuladd(d, k, m)`` per 32-value block) gained 1.2x at one row but
lost 0.76-0.89x at eight (the decode into the tiles' buffer; min of 3 rounds, load 4-12),
so they keep their conversions.

``vpermps`` on sixteen lanes is AVX-512 (:func:`permutes`). Elsewhere :func:`wlookup`
lowers to sixteen scalar picks (correct, slow); the decoders that use it are chosen only
where :func:`permutes` holds, and keep their conversions elsewhere.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

from meshnode.engine.cpu.simd import F32x16, intrinsic
from meshnode.engine.cpu.simd_bytes import opaque, permutes

__all__ = ["permutes", "wiota", "wlookup"]

_I32 = ir.IntType(32)
_LANES = 16
_VI = ir.VectorType(_I32, _LANES)
_VF = ir.VectorType(ir.FloatType(), _LANES)
_BYTES = ir.VectorType(ir.IntType(8), _LANES)


@intrinsic
def wiota(typingctx: Any, first: Any) -> Any:
    """Lane ``k`` is ``first + k`` as a float32 (``first`` a literal integer; exact)."""
    if not isinstance(first, types.IntegerLiteral):
        return None
    start = first.literal_value

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return ir.Constant(_VF, [float(start + k) for k in range(_LANES)])

    return F32x16(first), codegen


def _permute(builder: Any, table: Any, index: Any) -> Any:
    if permutes():
        fnty = ir.FunctionType(_VF, [_VF, _VI])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.x86.avx512.permvar.sf.512"
        )
        return builder.call(fn, [table, index])
    out = ir.Constant(_VF, ir.Undefined)  # sixteen scalar picks
    for lane in range(_LANES):
        at = ir.Constant(_I32, lane)
        out = builder.insert_element(
            out, builder.extract_element(table, builder.extract_element(index, at)), at
        )
    return out


@intrinsic
def wlookup(typingctx: Any, table: Any, row: Any, off: Any, high: Any) -> Any:
    """Lane ``i`` is ``table[n]`` for ``n`` the low nibble (``high`` a literal False) or
    the high nibble (True) of ``row[off + i]`` (``row`` a ``uint8`` array)."""
    ok = isinstance(row, types.Array) and row.dtype == types.uint8 and row.layout == "C"
    if not (ok and table == F32x16 and isinstance(high, types.BooleanLiteral)):
        return None
    shift = 4 if high.literal_value else 0

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        ptr = builder.bitcast(builder.gep(data, [args[2]]), _BYTES.as_pointer())
        load = builder.load(ptr, align=1)
        # the weights never change while a product runs: a low and a high lookup of the
        # same bytes share one load and one widening (a shuffle), the high one shifting
        # the widened lanes (no mask: a byte's top nibble is below 16)
        load.set_metadata("invariant.load", builder.module.add_metadata([]))
        wide = builder.zext(load, _VI)
        if permutes():  # the lookups' code (elsewhere they are scalar picks, unused)
            wide = opaque(builder, wide)
        if shift:
            return _permute(builder, args[0], builder.lshr(wide, ir.Constant(_VI, [4] * _LANES)))
        return _permute(builder, args[0], builder.and_(wide, ir.Constant(_VI, [15] * _LANES)))

    return F32x16(table, row, off, high), codegen
