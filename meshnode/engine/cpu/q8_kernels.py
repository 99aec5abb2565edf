"""Compiled products of GGUF blocks with 8-bit activations (``--dtype q8``, inexact).

Each activation row is quantized in blocks of 32 values, as llama.cpp's Q8_0/Q8_1 do:
``q = round(x / d)`` with ``d = max|x| / 127``, stored as int8 beside what the kernels
read per block (:func:`.q8_quant.quantize`). For each 32-value chunk of a weight row
(:func:`.q8_blocks.chunk`: its quants unpacked to unsigned bytes ``u``, its scale ``dw``,
minimum ``m``, per-16 integer scales) and each activation row, in order of the chunks:

- ``D``, the exact integer dot product ``u . q`` (``vpdpbusd``), plus ``-z sum(q)`` for a
  weight ``s (u - z)`` (Q4_0, Q5_0, Q8_0 as ``w + 128``, Q3_K, Q6_K), each half of 16
  values times its integer scale (Q2_K, Q3_K, Q6_K);
- ``acc = fma(float(D), dw * dx, acc)`` in float32, one accumulator for the even chunks
  and one for the odd ones;
- for a weight ``s u + m`` (Q4_1, Q5_1, Q4_K, Q5_K; Q2_K per 16 values) ``t = t + m (dx
  sum(q))``: the sum of the *quantized* values, as llama.cpp's Q8_1 keeps it, not of
  ``x`` (then the rounding errors of ``x`` meet the about-centred weights ``s u + m``;
  with ``sum(x)`` SmolLM2's products were 2x further from float32), again even and odd;

and the result is ``(acc_even + acc_odd) + (t_even + t_odd)``. Three kernels compute
exactly this, with rows in the vector lanes: one activation row meets eight weight rows
at a time (lanes: the weight rows; each block's eight ``dot4`` lanes summed into one,
:func:`.simd_q8.isums`); a few activation rows (under :data:`TILE_MIN_ROWS`) meet each
weight row eight at a time and two chunks per 512-bit ``vpdpbusd`` (lanes: the
activation rows, for the even and for the odd chunk; the weight's four bytes copied
across them); more meet tiles of sixteen weight rows (:mod:`.q8_tiles`; lanes: the
weight rows, each activation row's four bytes copied across them). So a row's result is
the same bits alone, in a verify window, in a batch or in a prefill, whatever rows share
its product.

The error against "dequantize, then multiply in float32" is that of rounding ``x``: at
most ``d / 2`` per value, ``sum |w_i| d_b / 2`` over a row. Formats without integer
quants (F32, F16, BF16) and rows that are not whole 64-value pairs of blocks are not
taken here (:mod:`.q8` sends them to the exact kernels). Products of more rows
(:mod:`.q8_tiles`) take them a slab at a time, so that a slab's activations stay in the
cache while every weight row of a chunk, unpacked once per slab, meets them.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cfunc, types
from numba.extending import overload
from numba.misc.special import literally
from numba.np.numpy_support import carray

from meshnode.engine.cpu import pool
from meshnode.engine.cpu.atomics import ptr_f32, ptr_i64, ptr_u8
from meshnode.engine.cpu.blocks import literal_format
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.fp4 import e8m0_half8
from meshnode.engine.cpu.q8_blocks import (
    OFFSET_SHIFTS,
    block_bytes,
    chunk,
    e8m0_head,
    f16_head,
    minimum_kind,
    offset_area,
    per16,
    signed_bytes,
)
from meshnode.engine.cpu.q8_fp4 import eight_mxfp4, two_mxfp4
from meshnode.engine.cpu.q8_q6_k import eight_q6_k
from meshnode.engine.cpu.q8_quant import HEADER, ONE_ROW_MAX, buffer_bytes, byte_areas, quantized
from meshnode.engine.cpu.q8_superblocks import K_FORMATS, Q4_K_ID, ahead8, eight_q4_k
from meshnode.engine.cpu.q8_tiles import scratch_bytes, tiles
from meshnode.engine.cpu.simd import (
    INNER,
    entry,
    inner,
    tofloat,
    vadd,
    vfma,
    vsplat,
    vzero,
    wadd,
    wfma,
    wmul,
    wzero,
)
from meshnode.engine.cpu.simd_int import (
    bsplat,
    bxor,
    dot4s,
    fload,
    half8,
    imul,
    ivsub,
    lanes2,
    prefetch,
    sdot4,
)
from meshnode.engine.cpu.simd_q8 import (
    dotw_signed,
    dotw_small,
    fload16,
    fold,
    hpairs,
    iadd16,
    iload16,
    imul16,
    ipair,
    ishl16,
    isums,
    join64,
    lane8,
    read_only,
    tofloat16,
    vec8,
    vmul,
    wpair,
)
from meshnode.engine.cpu.variants import variant

# How far ahead of the row it multiplies a product asks for weight bytes: a decode
# product streams its weights from memory once, and one core's hardware prefetchers alone
# left the kernels at about 0.8x the time of the exact ones; with this, about 0.55x
# (SmolLM2's products in forward order, one thread; 2 and 8 KiB did no better).
PREFETCH_BYTES = 4096
# MXFP4's one-row products go two weight rows a register (.q8_fp4)
MXFP4_ID = FORMATS["MXFP4"].kernel_id
# MXFP4 products of up to this many rows go two activation rows a pass of the weights
# (.q8_fp4.two_mxfp4; an odd last one alone): the same bits as one at a time
MXFP4_PAIRED_ROWS = 4
# Activation rows a weight row meets before the next weight row, in products of more rows
# (untiled)
SLAB_ROWS = 16
# Products of this many rows or more go by .q8_tiles (q8.q8_product); fewer: each weight
# row unpacked in registers for each eight activation rows (_group), whose unpacking, a
# row's at a time, costs less than filling a tile's scratch for so few rows (Q4_K, cycles
# a weight and row: 8 rows ~0.09 against ~0.21 tiled; 16 rows ~0.09 against ~0.16; 64
# rows ~0.09 against ~0.06). Not 32, where they break even: the tile kernel compiles
# apart (~7 s of CPU per format mix at load 10), and prompts of 32-63 tokens (the golden
# references') would pay it at a first start for little
TILE_MIN_ROWS = 64
# the words of a posted product (:mod:`.pool`), as compile-time constants
_WORDS = pool.WORDS
_A, _NA, _RBA, _B, _NB, _RBB = pool.A, pool.NA, pool.RBA, pool.B, pool.NB, pool.RBB
_C, _NC, _RBC, _X, _K, _N_IN = pool.C, pool.NC, pool.RBC, pool.X, pool.K, pool.N_IN
_OUT, _N_OUT, _CA, _CB, _ROWS = pool.OUT, pool.N_OUT, pool.CA, pool.CB, pool.ROWS
_SCRATCH, _STRIDE = pool.SCRATCH, pool.STRIDE


# The row kernel's helpers (_group, _eight, _block_dot) are functions of their own, not
# inlined into its numba IR: LLVM still inlines what it finds worth it, and a format's
# first q8 product compiles ~0.7 s sooner (SmolLM2's Q4_1, one thread, load ~5), its
# products as fast (1 and 8 rows, SmolLM2 and Gemma 3).

# -- the arithmetic, the same for every row: for each 32-value chunk c of a weight row in
# turn, its exact integer dot product D with the activation block (the offset term added,
# each half times its integer scale), then acc = fma(float(D), dw * dx, acc) and, for
# the formats with minimums, t = t + m * (dx sum(q)); the result is acc + t.


@inner
def _layout(q):  # type: ignore[no-untyped-def]
    # (n_in, k, n, nb, blocks) of quantize's buffer q
    head = q[:16].view(np.int64)
    n_in, k = head[0], head[1]
    nb = n_in // 32
    return n_in, k, k * n_in, nb, (k + 7) // 8 * nb


@inner
def _group(fmt, w, base, q, g, n, nb, blocks):  # type: ignore[no-untyped-def]
    # one weight row times the eight activation rows of group g: lanes 0-7 the rows for
    # the even chunks, 8-15 for the odd ones
    xt, ot, dxt, sxt = byte_areas(n, blocks)
    area = offset_area(fmt)
    shift = OFFSET_SHIFTS[max(area, 0)]
    kind = minimum_kind(fmt)
    acc, t = wzero(), wzero()
    for p in range(nb // 2):
        u0, dw0, m0, n0, sa0, sb0 = chunk(fmt, w, base, 2 * p)
        u1, dw1, m1, n1, sa1, sb1 = chunk(fmt, w, base, 2 * p + 1)
        u = join64(u0, u1)
        i = g * nb + 2 * p
        x = xt + 256 * i
        lo, hi = ipair(0, 0), ipair(0, 0)
        if signed_bytes(fmt):  # Q8_0's int8 weights as they are: no offset term
            lo = dotw_signed(dotw_signed(lo, u, 0, q, x), u, 1, q, x + 64)
            lo = dotw_signed(dotw_signed(lo, u, 2, q, x + 128), u, 3, q, x + 192)
            hi = dotw_signed(dotw_signed(hi, u, 4, q, x + 256), u, 5, q, x + 320)
            hi = dotw_signed(dotw_signed(hi, u, 6, q, x + 384), u, 7, q, x + 448)
        else:
            if area >= 0:
                lo = ishl16(iload16(q, ot + 32 * i), shift)
                hi = ishl16(iload16(q, ot + 32 * blocks + 32 * i), shift)
            lo = dotw_small(dotw_small(lo, u, 0, q, x), u, 1, q, x + 64)
            lo = dotw_small(dotw_small(lo, u, 2, q, x + 128), u, 3, q, x + 192)
            hi = dotw_small(dotw_small(hi, u, 4, q, x + 256), u, 5, q, x + 320)
            hi = dotw_small(dotw_small(hi, u, 6, q, x + 384), u, 7, q, x + 448)
        if per16(fmt):
            d = iadd16(imul16(lo, ipair(sa0, sa1)), imul16(hi, ipair(sb0, sb1)))
        else:
            d = iadd16(lo, hi)
        dws, ms = wpair(dw0, dw1), wpair(m0, m1)
        if f16_head(fmt):  # a block per chunk, its scale and minimum first: one conversion
            size = block_bytes(fmt)
            dws, ms = hpairs(w, base + 2 * p * size, base + (2 * p + 1) * size)
        acc = wfma(tofloat16(d), wmul(dws, fload16(q, dxt + 32 * i)), acc)
        if kind == 1:
            t = wadd(t, wmul(ms, fload16(q, sxt + 32 * i)))
        elif kind == 2:
            t = wadd(t, wmul(wpair(m0, m1), fload16(q, sxt + 32 * blocks + 32 * i)))
            t = wadd(t, wmul(wpair(n0, n1), fload16(q, sxt + 64 * blocks + 32 * i)))
    if kind != 0:
        return vadd(fold(acc), fold(t))
    return fold(acc)


@inner
def _block_dot(fmt, w, base, c, q, xo, offs):  # type: ignore[no-untyped-def]
    # chunk c of one weight row . the activation block at byte xo: (int32 lanes whose sum
    # is D, dw, m, m2); offs: the block's offset term z sum(q), by four values. Q8_0's
    # int8 weights (u - 128) meet the quants as signed bytes (sdot4: the same D, no
    # offset term), every other format's u (at most 128) by dot4s
    u, dw, m, m2, sa, sb = chunk(fmt, w, base, c)
    if signed_bytes(fmt):
        p = sdot4(bxor(u, 128), q, xo)
    else:
        p = dot4s(u, q, xo)
        if offset_area(fmt) >= 0:
            p = ivsub(p, offs)
    if per16(fmt):
        p = imul(p, lanes2(sa, sb))
    return p, dw, m, m2


@inner
def _eight(fmt, w, bases, q, r, n, nb, blocks):  # type: ignore[no-untyped-def]
    # eight weight rows (at the byte offsets bases) times activation row r (lanes: the
    # weight rows), as _group computes each row; a block per chunk (Q4_0 .. Q8_0)
    _, _, dxt, sxt = byte_areas(n, blocks)
    z = bsplat(1 << OFFSET_SHIFTS[max(offset_area(fmt), 0)])
    b0, b1, b2, b3, b4, b5, b6, b7 = bases
    acc, t, acc1, t1 = vzero(), vzero(), vzero(), vzero()
    for c in range(nb):
        acc, t, acc1, t1 = acc1, t1, acc, t  # chunk c's parity: acc, t even, acc1, t1 odd
        ahead8(w, bases, block_bytes(fmt) * c)  # a block: 18 (Q4_0) .. 34 bytes (Q8_0)
        xo = HEADER + 32 * (r * nb + c)
        offs = dot4s(z, q, xo)  # z times each four quants' sum: exact, shared by the rows
        p0, d0, m0, n0 = _block_dot(fmt, w, b0, c, q, xo, offs)
        p1, d1, m1, n1 = _block_dot(fmt, w, b1, c, q, xo, offs)
        p2, d2, m2, n2 = _block_dot(fmt, w, b2, c, q, xo, offs)
        p3, d3, m3, n3 = _block_dot(fmt, w, b3, c, q, xo, offs)
        p4, d4, m4, n4 = _block_dot(fmt, w, b4, c, q, xo, offs)
        p5, d5, m5, n5 = _block_dot(fmt, w, b5, c, q, xo, offs)
        p6, d6, m6, n6 = _block_dot(fmt, w, b6, c, q, xo, offs)
        p7, d7, m7, n7 = _block_dot(fmt, w, b7, c, q, xo, offs)
        d = isums((p0, p1, p2, p3, p4, p5, p6, p7))
        i = (r // 8) * nb + c
        at = 32 * i + 4 * (r % 8)
        if f16_head(fmt):  # a block per chunk led by its scale: eight rows' at once
            dw = half8(w, bases, block_bytes(fmt) * c)
        elif e8m0_head(fmt):
            dw = e8m0_half8(w, bases, block_bytes(fmt) * c)
        else:
            dw = vec8((d0, d1, d2, d3, d4, d5, d6, d7))
        acc = vfma(tofloat(d), vmul(dw, vsplat(fload(q, dxt + at))), acc)
        kind = minimum_kind(fmt)
        if kind == 1:
            mw = vec8((m0, m1, m2, m3, m4, m5, m6, m7))
            t = vadd(t, vmul(mw, vsplat(fload(q, sxt + at))))
        elif kind == 2:
            mw = vec8((m0, m1, m2, m3, m4, m5, m6, m7))
            t = vadd(t, vmul(mw, vsplat(fload(q, sxt + 32 * blocks + at))))
            mw = vec8((n0, n1, n2, n3, n4, n5, n6, n7))
            t = vadd(t, vmul(mw, vsplat(fload(q, sxt + 64 * blocks + at))))
    if nb % 2:
        acc, t, acc1, t1 = acc1, t1, acc, t
    acc, t = vadd(acc1, acc), vadd(t1, t)  # the odd chunks' + the even chunks'
    if minimum_kind(fmt) != 0:
        acc = vadd(acc, t)
    return acc


def _one_row(fmt: int, w: Any, bases: Any, q: Any, r: int, n: int, nb: int, blocks: int) -> Any:
    # eight weight rows times activation row r (lanes: the weight rows): the K-quants of
    # .q8_superblocks a super-block at a time, MXFP4 two rows a register (.q8_fp4), the
    # other formats by _eight
    raise TypeError("_one_row is for compiled code")


@overload(_one_row, prefer_literal=True, jit_options=INNER)
def _one_row_typed(fmt, w, bases, q, r, n, nb, blocks):  # type: ignore[no-untyped-def]
    kind = literal_format(fmt)
    if kind == MXFP4_ID:

        def mxfp4(fmt, w, bases, q, r, n, nb, blocks):  # type: ignore[no-untyped-def]
            _, ot, dxt, _ = byte_areas(n, blocks)
            at = 32 * (r // 8) * nb + 4 * (r % 8)
            lo, hi = ot + at, ot + 32 * blocks + at
            return eight_mxfp4(w, bases, q, HEADER + 32 * r * nb, dxt + at, lo, hi, nb)

        return mxfp4
    if kind not in K_FORMATS:
        return lambda fmt, w, bases, q, r, n, nb, blocks: _eight(fmt, w, bases, q, r, n, nb, blocks)
    eight = eight_q4_k if kind == Q4_K_ID else eight_q6_k

    def superblocks(fmt, w, bases, q, r, n, nb, blocks):  # type: ignore[no-untyped-def]
        _, _, dxt, sxt = byte_areas(n, blocks)
        at = 32 * (r // 8) * nb + 4 * (r % 8)
        return eight(w, bases, q, HEADER + 32 * r * nb, dxt + at, sxt + at, nb)

    return superblocks


def _two_rows(fmt: int, w: Any, bases: Any, q: Any, r: int, n: int, nb: int, blocks: int) -> Any:
    # eight weight rows times activation rows r and r + 1: MXFP4's two a pass; for the
    # other formats, whose _rows never takes this branch, zeros of its type, so that
    # their _rows compile no MXFP4 code (.q8_fp4.two_mxfp4: ~0.35 s of a first start's
    # CPU; two _one_row calls there compiled _one_row's code twice more, as much)
    raise TypeError("_two_rows is for compiled code")


@overload(_two_rows, prefer_literal=True, jit_options=INNER)
def _two_rows_typed(fmt, w, bases, q, r, n, nb, blocks):  # type: ignore[no-untyped-def]
    if literal_format(fmt) == MXFP4_ID:
        return lambda fmt, w, bases, q, r, n, nb, blocks: _two_mxfp4(w, bases, q, r, n, nb, blocks)
    return lambda fmt, w, bases, q, r, n, nb, blocks: (vzero(), vzero())


@inner
def _two_mxfp4(w, bases, q, r, n, nb, blocks):  # type: ignore[no-untyped-def]
    # eight MXFP4 weight rows times activation rows r and r + 1 (.q8_fp4.two_mxfp4)
    _, ot, dxt, _ = byte_areas(n, blocks)
    at = 32 * (r // 8) * nb + 4 * (r % 8)
    at2 = 32 * ((r + 1) // 8) * nb + 4 * ((r + 1) % 8)
    return two_mxfp4(
        w, bases, q, HEADER + 32 * r * nb, dxt + at, ot + at, ot + 32 * blocks + at,
        HEADER + 32 * (r + 1) * nb, dxt + at2, ot + at2, ot + 32 * blocks + at2, nb,
    )  # fmt: skip


@entry()
def _rows(fmt, raw, q, out, lo, hi, col, s):  # type: ignore[no-untyped-def]
    # weight rows lo .. hi - 1 of one part into columns col + lo .. of out; q: quantize's
    # buffer. One activation row: eight weight rows at a time in the lanes. More: each
    # weight row meets the activation rows eight at a time in the lanes, a slab of
    # SLAB_ROWS of them at a time (each weight row then meets the slab while in L1).
    # s: _tiled_rows' scratch, unused here
    literally(fmt)  # one compiled body per format: its branches fold away
    _, k, n, nb, blocks = _layout(q)
    w, size = raw.reshape(-1), raw.shape[1]
    end = w.shape[0]
    if k <= ONE_ROW_MAX or (fmt == MXFP4_ID and k <= MXFP4_PAIRED_ROWS):
        # lane i takes rows lo + i span, lo + i span + 1, ..: each lane streams a long
        # run of contiguous bytes, and asks for its bytes LANE_AHEAD on
        # (.q8_superblocks.ahead8: eight streams are more than some cores' hardware
        # prefetchers follow). Eight neighbouring rows in the lanes read eight short
        # streams side by side (a row: 1,152 bytes of Q4_K at 2,048 inputs, too short for the
        # prefetchers to learn), so their kernels asked for the next eight rows' bytes a
        # chunk or super-block at a time; on the Llama-3.2-1B shape, whose products are
        # mostly of 2,048 inputs, that left the Q6_K ones at ~1.3x the time of ggml's
        # vec_dot streamed (benchmarks/ggml_kernels.py; 2.2-2.4x without the prefetch),
        # ~0.85x in these lanes. A lane is one row's arithmetic, whatever the others: the
        # same bits in either order. Then the last (hi - lo) % 8 rows side by side, the
        # lanes past them repeating the last.
        span = (hi - lo) // 8
        tail = hi - lo - 8 * span
        for j in range(span + min(tail, 1)):
            o, step, count = lo + j, span, 8
            if j == span:
                o, step, count = lo + 8 * span, 1, tail
            last = o + step * (count - 1)
            bases = (o * size, min(o + step, last) * size, min(o + 2 * step, last) * size,
                     min(o + 3 * step, last) * size, min(o + 4 * step, last) * size,
                     min(o + 5 * step, last) * size, min(o + 6 * step, last) * size,
                     last * size)  # fmt: skip
            for r in range(0, k, 2 if fmt == MXFP4_ID else 1):
                if fmt == MXFP4_ID and r + 1 < k:  # two activation rows a pass
                    v, v2 = _two_rows(fmt, w, bases, q, r, n, nb, blocks)
                    for i in range(count):
                        out[r, col + o + i * step] = lane8(v, i)
                        out[r + 1, col + o + i * step] = lane8(v2, i)
                    continue
                v = _one_row(fmt, w, bases, q, r, n, nb, blocks)
                for i in range(count):
                    out[r, col + o + i * step] = lane8(v, i)
        return
    for first in range(0, k, SLAB_ROWS):
        for o in range(lo, hi):
            base = o * size
            if base + PREFETCH_BYTES < end:  # the row PREFETCH_BYTES ahead
                for line in range(0, size, 64):
                    prefetch(w, base + PREFETCH_BYTES + line)
            for g in range(first // 8, (min(k, first + SLAB_ROWS) + 7) // 8):
                v = _group(fmt, w, base, q, g, n, nb, blocks)
                for i in range(min(8, k - 8 * g)):
                    out[8 * g + i, col + o] = lane8(v, i)


@entry()
def _tiled_rows(fmt, raw, q, out, lo, hi, col, s):  # type: ignore[no-untyped-def]
    # as _rows, by .q8_tiles, for any number of rows: tiles of weight rows unpacked once
    # into the scratch s meet every activation row
    literally(fmt)
    _, k, n, nb, blocks = _layout(q)
    _, ot, dxt, sxt = byte_areas(n, blocks)
    areas = (HEADER + n - n, ot, dxt, sxt)
    tiles(
        fmt,
        raw.reshape(-1),
        raw.shape[1],
        q,
        out,
        lo,
        hi,
        col,
        k,
        nb,
        blocks,
        areas,
        s,
        PREFETCH_BYTES,
    )


def _serial_product(fa: int, fb: int, fc: int, tiled: bool) -> Any:
    # captures ints and a bool only: numba's disk cache keys a closure by a hash of its
    # captured values, and a captured dispatcher (_rows) pickles with a new id in every
    # process, so such a kernel was compiled again at every start (5-10 s of CPU on a
    # warm q8 start); ``if tiled`` on the constant is pruned while compiling
    @entry()
    @variant(fa, fb, fc, tiled)
    def product(a, b, c, x, out):  # type: ignore[no-untyped-def]
        q = quantized(x, out.shape[0])  # here: a numba call costs microseconds
        ends = (a.shape[0], a.shape[0] + b.shape[0])  # int64, not literal: one _rows each
        zero = ends[0] - ends[0]
        s = np.empty(scratch_bytes(x.shape[0] // max(1, out.shape[0])) if tiled else 0, np.uint8)
        if tiled:
            _tiled_rows(fa, a, q, out, zero, a.shape[0], zero, s)
            _tiled_rows(fb, b, q, out, zero, b.shape[0], ends[0], s)
            _tiled_rows(fc, c, q, out, zero, c.shape[0], ends[1], s)
        else:
            _rows(fa, a, q, out, zero, a.shape[0], zero, s)
            _rows(fb, b, q, out, zero, b.shape[0], ends[0], s)
            _rows(fc, c, q, out, zero, c.shape[0], ends[1], s)

    return product


def _chunk_product(fa: int, fb: int, fc: int, tiled: bool) -> Any:
    # ints and a bool captured, no dispatcher: see _serial_product
    @cfunc(types.void(types.int64, types.int64, types.int64), cache=True)
    @variant(fa, fb, fc, tiled)
    def chunk(st_addr, who, ch):  # type: ignore[no-untyped-def]
        # as .kernels' chunks; the posted "x" is quantize's buffer (its first k n_in
        # bytes: the pool sizes chunks by n_in); its scratch (4 n_in float32 a thread)
        # holds the unpacked weight row
        st = carray(ptr_i64(st_addr), (_WORDS,))
        na, nb, nc, k, rows = st[_NA], st[_NB], st[_NC], st[_K], st[_ROWS]
        q = carray(ptr_u8(st[_X]), (buffer_bytes(k, st[_N_IN]),))
        out = carray(ptr_f32(st[_OUT]), (k, st[_N_OUT]))
        s = carray(ptr_u8(st[_SCRATCH] + 4 * who * st[_STRIDE]), (scratch_bytes(st[_N_IN]),))
        ca, cb = st[_CA], st[_CB]
        if ch < ca:
            a = read_only(carray(ptr_u8(st[_A]), (na, st[_RBA])))
            lo = ch * rows
            if tiled:
                _tiled_rows(fa, a, q, out, lo, min(na, lo + rows), na - na, s)
            else:
                _rows(fa, a, q, out, lo, min(na, lo + rows), na - na, s)
        elif ch < ca + cb:
            b = read_only(carray(ptr_u8(st[_B]), (nb, st[_RBB])))
            lo = (ch - ca) * rows
            if tiled:
                _tiled_rows(fb, b, q, out, lo, min(nb, lo + rows), na, s)
            else:
                _rows(fb, b, q, out, lo, min(nb, lo + rows), na, s)
        else:
            c = read_only(carray(ptr_u8(st[_C]), (nc, st[_RBC])))
            lo = (ch - ca - cb) * rows
            if tiled:
                _tiled_rows(fc, c, q, out, lo, min(nc, lo + rows), na + nb, s)
            else:
                _rows(fc, c, q, out, lo, min(nc, lo + rows), na + nb, s)

    return chunk


@functools.cache
def product_kernel(fa: int, fb: int, fc: int, tiled: bool = False) -> Any:
    """``product(a, b, c, x, out)`` as :func:`.kernels.product_kernel`, with ``x``
    quantized first: ``out[r, o] ~ x[r] . row o``, in the calling thread. The formats
    must be in :data:`.q8.Q8_FORMATS`. ``tiled``: by :mod:`.q8_tiles` (the same bits;
    faster from :data:`TILE_MIN_ROWS` rows), compiled apart, so that a node that never
    multiplies so many rows never compiles it."""
    return _serial_product(fa, fb, fc, tiled)


@functools.cache
def chunk_kernel(fa: int, fb: int, fc: int, tiled: bool = False) -> int:
    """The address of the pool's ``chunk(st, who, ch)`` for this product (as
    :func:`.kernels.chunk_kernel`), posted with the first ``k n_in`` bytes of
    :func:`quantized`'s buffer as ``x`` (``k`` rows of ``n_in``, as the exact kernels'
    activations: the pool then cuts the same chunks), the whole buffer kept alive;
    ``tiled`` as :func:`product_kernel`'s."""
    return int(_chunk_product(fa, fb, fc, tiled).address)
