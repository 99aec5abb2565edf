"""Sixteen-lane loads and stores of a KV cache that is float32 or float16, for the
attention kernels (:mod:`.attention`, :mod:`.attention_rows`).

A CPU KV cache keeps its keys and values as float32 (the exact modes) or as float16
(``--kv-dtype f16``: half the bytes, which decode attention streams once per step). The
kernels see a float16 cache as its bit patterns, a ``uint16`` array, and these functions
take either kind of array: the same kernel source compiles once per kind, and only the
kind a stage uses is compiled. A float32 cache reads and writes as :func:`.simd.wload`
and :func:`.simd.wstore` do (the same instructions); a float16 one is widened to float32
on every read (exact; ``vcvtph2ps`` where the CPU has F16C) and rounded to nearest, ties
to even, on every write (as NumPy converts float32 to float16; ``vcvtps2ph``), so the
scores, the softmax and the weighted sums stay float32.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

from meshnode.engine.cpu.simd import F32x16, intrinsic

__all__ = ["kv_pointer", "line_of", "prefetch_kv", "wload_kv", "wstore_kv"]

_I32 = ir.IntType(32)
_VW = ir.VectorType(ir.FloatType(), 16)
_VH = ir.VectorType(ir.HalfType(), 16)
_VH16 = ir.VectorType(ir.IntType(16), 16)


def _is_kv(ty: Any) -> bool:
    """A KV cache as the kernels index it: a C-contiguous float32 or ``uint16`` array."""
    return (
        isinstance(ty, types.Array)
        and ty.dtype in (types.float32, types.uint16)
        and ty.layout == "C"
    )


def _element(context: Any, builder: Any, aryty: Any, ary: Any, index: Any, elem: Any) -> Any:
    """Pointer to element ``index`` of ``ary`` cast to ``elem*``."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [index]), elem.as_pointer())


@intrinsic
def wload_kv(typingctx: Any, ary: Any, i: Any) -> Any:
    """``ary[i : i + 16]`` of a KV cache as sixteen float32 lanes: a float32 array as
    stored, a ``uint16`` array's float16 bit patterns widened (exactly)."""
    if not _is_kv(ary):
        return None
    half = ary.dtype == types.uint16

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if not half:
            ptr = _element(context, builder, sig.args[0], args[0], args[1], _VW)
            return builder.load(ptr, align=4)
        ptr = _element(context, builder, sig.args[0], args[0], args[1], _VH16)
        bits = builder.load(ptr, align=2)
        return builder.fpext(builder.bitcast(bits, _VH), _VW)

    return F32x16(ary, i), codegen


@intrinsic
def wstore_kv(typingctx: Any, ary: Any, i: Any, v: Any) -> Any:
    """``ary[i : i + 16] = v`` into a KV cache: float32 as is, into a ``uint16`` array as
    float16 bit patterns rounded to nearest, ties to even (inf past 65504)."""
    if not _is_kv(ary):
        return None
    half = ary.dtype == types.uint16

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if not half:
            ptr = _element(context, builder, sig.args[0], args[0], args[1], _VW)
            builder.store(args[2], ptr, align=4)
        else:
            ptr = _element(context, builder, sig.args[0], args[0], args[1], _VH16)
            builder.store(builder.bitcast(builder.fptrunc(args[2], _VH), _VH16), ptr, align=2)
        return context.get_dummy_value()

    return types.none(ary, i, v), codegen


@intrinsic
def prefetch_kv(typingctx: Any, ary: Any, i: Any) -> Any:
    """Ask for the cache line holding element ``i`` of a KV cache (a hint: no fault, no
    effect on results; past the array's end it is harmless)."""
    if not _is_kv(ary):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i8 = ir.IntType(8)
        ptr = _element(context, builder, sig.args[0], args[0], args[1], i8)
        fnty = ir.FunctionType(ir.VoidType(), [i8.as_pointer(), _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")  # type: ignore[no-untyped-call]
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(ary, i), codegen


@intrinsic
def line_of(typingctx: Any, ary: Any) -> Any:
    """Elements of a KV cache per 64-byte cache line (16 float32, 32 float16): the step of
    loops that prefetch a line at a time. A constant of the array's type."""
    if not _is_kv(ary):
        return None
    per_line = 64 // (4 if ary.dtype == types.float32 else 2)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return ir.Constant(ir.IntType(64), per_line)

    return types.int64(ary), codegen


@intrinsic
def kv_pointer(typingctx: Any, address: Any, kind: Any) -> Any:
    """``address`` (an int64) as a pointer to elements of ``kind``'s type (a float32 or
    ``uint16`` scalar, its value unused), for ``numba.carray``: a KV cache seen through
    its address."""
    if kind not in (types.float32, types.uint16) or not isinstance(address, types.Integer):
        return None
    ptr = types.CPointer(kind)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        value = context.cast(builder, args[0], sig.args[0], types.int64)
        return builder.inttoptr(value, context.get_value_type(ptr))

    return ptr(address, kind), codegen
