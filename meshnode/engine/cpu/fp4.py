"""MXFP4 (GGML type ``MXFP4``, OCP microscaling FP4): the decoders its format row names.

A block is 32 values in 17 bytes (ggml-common.h ``block_mxfp4``, gguf's ``MXFP4``): one
E8M0 scale byte ``e``, then 16 bytes of 4-bit E2M1 codes, value ``j`` in the low nibble
of byte ``j`` and value ``j + 16`` in its high nibble. Value ``j`` is ``d *
KVALUES[code]``, where ``KVALUES`` are the E2M1 values doubled (ggml's ``kvalues_mxfp4``:
0, 1, 2, 3, 4, 6, 8, 12 and their negatives, code 8 a plain 0) and ``d = 2**(e - 128)``,
half of the E8M0 scale (``GGML_E8M0_TO_FP32_HALF``; for ``e`` 0 and 1 a subnormal float32).

Every ``d * KVALUES[code]`` is exact in float32 (a power of two times an integer of at
most two significant bits, never below ``2**-149``), so these decoders' values are
gguf's bit for bit whichever way they are computed. Hugging Face checkpoints (gpt-oss's
``*_blocks``/``*_scales``) store the same values in another nibble order and the scale
apart; :func:`meshnode_packaging.quants.mxfp4_from_hf` repacks them into these blocks.

:func:`_mxfp4` is the exact sixteen-lane decoder (as :mod:`.wide`'s), :func:`_mxfp4_q8`
the unpacker of the 8-bit-activation kernels (as :mod:`.q8_blocks`'): the codes as
unsigned bytes ``KVALUES[code] + 16`` (offset 16: a weight ``d (u - 16)``, exact integer
dot products) and ``dw = d``.

Both pick the values by table where the CPU has the instruction, as ggml's
``ggml_vec_dot_mxfp4_q8_0`` does: the 8-bit kernels' bytes by one ``vpshufb`` (AVX2) from
the sixteen bytes ``KVALUES + 16``, the exact decoder's floats by ``vpermps`` (AVX-512,
:mod:`.lookup`) from the block's sixteen values ``d * KVALUES[k]``; with AVX2 but not
AVX-512, ``KVALUES[code]`` by a ``pshufb`` of sixteen codes, then a conversion and a
multiply; elsewhere compares and selects for it. A table's entry is the value computed for its
code (the same integer; the same float32 product of the same operands), so both ways give
the same bits. The one-row 8-bit kernel reads eight rows' scale bytes at once
(:func:`e8m0_half8`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import overload

from meshnode.engine.cpu.lookup import permutes, wlookup
from meshnode.engine.cpu.simd import INNER, F32x8, F32x16, inner, intrinsic, wmul, wsplat
from meshnode.engine.cpu.simd_int import U8x32, gather8, is_bases8

__all__ = ["KVALUES", "bfp4", "e8m0_half", "e8m0_half8", "shuffles_bytes", "wfp4", "wkvalues"]

#: The E2M1 values doubled, by 4-bit code (ggml's kvalues_mxfp4).
KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# the unsigned bytes of the q8 kernels are KVALUES + Q8_OFFSET (its row's Q8 offset)
Q8_OFFSET = 16

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_VB16, _VB32 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)


def _is_bytes(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.uint8 and ty.layout == "C"


def _load16(context: Any, builder: Any, aryty: Any, ary: Any, off: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.load(builder.bitcast(builder.gep(data, [off]), _VB16.as_pointer()), align=1)


def _kvalues(builder: Any, codes: Any) -> Any:
    # KVALUES[code] for a vector of 4-bit codes (bytes): the magnitude m = code & 7 is
    # itself below 4, else 4, 6, 8, 12 for 4 .. 7 (compares and selects: byte lanes have
    # no variable shifts on x86); negated where bit 3 is set
    n = codes.type.count

    def const(value: int) -> Any:
        return ir.Constant(ir.VectorType(_I8, n), [value] * n)

    m = builder.and_(codes, const(7))
    k = m
    for code, value in ((4, 4), (5, 6), (6, 8), (7, 12)):
        k = builder.select(builder.icmp_unsigned("==", m, const(code)), const(value), k)
    negative = builder.icmp_unsigned("!=", builder.and_(codes, const(8)), const(0))
    return builder.select(negative, builder.sub(const(0), k), k)


@intrinsic
def wfp4(typingctx: Any, row: Any, off: Any, shift: Any) -> Any:
    """Lane ``i`` is ``KVALUES[(row[off + i] >> shift) & 15]`` as float32 (``shift`` 0:
    the low nibbles, 4: the high ones), sixteen lanes."""
    if not (_is_bytes(row) and isinstance(shift, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = _load16(context, builder, sig.args[0], args[0], args[1])
        by = builder.trunc(context.cast(builder, args[2], sig.args[2], types.int32), _I8)
        splat = builder.shuffle_vector(
            builder.insert_element(ir.Constant(_VB16, ir.Undefined), by, ir.Constant(_I32, 0)),
            ir.Constant(_VB16, ir.Undefined),
            ir.Constant(ir.VectorType(_I32, 16), [0] * 16),
        )
        codes = builder.and_(builder.lshr(v, splat), ir.Constant(_VB16, [15] * 16))
        k = builder.sext(_pick16(builder, codes), ir.VectorType(_I32, 16))
        return builder.sitofp(k, ir.VectorType(ir.FloatType(), 16))

    return F32x16(row, off, shift), codegen


@cache
def shuffles_bytes() -> bool:
    """Whether this CPU picks 32 bytes from a table by a register of byte indices in one
    instruction (``vpshufb`` on 256-bit registers: AVX2), what numba compiles for."""
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("avx2"))


def _pick16(builder: Any, codes: Any) -> Any:
    # KVALUES[code] for 16 codes (each below 16) as int8: one pshufb from the sixteen
    # bytes KVALUES where the CPU has it (SSSE3, with AVX2), elsewhere compares and selects
    if not shuffles_bytes():
        return _kvalues(builder, codes)
    table = ir.Constant(_VB16, [k & 255 for k in KVALUES])
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, ir.FunctionType(_VB16, [_VB16, _VB16]), "llvm.x86.ssse3.pshuf.b.128"
    )
    return builder.call(fn, [table, codes])


def _pick_bytes(builder: Any, codes: Any) -> Any:
    # KVALUES[code] + 16 for 32 codes (each below 16): one vpshufb, which picks within
    # each 128-bit half, from a copy of the sixteen-byte table in each (ggml's
    # ggml_vec_dot_mxfp4_q8_0 does the same); elsewhere compares and selects
    if not shuffles_bytes():
        return builder.add(_kvalues(builder, codes), ir.Constant(_VB32, [Q8_OFFSET] * 32))
    table = ir.Constant(_VB32, [(k + Q8_OFFSET) & 255 for k in KVALUES] * 2)
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, ir.FunctionType(_VB32, [_VB32, _VB32]), "llvm.x86.avx2.pshuf.b"
    )
    return builder.call(fn, [table, codes])


@intrinsic
def bfp4(typingctx: Any, row: Any, off: Any) -> Any:
    """The 16 bytes at ``off`` as 32 unsigned bytes ``KVALUES[code] + 16``: the low
    nibbles' codes, then the high nibbles' (a block's values in order)."""
    if not _is_bytes(row):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = _load16(context, builder, sig.args[0], args[0], args[1])
        both = builder.shuffle_vector(
            v,
            builder.lshr(v, ir.Constant(_VB16, [4] * 16)),
            ir.Constant(ir.VectorType(_I32, 32), list(range(32))),
        )  # the low nibbles' bytes, then the high nibbles'
        return _pick_bytes(builder, builder.and_(both, ir.Constant(_VB32, [15] * 32)))

    return U8x32(row, off), codegen


@intrinsic
def wkvalues(typingctx: Any) -> Any:
    """Lane ``k`` is ``KVALUES[k]`` as float32 (exact)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return ir.Constant(ir.VectorType(ir.FloatType(), 16), [float(k) for k in KVALUES])

    return F32x16(), codegen


@intrinsic
def _bits_to_f32(typingctx: Any, bits: Any) -> Any:
    # the float32 whose bits are the uint32 bits (numba has no scalar bit casts)
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@inner
def e8m0_half(row, off):  # type: ignore[no-untyped-def]
    """``2**(e - 128)`` for the E8M0 byte ``e`` at ``off`` of ``row``, as float32 (ggml's
    ``GGML_E8M0_TO_FP32_HALF``: subnormal bits for ``e`` 0 and 1)."""
    e = np.uint32(row[off])
    if e < 2:
        return _bits_to_f32(np.uint32(0x00200000) << e)
    return _bits_to_f32((e - np.uint32(1)) << np.uint32(23))


@intrinsic
def e8m0_half8(typingctx: Any, row: Any, bases: Any, off: Any) -> Any:
    """Lane ``i`` is :func:`e8m0_half` of the byte at ``bases[i] + off`` of ``row`` (eight
    rows' block scales at once, the same bits)."""
    if not (_is_bytes(row) and is_bases8(bases)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        vi = ir.VectorType(_I32, 8)

        def const(value: int) -> Any:
            return ir.Constant(vi, [value] * 8)

        e = builder.zext(gather8(context, builder, sig, args, _I8), vi)
        normal = builder.shl(builder.sub(e, const(1)), const(23))
        subnormal = builder.shl(const(0x00200000), e)  # e 0 and 1 (poison above: unused)
        bits = builder.select(builder.icmp_unsigned("<", e, const(2)), subnormal, normal)
        return builder.bitcast(bits, ir.VectorType(ir.FloatType(), 8))

    return F32x8(row, bases, off), codegen


def _mxfp4(fmt, row, c):  # type: ignore[no-untyped-def]
    # e | qs[16]: d * KVALUES[code], values 0-15 low nibbles, 16-31 high
    return _block_values(row, 17 * c)


def _block_values(row: Any, b: int) -> Any:
    # the block at byte b of row as two sixteen-lane vectors (compiled code only)
    raise TypeError("for compiled code")


@overload(_block_values, jit_options=INNER)
def _block_values_typed(row, b):  # type: ignore[no-untyped-def]
    # where vpermps is one instruction (.lookup), the block's sixteen values d *
    # KVALUES[k] computed once and picked by the codes: lane k of the table is the
    # float32 product d * KVALUES[code] for code k, so the values are the same bits
    return _looked_up if permutes() else _converted


def _looked_up(row, b):  # type: ignore[no-untyped-def]
    table = wmul(wsplat(e8m0_half(row, b)), wkvalues())
    return wlookup(table, row, b + 1, False), wlookup(table, row, b + 1, True)


def _converted(row, b):  # type: ignore[no-untyped-def]
    d = wsplat(e8m0_half(row, b))
    return wmul(d, wfp4(row, b + 1, 0)), wmul(d, wfp4(row, b + 1, 4))


def _mxfp4_q8(fmt, w, base, c):  # type: ignore[no-untyped-def]
    # one block per chunk: u = KVALUES[code] + 16, dw = d, no minimum, no per-16 scales
    o, z, one = base + 17 * c, np.float32(0.0), np.int32(1)
    return bfp4(w, o + 1), e8m0_half(w, o), z, z, one, one
