"""Atomics, a spin-wait hint, raw pointers and indirect calls for the numba kernels.

What :mod:`.pool`'s threads share is one ``int64`` array: these functions read and write
its words atomically (``load``/``store`` sequentially consistent, ``cas`` a
compare-and-swap, ``fetch_add``), ``pause`` is the CPU's spin-wait hint (x86's
``pause``; nothing elsewhere), ``ptr_*`` turn an address into a typed pointer for
``numba.carray``, and ``call3`` calls a C function ``void f(int64, int64, int64)`` by its
address (a compiled ``cfunc``: one chunk of one product); ``cycles`` reads the x86 time
stamp counter (the pool's hand-off counts).
"""

from __future__ import annotations

import platform
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

from meshnode.engine.cpu.simd import intrinsic

__all__ = [
    "call3",
    "cas",
    "cycles",
    "fetch_add",
    "load",
    "pause",
    "ptr_f32",
    "ptr_i64",
    "ptr_u8",
    "store",
]

_I64 = ir.IntType(64)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _word(context: Any, builder: Any, aryty: Any, ary: Any, index: Any) -> Any:
    """Pointer to the int64 ``ary[index]`` (no bounds check)."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.gep(data, [index])


def _is_words(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.int64 and ty.layout == "C"


@intrinsic
def load(typingctx: Any, ary: Any, i: Any) -> Any:
    """``ary[i]`` of an int64 array, read atomically (sequentially consistent)."""
    if not _is_words(ary):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _word(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return types.int64(ary, i), codegen


@intrinsic
def store(typingctx: Any, ary: Any, i: Any, v: Any) -> Any:
    """``ary[i] = v`` for an int64 array, written atomically (sequentially consistent:
    the stores before it are visible to whoever reads this one)."""
    if not _is_words(ary):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _word(context, builder, sig.args[0], args[0], args[1])
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(value, ptr, "seq_cst", 8)
        return context.get_dummy_value()

    return types.none(ary, i, v), codegen


@intrinsic
def fetch_add(typingctx: Any, ary: Any, i: Any, v: Any) -> Any:
    """``ary[i] += v`` atomically; the value before."""
    if not _is_words(ary):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _word(context, builder, sig.args[0], args[0], args[1])
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, value, "seq_cst")

    return types.int64(ary, i, v), codegen


@intrinsic
def cas(typingctx: Any, ary: Any, i: Any, old: Any, new: Any) -> Any:
    """If ``ary[i] == old``, set it to ``new``; whether it did (atomically)."""
    if not _is_words(ary):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _word(context, builder, sig.args[0], args[0], args[1])
        expect = context.cast(builder, args[2], sig.args[2], types.int64)
        value = context.cast(builder, args[3], sig.args[3], types.int64)
        pair = builder.cmpxchg(ptr, expect, value, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return types.boolean(ary, i, old, new), codegen


@intrinsic
def pause(typingctx: Any) -> Any:
    """The CPU's spin-wait hint (x86 ``pause``: the spinning core yields to its sibling
    and does not flood the memory order buffer); nothing on other machines."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
                builder.module, fnty, "llvm.x86.sse2.pause"
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def cycles(typingctx: Any) -> Any:
    """The x86 time stamp counter (``rdtsc``: a constant rate on the CPUs that advertise
    ``constant_tsc``, the same on every core), as an int64; 0 on other machines, whose
    cycle counters may trap in user mode."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if not _X86:
            return ir.Constant(_I64, 0)
        fnty = ir.FunctionType(_I64, [])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.readcyclecounter"
        )
        return builder.call(fn, [])

    return types.int64(), codegen


def _pointer_to(elem: Any) -> Any:
    def typer(typingctx: Any, addr: Any) -> Any:
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            value = context.cast(builder, args[0], sig.args[0], types.int64)
            return builder.inttoptr(value, context.get_value_type(elem).as_pointer())

        return types.CPointer(elem)(addr), codegen  # type: ignore[no-untyped-call]

    typer.__doc__ = f"The address ``addr`` as a ``{elem}*`` (for ``numba.carray``)."
    return intrinsic(typer)


ptr_u8 = _pointer_to(types.uint8)
ptr_f32 = _pointer_to(types.float32)
ptr_i64 = _pointer_to(types.int64)


@intrinsic
def call3(typingctx: Any, fn: Any, a: Any, b: Any, c: Any) -> Any:
    """Call the C function at address ``fn``, ``void f(int64 a, int64 b, int64 c)``."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fnty = ir.FunctionType(ir.VoidType(), [_I64, _I64, _I64])
        pairs = zip(args, sig.args, strict=True)
        values = [context.cast(builder, v, t, types.int64) for v, t in pairs]
        target = builder.inttoptr(values[0], fnty.as_pointer())
        builder.call(target, values[1:])
        return context.get_dummy_value()

    return types.none(fn, a, b, c), codegen
