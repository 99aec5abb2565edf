"""Sixteen-lane reads of quantized bytes for the numba kernels: nibbles, five-bit quants
and int8 of a ``uint8`` row widened to :data:`.simd.F32x16` float32 lanes (exactly: every
value is a small integer), as LLVM vector IR (:mod:`.simd`'s conventions: no bounds
checks, offsets in bytes).

Where sixteen lanes are two registers (AVX2: :func:`permutes` false), the widened bytes of
the nibble reads pass through an empty asm, so that LLVM keeps one ``vpmovzxbd`` from
memory for each eight bytes, shared by their low and high nibbles (:func:`opaque`).
"""

from __future__ import annotations

import functools
from typing import Any

from llvmlite import ir
from numba import types

from meshnode.engine.cpu.simd import LANES, F32x16, _i32, _is_array, intrinsic

__all__ = [
    "opaque",
    "permutes",
    "whigh_nibbles",
    "wload_i8",
    "wlow_nibbles",
    "wq5_high",
    "wq5_low",
    "wq5c_high",
    "wq5c_low",
]

_I32 = ir.IntType(32)
_VI = ir.VectorType(_I32, LANES)
_VW = ir.VectorType(ir.FloatType(), 2 * LANES)
_VIW = ir.VectorType(_I32, 2 * LANES)


@functools.cache
def permutes() -> bool:
    """Whether this CPU permutes sixteen float32 lanes by a register of indices in one
    instruction (``vpermps`` on 512-bit registers: AVX-512F), what numba compiles for; so
    too, whether :data:`F32x16` is one register."""
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("avx512f"))


def opaque(builder: Any, v: Any) -> Any:
    """``v`` (sixteen int32 lanes), which the compiler cannot see through: an empty asm on
    each register's worth of lanes (all sixteen on AVX-512, eight elsewhere). Widened
    bytes seen through, LLVM masks or shifts the bytes first and widens each nibble's on
    their own; opaque, the low and the high nibbles of the same bytes share one widening
    (the callers say what each gains)."""
    lanes = 2 * LANES if permutes() else LANES
    vty = ir.VectorType(_I32, lanes)
    asm = ir.InlineAsm(ir.FunctionType(vty, [vty]), "", "=v,0")
    if lanes == 2 * LANES:
        return builder.call(asm, [v], attrs=("readnone", "nounwind"))
    halves = []
    for first in (0, LANES):
        half = builder.shuffle_vector(v, v, ir.Constant(_VI, list(range(first, first + LANES))))
        halves.append(builder.call(asm, [half], attrs=("readnone", "nounwind")))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VIW, list(range(2 * LANES))))


def _wide_bytes(part: str, doc: str) -> Any:
    """An intrinsic reading sixteen bytes of a ``uint8`` row as sixteen float32 lanes."""
    bytes16 = ir.VectorType(ir.IntType(8), 2 * LANES)

    def typer(typingctx: Any, row: Any, off: Any) -> Any:
        if not _is_array(row, types.uint8):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            ptr = builder.bitcast(builder.gep(data, [args[1]]), bytes16.as_pointer())
            v = builder.load(ptr, align=1)
            if part == "int8":
                return builder.sitofp(builder.sext(v, _VIW), _VW)
            # the weights never change while a product runs: a low and a high read of the
            # same bytes share one load and one widening (invariant.load), kept as one
            # where sixteen lanes are two registers (opaque). Seen through, a vpshufd and
            # two vpmovzxbd from a register every sixteen values, each nibble's bytes
            # widened on their own; opaque, each eight bytes one vpmovzxbd from memory
            # (AVX2, the Q4_K one-row pass: 0.30 -> 0.25 cycles a weight with the rows'
            # order of .passes, benchmarks/exact_kernels.py)
            v.set_metadata("invariant.load", builder.module.add_metadata([]))
            wide = builder.zext(v, _VIW)
            if not permutes():
                wide = opaque(builder, wide)
            if part == "low":
                wide = builder.and_(wide, ir.Constant(_VIW, [15] * 2 * LANES))
            else:
                wide = builder.lshr(wide, ir.Constant(_VIW, [4] * 2 * LANES))
            return builder.sitofp(wide, _VW)

        return F32x16(row, off), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


def _wide_q5(high: bool, centred: bool, doc: str) -> Any:
    """An intrinsic: sixteen five-bit quants (Q5_0/Q5_1) as float32 lanes, the nibbles of
    the sixteen bytes at ``off`` (low or high) with bit ``i`` (or ``16 + i``) of ``qh``;
    ``centred``: the quant minus 16 (Q5_0), exact in both integer and float32."""
    bytes16 = ir.VectorType(ir.IntType(8), 2 * LANES)

    def typer(typingctx: Any, row: Any, off: Any, qh: Any) -> Any:
        if not _is_array(row, types.uint8):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            ptr = builder.bitcast(builder.gep(data, [args[1]]), bytes16.as_pointer())
            wide = builder.zext(builder.load(ptr, align=1), _VIW)
            if high:
                nibble = builder.lshr(wide, ir.Constant(_VIW, [4] * 2 * LANES))
            else:
                nibble = builder.and_(wide, ir.Constant(_VIW, [15] * 2 * LANES))
            word = _i32(context, builder, args[2], sig.args[2])
            undef = ir.Constant(_VIW, ir.Undefined)
            one_word = builder.insert_element(undef, word, ir.Constant(_I32, 0))
            words = builder.shuffle_vector(one_word, undef, ir.Constant(_VIW, [0] * 2 * LANES))
            first = 2 * LANES if high else 0
            if centred:
                # bit i to the sign, spread over the lane (-1 where set, 0 where not),
                # flipped and kept above the nibble: or-ed with the nibble, that is the
                # nibble where the bit is set (q - 16) and the nibble - 16 where it is not
                lanes = range(first, first + 2 * LANES)
                top = builder.shl(words, ir.Constant(_VIW, [31 - i for i in lanes]))
                spread = builder.ashr(top, ir.Constant(_VIW, [31] * 2 * LANES))
                unset = builder.xor(spread, ir.Constant(_VIW, [-1] * 2 * LANES))
                flipped = builder.and_(unset, ir.Constant(_VIW, [-16] * 2 * LANES))
                return builder.sitofp(builder.or_(nibble, flipped), _VW)
            shifts = ir.Constant(_VIW, list(range(first, first + 2 * LANES)))
            bit = builder.and_(builder.lshr(words, shifts), ir.Constant(_VIW, [1] * 2 * LANES))
            fifth = builder.shl(bit, ir.Constant(_VIW, [4] * 2 * LANES))
            return builder.sitofp(builder.or_(nibble, fifth), _VW)

        return F32x16(row, off, qh), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


wq5_low = _wide_q5(False, False, "Q5 values 0-15 of a block (low nibbles, ``qh`` bits 0-15).")
wq5_high = _wide_q5(True, False, "Q5 values 16-31 of a block (high nibbles, ``qh`` bits 16-31).")
wq5c_low = _wide_q5(False, True, "Q5_0 values 0-15 of a block minus 16, as ``wq5_low``.")
wq5c_high = _wide_q5(True, True, "Q5_0 values 16-31 of a block minus 16, as ``wq5_high``.")
wlow_nibbles = _wide_bytes("low", "The low nibbles of sixteen bytes at ``off``, as floats.")
whigh_nibbles = _wide_bytes("high", "The high nibbles of sixteen bytes at ``off``, as floats.")
wload_i8 = _wide_bytes("int8", "Sixteen int8 at ``off``, as floats.")
