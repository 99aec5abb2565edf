"""The multi-row products of the 8-bit-activation kernels (:mod:`.q8_kernels`): verify
windows, batches and prefill, as tiles of sixteen weight rows times every activation row.

A tile's sixteen weight rows are unpacked once per product (:func:`unpack`) into a scratch
laid out for the lanes (:func:`scratch_bytes`): for chunk ``c`` and four-byte word ``j``,
the sixteen rows' words side by side (64 bytes at ``512 c + 64 j``), then each chunk's
sixteen scales, minimums and integer half scales. Then every activation row meets the
tile, :data:`ROWS` rows at a time (:func:`_pass`): each 64-byte word vector, loaded once,
feeds one ``vpdpbusd`` per row with that row's four int8 copied to every lane
(:func:`.simd_tile.dotb`), so the activations are read as four-byte broadcasts and no
byte is shuffled. This is the shape of ggml's ``gemm_q4_K_8x8_q8_K`` (weights repacked in
interleaved rows, integer products per block, scales folded in float per block).

The arithmetic of each (activation row, weight row) is the one :mod:`.q8_kernels`
states: the same exact integer ``D`` of each chunk, then ``acc = fma(float(D), dw dx,
acc)`` and ``t = t + m (dx sum(q))`` in float32 in chunk order, even and odd chunks
apart, the result ``(acc_even + acc_odd) + (t_even + t_odd)``: the same bits as the
one-row kernels, so a row's result is the same alone, in a window and in a prefill.

Layering: compiled code only, called by :mod:`.q8_kernels` (whose buffer layout, the
area offsets, it takes as arguments).
"""

from __future__ import annotations

from typing import Any

from numba import njit

from meshnode.engine.cpu.q8_blocks import OFFSET_SHIFTS, chunk, minimum_kind, offset_area, per16
from meshnode.engine.cpu.simd import INNER, entry, inner, wadd, wfma, wmul, wzero
from meshnode.engine.cpu.simd_int import prefetch
from meshnode.engine.cpu.simd_q8 import fload16, iadd16, iload16, imul16, ipair, ishl16, tofloat16
from meshnode.engine.cpu.simd_tile import dotb, fsplat16, isplat16, lane16, put4, wload, words8

__all__ = ["ROWS", "TILE", "scratch_bytes", "tiles", "unpack"]

# Weight rows of a tile (the lanes of a 512-bit register of int32)
TILE = 16
# Activation rows that meet a tile together: each word vector loaded feeds this many
ROWS = 4
# _pass' helpers, inlined in numba's IR: as calls, their 512-bit values went through memory
_inlined: Any = njit(cache=True, inline="always", **INNER)


