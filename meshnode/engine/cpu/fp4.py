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
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types

from meshnode.engine.cpu.simd import F32x16, inner, intrinsic, wmul, wsplat
from meshnode.engine.cpu.simd_int import U8x32

__all__ = ["KVALUES", "bfp4", "e8m0_half", "wfp4"]

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
        k = builder.sext(_kvalues(builder, codes), ir.VectorType(_I32, 16))
        return builder.sitofp(k, ir.VectorType(ir.FloatType(), 16))

    return F32x16(row, off, shift), codegen


@intrinsic
def bfp4(typingctx: Any, row: Any, off: Any) -> Any:
    """The 16 bytes at ``off`` as 32 unsigned bytes ``KVALUES[code] + 16``: the low
    nibbles' codes, then the high nibbles' (a block's values in order)."""
    if not _is_bytes(row):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = _load16(context, builder, sig.args[0], args[0], args[1])
        low = builder.and_(v, ir.Constant(_VB16, [15] * 16))
        high = builder.lshr(v, ir.Constant(_VB16, [4] * 16))
        codes = builder.shuffle_vector(
            low, high, ir.Constant(ir.VectorType(_I32, 32), list(range(32)))
        )
        return builder.add(_kvalues(builder, codes), ir.Constant(_VB32, [Q8_OFFSET] * 32))

    return U8x32(row, off), codegen


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


def _mxfp4(fmt, row, c):  # type: ignore[no-untyped-def]
    b = 17 * c  # e | qs[16]: d * KVALUES[code], values 0-15 low nibbles, 16-31 high
    d = wsplat(e8m0_half(row, b))
    return wmul(d, wfp4(row, b + 1, 0)), wmul(d, wfp4(row, b + 1, 4))


def _mxfp4_q8(fmt, w, base, c):  # type: ignore[no-untyped-def]
    # one block per chunk: u = KVALUES[code] + 16, dw = d, no minimum, no per-16 scales
    o, z, one = base + 17 * c, np.float32(0.0), np.int32(1)
    return bfp4(w, o + 1), e8m0_half(w, o), z, z, one, one
