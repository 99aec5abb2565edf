"""The exact MXFP4 products on AVX2: each weight's float32 by byte shuffles, no conversion.

A weight of an MXFP4 block is ``d * KVALUES[code]`` (:mod:`.fp4`), exact in float32, and
every such float has its low sixteen bits zero: ``KVALUES`` are integers of at most two
significant bits and ``d`` a power of two, so the value's significand needs at most two
bits, which sit above bit 20 even for the smallest, ``2**-128`` (the subnormal scale 0).
So the float32 of a code under a scale byte ``e`` is its two high bytes, and those are
two sixteen-byte tables a block (:data:`TABLES`, one pair per scale byte, computed once
from the same float32 products the other decoders make): two ``vpshufb`` pick the two
bytes of 32 codes, two ``vpunpck{l,h}bw`` interleave them into 32 sixteen-bit words, and
a shift and a mask put each word into the high half of a float32 lane. A block costs
eleven integer instructions (load and nibble split included) where the conversions
(:func:`.fp4._converted`: widen, convert, multiply) take about twice as many, and the
multiplier ports are left to the FMAs.

**The same bits.** The words come out in another order: a vector holds values
``0, 2, ..., 14`` or ``1, 3, ..., 15`` of a block's sixteen (then of values 16-31). Each
output of an exact product is sixteen FMA chains, lane ``l`` over values ``j + l``, ``j
= 0, 16, 32, ...`` in order, then the lanes summed as a tree (:mod:`.kernels`); a lane's
chain does not depend on where it sits in a register. So the activations are permuted
the same way once a product (:func:`evens_odds`: value ``16 g + 2 p`` to place ``16 g +
p``, ``16 g + 2 p + 1`` to ``16 g + 8 + p``), every chain gets the same terms in the same
order, and before the tree the chains are put back in their lanes (:func:`unzip`): the
results are the other kernels' bits (``tests/engine/test_cpu_fp4_exact.py``).

- one activation row: :func:`pass4`, four weight rows a pass decoded in registers, two
  eight-lane chains each (the even and the odd lanes);
- two rows: :func:`pass2`, one weight row a pass decoded in registers, two chains for
  each activation row;
- more rows: :func:`.narrow.k_rows`, its tiles over blocks of four weight rows decoded
  into the scratch in the permuted order (:func:`decode_block`; so the tiles' eight-lane
  halves are the even and the odd chains), with the activations permuted and the chains
  unzipped (:func:`unzip_sum`).

Chosen by :mod:`.kernels` for MXFP4 where its tiles are eight lanes wide (AVX2:
:func:`.kernels.tile_form` 8) and the CPU has ``vpshufb`` on 256 bits
(:func:`.fp4.shuffles_bytes`); AVX-512 keeps :mod:`.lookup`'s ``vpermps`` tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils

from meshnode.engine.cpu.fp4 import KVALUES
from meshnode.engine.cpu.simd import F32x8, inner, intrinsic, vadd, vfma, vload, vstore, vsum, vzero
from meshnode.engine.cpu.simd_int import prefetch

__all__ = [
    "TABLES",
    "decode_block",
    "evens_odds",
    "fp4_block8",
    "pass2",
    "pass4",
    "permute_rows",
    "tables",
    "unzip_sum",
]

_BLOCK_BYTES = 17  # the scale byte, then sixteen bytes of codes


def tables() -> np.ndarray:
    """``[256, 32]`` bytes: for scale byte ``e``, byte 2 of the float32 ``d *
    KVALUES[k]`` for ``k = 0 .. 15``, then byte 3 (``d = 2**(e - 128)``, :func:`.fp4.
    e8m0_half`'s; the float32 products :func:`.fp4._converted` makes, infinities for the
    largest scales included). Raises if a product's low sixteen bits are not zero."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32)
    d = bits.view(np.float32)[:, None]
    with np.errstate(over="ignore"):
        values = (d * np.asarray(KVALUES, np.float32)[None, :]).astype(np.float32)
    words = values.view(np.uint32)
    if np.any(words & 0xFFFF):
        raise AssertionError("an MXFP4 value with low bits set")
    out = np.empty((256, 32), np.uint8)
    out[:, :16] = (words >> 16) & 0xFF
    out[:, 16:] = words >> 24
    return out