@entry()
def scratch_bytes(n_in):  # type: ignore[no-untyped-def]
    """Bytes of :func:`unpack`'s scratch for a tile of rows of ``n_in`` values: the words
    (``16 n_in``), then five fields of sixteen lanes per 32-value chunk."""
    return 16 * n_in + 320 * (n_in // 32)


@inner
def unpack(fmt, w, size, o, last, nb, s, ahead):  # type: ignore[no-untyped-def]
    """Weight rows ``o .. o + 15`` (``size`` bytes each in the flat ``w``; rows past
    ``last`` repeat it) into the scratch ``s``: words at ``512 c + 64 j + 4 i`` (row
    ``o + i``), then the fields dw, m, m2 (float32), sa, sb (int32) of each chunk at
    ``512 nb + 64 (f nb + c) + 4 i``. Asks for the bytes ``ahead`` of each row."""
    kind, at0, end = minimum_kind(fmt), 512 * nb, w.shape[0]
    for i in range(TILE):
        base = min(o + i, last) * size
        if base + ahead < end:
            for line in range(0, size, 64):
                prefetch(w, base + ahead + line)
        for c in range(nb):
            u, dw, m, m2, sa, sb = chunk(fmt, w, base, c)
            words8(s, 512 * c + 4 * i, 64, u)
            at = at0 + 64 * c + 4 * i
            put4(s, at, dw)
            if kind != 0:
                put4(s, at + 64 * nb, m)
            if kind == 2:
                put4(s, at + 128 * nb, m2)
            if per16(fmt):
                put4(s, at + 192 * nb, sa)
                put4(s, at + 256 * nb, sb)


@_inlined
def _d(fmt, s, c, nb, q, x, o_lo, o_hi):  # type: ignore[no-untyped-def]
    # chunk c's exact D for one activation row (x: the byte of its chunk c) and the
    # tile's sixteen weight rows; o_lo, o_hi: the byte of its halves' -sum(q)
    p = 512 * c
    if offset_area(fmt) >= 0:
        shift = OFFSET_SHIFTS[offset_area(fmt)]
        lo, hi = ishl16(isplat16(q, o_lo), shift), ishl16(isplat16(q, o_hi), shift)
    else:
        lo, hi = ipair(0, 0), ipair(0, 0)
    lo = dotb(dotb(lo, wload(s, p), q, x, fmt), wload(s, p + 64), q, x + 4, fmt)
    lo = dotb(dotb(lo, wload(s, p + 128), q, x + 8, fmt), wload(s, p + 192), q, x + 12, fmt)
    hi = dotb(dotb(hi, wload(s, p + 256), q, x + 16, fmt), wload(s, p + 320), q, x + 20, fmt)
    hi = dotb(dotb(hi, wload(s, p + 384), q, x + 24, fmt), wload(s, p + 448), q, x + 28, fmt)
    if per16(fmt):
        at = 512 * nb + 64 * c
        sa, sb = iload16(s, at + 192 * nb), iload16(s, at + 256 * nb)
        return iadd16(imul16(lo, sa), imul16(hi, sb))
    return iadd16(lo, hi)


@_inlined
def _fold_in(fmt, acc, t, d, s, c, nb, q, rb, blocks, dxt, sxt):  # type: ignore[no-untyped-def]
    # acc = fma(float(D), dw dx, acc), t = t + m (dx sum(q)) for chunk c of one row; rb:
    # the row's lane of chunk c in quantize's areas (bytes from an area's start)
    f = 512 * nb + 64 * c
    acc = wfma(tofloat16(d), wmul(fload16(s, f), fsplat16(q, dxt + rb)), acc)
    kind = minimum_kind(fmt)
    if kind == 1:
        t = wadd(t, wmul(fload16(s, f + 64 * nb), fsplat16(q, sxt + rb)))
    elif kind == 2:
        t = wadd(t, wmul(fload16(s, f + 64 * nb), fsplat16(q, sxt + 32 * blocks + rb)))
        t = wadd(t, wmul(fload16(s, f + 128 * nb), fsplat16(q, sxt + 64 * blocks + rb)))
    return acc, t


@_inlined
def _row(fmt, s, c, nb, q, r, blocks, areas, acc, t):  # type: ignore[no-untyped-def]
    # chunk c of activation row r into its (acc, t); areas: quantize's header bytes and
    # its ot, dxt, sxt
    head, ot, dxt, sxt = areas
    rb = 32 * ((r // 8) * nb + c) + 4 * (r % 8)
    d = _d(fmt, s, c, nb, q, head + 32 * (r * nb + c), ot + rb, ot + 32 * blocks + rb)
    return _fold_in(fmt, acc, t, d, s, c, nb, q, rb, blocks, dxt, sxt)


@inner
def _pass(fmt, s, q, out, r0, k, o, valid, col, nb, blocks, areas):  # type: ignore[no-untyped-def]
    # activation rows r0 .. r0 + ROWS - 1 (past k: row k - 1 again, not stored) times the
    # tile in s (weight rows o .. o + valid - 1) into out
    r1, r2, r3 = min(r0 + 1, k - 1), min(r0 + 2, k - 1), min(r0 + 3, k - 1)
    a0, t0, b0, u0 = wzero(), wzero(), wzero(), wzero()  # row r0: even acc, t; odd acc, t
    a1, t1, b1, u1 = wzero(), wzero(), wzero(), wzero()
    a2, t2, b2, u2 = wzero(), wzero(), wzero(), wzero()
    a3, t3, b3, u3 = wzero(), wzero(), wzero(), wzero()
    for c in range(nb):  # (a, t) the chunk's parity's, (b, u) the other's: swapped each chunk
        e0, f0 = _row(fmt, s, c, nb, q, r0, blocks, areas, b0, u0)
        e1, f1 = _row(fmt, s, c, nb, q, r1, blocks, areas, b1, u1)
        e2, f2 = _row(fmt, s, c, nb, q, r2, blocks, areas, b2, u2)
        e3, f3 = _row(fmt, s, c, nb, q, r3, blocks, areas, b3, u3)
        a0, t0, b0, u0, a1, t1, b1, u1 = e0, f0, a0, t0, e1, f1, a1, t1
        a2, t2, b2, u2, a3, t3, b3, u3 = e2, f2, a2, t2, e3, f3, a3, t3
    _store(fmt, out, r0, o, valid, col, a0, t0, b0, u0)
    if r0 + 1 < k:
        _store(fmt, out, r1, o, valid, col, a1, t1, b1, u1)
    if r0 + 2 < k:
        _store(fmt, out, r2, o, valid, col, a2, t2, b2, u2)
    if r0 + 3 < k:
        _store(fmt, out, r3, o, valid, col, a3, t3, b3, u3)


@_inlined
def _store(fmt, out, r, o, valid, col, a, t, b, u):  # type: ignore[no-untyped-def]
    # (even + odd) + (their t's), as the one-row kernels fold them, to out[r, col + o ..]
    v = wadd(a, b)
    if minimum_kind(fmt) != 0:
        v = wadd(v, wadd(t, u))
    for i in range(valid):
        out[r, col + o + i] = lane16(v, i)


@inner
def tiles(fmt, w, size, q, out, lo, hi, col, k, nb, blocks, areas, s, ahead):  # type: ignore[no-untyped-def]
    """Weight rows ``lo .. hi - 1`` (``size`` bytes each in the flat ``w``) times the
    ``k`` activation rows of ``q`` into columns ``col + lo ..`` of ``out``, a tile of
    :data:`TILE` weight rows at a time unpacked into the scratch ``s`` (asking for the
    weight bytes ``ahead`` of the row it unpacks); ``areas``: quantize's header bytes and
    its ``ot, dxt, sxt``."""
    for o in range(lo, hi, TILE):
        unpack(fmt, w, size, o, hi - 1, nb, s, ahead)
        valid = min(TILE, hi - o)
        for r0 in range(0, k, ROWS):
            _pass(fmt, s, q, out, r0, k, o, valid, col, nb, blocks, areas)
