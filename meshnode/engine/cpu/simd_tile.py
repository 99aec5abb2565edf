"""Vector operations of the 8-bit-activation tiles (:mod:`.q8_tiles`), whose sixteen lanes
are sixteen weight rows: each weight row's four bytes ``j`` of a chunk sit in one int32
lane (:data:`.simd_q8.U8x64`, loaded from the tile's unpacked scratch), and one activation
row's four int8 ``j`` are copied to every lane (:func:`dotb`: one ``vpdpbusd`` with a
broadcast memory operand where the CPU has AVX512-VNNI; where it has AVX2 only, a
``vpmaddubsw`` and a ``vpmaddwd`` per 32 bytes, as llama.cpp's AVX2 kernels, exact: every
format's unpacked bytes but Q8_0's stay at most 128, so two products' int16 sum cannot
saturate, and Q8_0's are split into their low seven bits and their top bit; the same sums
generically elsewhere, which LLVM widened to 16 bits and summed with ``vphaddd``, about
five times the instructions). Loads and stores take a ``uint8`` buffer and a byte offset
and do no bounds checks.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types

from meshnode.engine.cpu.simd import F32x16, intrinsic
from meshnode.engine.cpu.simd_int import U8x32, madd_bytes
from meshnode.engine.cpu.simd_q8 import (  # the IR types and helpers of its 512-bit lanes
    _F,
    _I32,
    _VB64,
    _VF16,
    _VI,
    _VI16,
    I32x16,
    U8x64,
    _dot_generic,
    _dot_halves,
    _dot_vnni,
    _is_bytes,
    _pointer,
    _vector_load,
    vnni512,
)

__all__ = ["dotb", "fsplat16", "isplat16", "lane16", "put4", "wload", "words8"]


def _small_bytes(fmt: Any) -> bool:
    """Whether every unpacked byte of format ``fmt`` (a literal kernel id) is at most 128:
    all but Q8_0's (:data:`.q8_blocks.SIGNED_BYTES`)."""
    from meshnode.engine.cpu.blocks import literal_format
    from meshnode.engine.cpu.q8_blocks import SIGNED_BYTES

    return not SIGNED_BYTES[literal_format(fmt)]


def _dot_avx2(builder: Any, acc: Any, u: Any, x: Any, small: bool) -> Any:
    # acc + the exact sums by vpmaddubsw halves (.simd_q8): bytes of at most 128 in one
    # pass; larger ones (Q8_0's) as their low seven bits and their top bit, a pass each
    if small:
        return _dot_halves(builder, acc, u, x, False)
    low = builder.and_(u, ir.Constant(_VB64, [127] * 64))
    top = builder.and_(u, ir.Constant(_VB64, [128] * 64))
    return _dot_halves(builder, _dot_halves(builder, acc, low, x, False), top, x, False)


def _splat(builder: Any, x: Any, vty: Any) -> Any:
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_VI16, [0] * 16))


wload = _vector_load(_VB64, U8x64, "The 64 bytes at byte ``off`` of a ``uint8`` buffer.")


@intrinsic
def dotb(typingctx: Any, acc: Any, u: Any, xq: Any, off: Any, fmt: Any) -> Any:
    """``acc`` plus, in each lane ``i``, the sum over ``b < 4`` of ``u[4 i + b]``
    (unsigned) times the int8 at byte ``off + b`` of ``xq`` (a ``uint8`` buffer): exact
    int32. ``fmt``: the literal kernel id of the format ``u`` was unpacked from."""
    if acc != I32x16 or u != U8x64 or not _is_bytes(xq):
        return None
    small = _small_bytes(fmt)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _pointer(context, builder, sig.args[2], args[2], args[3], _I32)
        x = builder.bitcast(_splat(builder, builder.load(ptr, align=1), _VI16), _VB64)
        if vnni512():
            return _dot_vnni(builder, args[0], args[1], x)
        if madd_bytes():
            return _dot_avx2(builder, args[0], args[1], x, small)
        return _dot_generic(builder, args[0], args[1], x)

    return I32x16(acc, u, xq, off, fmt), codegen


def _splat_load(ty: Any, vty: Any, result: Any, doc: str) -> Any:
    def typer(typingctx: Any, buf: Any, off: Any) -> Any:
        if not _is_bytes(buf):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            x = builder.load(_pointer(context, builder, sig.args[0], args[0], args[1], ty), align=4)
            return _splat(builder, x, vty)

        return result(buf, off), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


fsplat16 = _splat_load(
    _F, _VF16, F32x16, "The float32 at byte ``off`` of a ``uint8`` buffer, in sixteen lanes."
)
isplat16 = _splat_load(
    _I32, _VI16, I32x16, "The int32 at byte ``off`` of a ``uint8`` buffer, in sixteen lanes."
)


@intrinsic
def lane16(typingctx: Any, v: Any, i: Any) -> Any:
    """Lane ``i`` of sixteen float32."""
    if v != F32x16 or not isinstance(i, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.extract_element(
            args[0], context.cast(builder, args[1], sig.args[1], types.int32)
        )

    return types.float32(v, i), codegen


@intrinsic
def put4(typingctx: Any, buf: Any, off: Any, x: Any) -> Any:
    """The float32 or int32 ``x`` to byte ``off`` of a ``uint8`` buffer."""
    if not _is_bytes(buf) or x not in (types.float32, types.int32):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ty = _F if sig.args[2] == types.float32 else _I32
        builder.store(
            args[2], _pointer(context, builder, sig.args[0], args[0], args[1], ty), align=4
        )
        return context.get_dummy_value()

    return types.none(buf, off, x), codegen


@intrinsic
def words8(typingctx: Any, buf: Any, off: Any, stride: Any, u: Any) -> Any:
    """The eight four-byte words of ``u`` to bytes ``off + stride j`` of a ``uint8``
    buffer (word ``j``: bytes ``4 j .. 4 j + 3``)."""
    if not _is_bytes(buf) or u != U8x32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        words = builder.bitcast(args[3], _VI)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        at = context.cast(builder, args[1], sig.args[1], types.int64)
        step = context.cast(builder, args[2], sig.args[2], types.int64)
        for j in range(8):
            ptr = builder.bitcast(builder.gep(data, [at]), _I32.as_pointer())
            builder.store(builder.extract_element(words, ir.Constant(_I32, j)), ptr, align=4)
            at = builder.add(at, step)
        return context.get_dummy_value()

    return types.none(buf, off, stride, u), codegen