#: :func:`tables`, a constant of the compiled kernels (8 KiB: the scales a matrix uses
#: stay in the L1).
TABLES = tables()
_TABLE = TABLES.reshape(-1)

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_VB16, _VB32 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_VI, _VF = ir.VectorType(_I32, 8), ir.VectorType(ir.FloatType(), 8)


def _byte_pointer(context: Any, builder: Any, aryty: Any, ary: Any, off: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.gep(data, [off])


def _mask(*lanes: int) -> Any:
    return ir.Constant(ir.VectorType(_I32, len(lanes)), list(lanes))


def _pshufb(builder: Any, table: Any, codes: Any) -> Any:
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, ir.FunctionType(_VB32, [_VB32, _VB32]), "llvm.x86.avx2.pshuf.b"
    )
    return builder.call(fn, [table, codes])


def _is_bytes(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.uint8 and ty.layout == "C"


@intrinsic
def fp4_block8(typingctx: Any, row: Any, b: Any, table: Any) -> Any:
    """The block at byte ``b`` of ``row`` as four eight-lane vectors: its values ``0, 2,
    ..., 14``, ``1, 3, ..., 15``, ``16, 18, ..., 30`` and ``17, 19, ..., 31``, each the
    float32 ``d * KVALUES[code]`` (``table``: :data:`TABLES` flat)."""
    if not (_is_bytes(row) and _is_bytes(table)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        rty, bty, tty = sig.args
        row, b, table = args
        b = context.cast(builder, b, bty, types.int64)
        at = _byte_pointer(context, builder, rty, row, b)
        q = builder.load(
            builder.bitcast(builder.gep(at, [ir.Constant(_I64, 1)]), _VB16.as_pointer()), align=1
        )
        # qwords: bytes 0-7, the same >> 4, bytes 8-15, the same >> 4; masked: the codes
        # of values 0-7, 16-23 | 8-15, 24-31 (a 128-bit half each)
        q64 = builder.bitcast(q, ir.VectorType(_I64, 2))
        wide = builder.shuffle_vector(q64, ir.Constant(q64.type, ir.Undefined), _mask(0, 0, 1, 1))
        wide = builder.lshr(wide, ir.Constant(ir.VectorType(_I64, 4), [0, 4, 0, 4]))
        codes = builder.and_(builder.bitcast(wide, _VB32), ir.Constant(_VB32, [15] * 32))
        # the scale byte's two tables, each in both halves
        e = builder.zext(builder.load(at), _I64)
        base = _byte_pointer(context, builder, tty, table, builder.shl(e, ir.Constant(_I64, 5)))
        both = _mask(*range(16), *range(16))
        undef = ir.Constant(_VB16, ir.Undefined)
        picks = []
        for half in range(2):
            ptr = builder.gep(base, [ir.Constant(_I64, 16 * half)])
            t16 = builder.load(builder.bitcast(ptr, _VB16.as_pointer()), align=1)
            picks.append(_pshufb(builder, builder.shuffle_vector(t16, undef, both), codes))
        low, high = picks  # bytes 2 and 3 of each value's float32
        out = []
        for first in (0, 8):  # vpunpcklbw, vpunpckhbw: a word per value, byte 3 high
            lanes = [h + first + i + s for h in (0, 16) for i in range(8) for s in (0, 32)]
            words = builder.bitcast(builder.shuffle_vector(low, high, _mask(*lanes)), _VI)
            even = builder.shl(words, ir.Constant(_VI, [16] * 8))
            odd = builder.and_(words, ir.Constant(_VI, [-65536] * 8))
            out += [builder.bitcast(even, _VF), builder.bitcast(odd, _VF)]
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(F32x8, 4)(row, b, table), codegen  # type: ignore[no-untyped-call]


@intrinsic
def evens_odds(typingctx: Any, x: Any, i: Any) -> Any:
    """``x[i : i + 16]`` (float32) as two eight-lane vectors: its even places, its odd."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C"):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        at = context.cast(builder, args[1], sig.args[1], types.int64)
        vty = ir.VectorType(ir.FloatType(), 16)
        ptr = builder.bitcast(builder.gep(data, [at]), vty.as_pointer())
        v = builder.load(ptr, align=4)
        undef = ir.Constant(v.type, ir.Undefined)
        even = builder.shuffle_vector(v, undef, _mask(*range(0, 16, 2)))
        odd = builder.shuffle_vector(v, undef, _mask(*range(1, 16, 2)))
        return context.make_tuple(builder, sig.return_type, [even, odd])

    return types.UniTuple(F32x8, 2)(x, i), codegen  # type: ignore[no-untyped-call]


@intrinsic
def _unzip(typingctx: Any, even: Any, odd: Any) -> Any:
    # the chains of lanes 0-7 and 8-15 from the even lanes' and the odd lanes'
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        even, odd = args
        lo = builder.shuffle_vector(even, odd, _mask(0, 8, 1, 9, 2, 10, 3, 11))
        hi = builder.shuffle_vector(even, odd, _mask(4, 12, 5, 13, 6, 14, 7, 15))
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return types.UniTuple(F32x8, 2)(even, odd), codegen  # type: ignore[no-untyped-call]


@njit(inline="always")
def unzip_sum(even, odd):  # type: ignore[no-untyped-def]
    """The tree sum (:func:`.simd.wsum`'s) of the sixteen chains whose even lanes are
    ``even`` and odd lanes ``odd``."""
    lo, hi = _unzip(even, odd)
    return vsum(vadd(lo, hi))


@njit(inline="always")
def permute_rows(x, xp, n):  # type: ignore[no-untyped-def]
    """``xp[: n]`` = ``x[: n]`` (float32, ``n`` a multiple of 16) with each sixteen's even
    places first, then its odd ones (the order :func:`fp4_block8` gives the weights)."""
    for i in range(0, n, 16):
        even, odd = evens_odds(x, i)
        vstore(xp, i, even)
        vstore(xp, i + 8, odd)


@njit(inline="always")
def _step(row, c, x0, x1, x2, x3, even, odd):  # type: ignore[no-untyped-def]
    # block c of one weight row into its even and odd chains
    w0, w1, w2, w3 = fp4_block8(row, _BLOCK_BYTES * c, _TABLE)
    return vfma(w2, x2, vfma(w0, x0, even)), vfma(w3, x3, vfma(w1, x1, odd))


@inner
def pass4(raw, x, out, o, hi, col, n_in, xp):  # type: ignore[no-untyped-def]
    """Weight rows ``o ..`` of the MXFP4 rows ``raw`` times the one activation row ``x``
    into ``out[0, col + o ..]``, four weight rows a pass while four are left (``xp``: a
    float32 scratch of ``n_in`` at least); returns the first row not done."""
    o = max(o, 0)
    if o + 4 > hi:
        return o
    permute_rows(x, xp, n_in)
    size = raw.shape[1]
    flat = raw.reshape(-1)
    while o + 4 <= hi:
        r0, r1, r2, r3 = raw[o], raw[o + 1], raw[o + 2], raw[o + 3]
        ahead = (o + 4) * size  # the next pass's rows, asked for as this one goes
        if ahead + 4 * size > flat.shape[0]:
            ahead = flat.shape[0] - 4 * size
        e0, o0, e1, o1 = vzero(), vzero(), vzero(), vzero()
        e2, o2, e3, o3 = vzero(), vzero(), vzero(), vzero()
        for c in range(n_in // 32):
            if c % 4 == 0:
                at = ahead + _BLOCK_BYTES * c
                prefetch(flat, at)
                prefetch(flat, at + size)
                prefetch(flat, at + 2 * size)
                prefetch(flat, at + 3 * size)
            p = 32 * c
            x0, x1, x2, x3 = vload(xp, p), vload(xp, p + 8), vload(xp, p + 16), vload(xp, p + 24)
            e0, o0 = _step(r0, c, x0, x1, x2, x3, e0, o0)
            e1, o1 = _step(r1, c, x0, x1, x2, x3, e1, o1)
            e2, o2 = _step(r2, c, x0, x1, x2, x3, e2, o2)
            e3, o3 = _step(r3, c, x0, x1, x2, x3, e3, o3)
        out[0, col + o] = unzip_sum(e0, o0)
        out[0, col + o + 1] = unzip_sum(e1, o1)
        out[0, col + o + 2] = unzip_sum(e2, o2)
        out[0, col + o + 3] = unzip_sum(e3, o3)
        o += 4
    return o


@njit(inline="always")
def _step2(w0, w1, w2, w3, xp, p, even, odd):  # type: ignore[no-untyped-def]
    # one weight row's block (its four vectors) times the activation row at xp[p ..]
    even = vfma(w2, vload(xp, p + 16), vfma(w0, vload(xp, p), even))
    return even, vfma(w3, vload(xp, p + 24), vfma(w1, vload(xp, p + 8), odd))


@inner
def pass2(raw, x, out, o, hi, col, n_in, xp):  # type: ignore[no-untyped-def]
    """Weight rows ``o .. hi - 1`` of the MXFP4 rows ``raw`` times the two activation
    rows of ``x`` (flat) into ``out[:, col + o ..]``, one weight row a pass decoded in
    registers for both (``xp``: a float32 scratch of ``2 n_in`` at least); returns
    ``hi``."""
    o = max(o, 0)
    if o >= hi:
        return o
    permute_rows(x, xp, 2 * n_in)
    size = raw.shape[1]
    flat = raw.reshape(-1)
    blocks = n_in // 32
    while o < hi:
        row = raw[o]
        ahead = min((o + 1) * size, flat.shape[0] - size)  # the next row
        e0, o0, e1, o1 = vzero(), vzero(), vzero(), vzero()
        for c4 in range(0, blocks, 4):
            prefetch(flat, ahead + _BLOCK_BYTES * c4)
            for c in range(c4, min(c4 + 4, blocks)):
                w0, w1, w2, w3 = fp4_block8(row, _BLOCK_BYTES * c, _TABLE)
                e0, o0 = _step2(w0, w1, w2, w3, xp, 32 * c, e0, o0)
                e1, o1 = _step2(w0, w1, w2, w3, xp, n_in + 32 * c, e1, o1)
        out[0, col + o] = unzip_sum(e0, o0)
        out[1, col + o] = unzip_sum(e1, o1)
        o += 1
    return o


@njit(inline="always")
def decode_block(raw, o, w, j0, m, stride):  # type: ignore[no-untyped-def]
    """Values ``j0 .. j0 + m - 1`` (whole blocks) of the MXFP4 weight rows ``o .. o + 3``
    of ``raw`` into ``w[stride i ..]`` (row ``i``), in the permuted order (each sixteen's
    even values, then its odd ones): :mod:`.narrow`'s decoded block."""
    for i in range(4):
        row = raw[o + i]
        for c in range(j0 // 32, (j0 + m) // 32):
            w0, w1, w2, w3 = fp4_block8(row, _BLOCK_BYTES * c, _TABLE)
            at = stride * i + 32 * c - j0
            vstore(w, at, w0)
            vstore(w, at + 8, w1)
            vstore(w, at + 16, w2)
            vstore(w, at + 24, w3)
