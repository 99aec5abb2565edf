"""The compiled functions of :mod:`.experts`: a run of chosen experts, and the rows' sums.

The product kernels are chosen while compiling, by literal formats (:func:`_product`), and
everything else the functions call is a module global: numba's disk cache keys a closure
by its captured values, and a captured kernel (a dispatcher) pickles differently in each
process, so a closure capturing one would compile anew at every start.

Several threads share a layer's experts through the kernel threads of :mod:`.pool` (which
spin between the products of a forward, so a hand-off costs microseconds): a call's
arguments go into an ``int64`` block (:func:`fill_block`) and the pool's chunk function
(:func:`experts_chunk`) computes one chosen expert a chunk from it, by the same compiled
code (:func:`_expert`) as the serial call (:func:`experts_kernel`): an expert's output is
the same bits on whichever thread, and a chunk run twice (the pool's rule) writes the
same finished rows twice.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cfunc, types
from numba.extending import overload
from numba.np.numpy_support import carray

from meshnode.engine.cpu import kernels, pool, q8_kernels
from meshnode.engine.cpu.atomics import ptr_f32, ptr_i64, ptr_u8
from meshnode.engine.cpu.glu import SILU, clamped_glu, glu
from meshnode.engine.cpu.simd import INNER, entry, inner
from meshnode.engine.cpu.simd_q8 import read_only
from meshnode.engine.cpu.variants import variant

__all__ = [
    "BLOCK_WORDS",
    "ONE_ROW_EXPERTS",
    "TASK_ROWS",
    "experts_chunk",
    "experts_kernel",
    "fill_block",
    "sums",
]

# In --dtype q8, an expert chosen by at most this many rows multiplies them one row at a
# time. The 8-bit product of 2-16 rows (.q8_kernels._group) computes eight rows' lanes
# whatever the count, so a few rows cost it nearly what eight do. Measured on layer 0 of
# the Qwen3-30B-A3B shape (Q4_K, one thread; this call's thread CPU time, 1 and this
# value alternating in one process, load 6-9; the same output bits checked): every row
# sent to the same 8 experts, 4 rows 13.4 -> 9.9 ms, 6
# rows 22 -> 19 (noisy, about even); 8 random decode rows (~52 experts, ~12 of them
# twice) 48 -> 30 ms, 16 rows 123 -> 62. The bits are the same: an 8-bit product computes
# each row alone, whatever rows share it (.q8_kernels). The exact products keep their
# multi-row tiles, which do better there (8 random rows 47 ms against 51 one row at a
# time for experts of at most 4; 2 rows every expert 10.4 against 14.4).
ONE_ROW_EXPERTS = 4


def _product(fa: Any, fb: Any, fc: Any, q8: Any, a: Any, b: Any, c: Any, x: Any, out: Any) -> None:
    """In compiled code: ``out = x @ (a, b, c)`` for rows ``x`` ``[r, in]`` (C order) by
    the product kernel of the literal formats, the exact one (``q8`` 0,
    :func:`.kernels.product_kernel`) or the 8-bit one (``q8`` 1,
    :func:`.q8_kernels.product_kernel`); in q8, at most :data:`ONE_ROW_EXPERTS` rows go
    one row at a time (the same bits: an 8-bit product computes each row alone)."""
    raise TypeError("for compiled code")


@overload(_product, prefer_literal=True, jit_options=INNER)
def _product_typed(fa, fb, fc, q8, a, b, c, x, out):  # type: ignore[no-untyped-def]
    ids = (fa.literal_value, fb.literal_value, fc.literal_value)
    kernel = (q8_kernels if q8.literal_value else kernels).product_kernel(*ids)
    one = ONE_ROW_EXPERTS if q8.literal_value else 1  # rows a product goes one at a time
    if q8.literal_value and all(f == q8_kernels.MXFP4_ID for f in ids):
        one = 1  # MXFP4 takes up to MXFP4_PAIRED_ROWS two a pass (.q8_fp4.two_mxfp4)

    def impl(fa, fb, fc, q8, a, b, c, x, out):  # type: ignore[no-untyped-def]
        if x.shape[0] <= one:
            for i in range(x.shape[0]):
                kernel(a, b, c, x[i], out[i : i + 1])
        else:
            kernel(a, b, c, x.reshape(-1), out)

    return impl


def _expert(*args: Any) -> None:
    """In compiled code, of ``(ga_f, gb_f, gc_f, g_q8, da_f, db_f, dc_f, d_q8, ga, gb, gc,
    da, db, dc, gbias, dbias, kind, alpha, limit, x, j, chosen, starts, order, k, ys)``:
    expert ``chosen[j]`` of :func:`experts_kernel`'s call, for the literal formats
    ``(ga_f, gb_f, gc_f, g_q8)`` of gate/up and ``(da_f, ...)`` of down."""
    raise TypeError("for compiled code")


@overload(_expert, prefer_literal=True, jit_options=INNER)
def _expert_typed(  # type: ignore[no-untyped-def]
    ga_f, gb_f, gc_f, g_q8, da_f, db_f, dc_f, d_q8,
    ga, gb, gc, da, db, dc, gbias, dbias, kind, alpha, limit, x, j, chosen, starts, order, k, ys,
):  # fmt: skip
    gu = tuple(int(f.literal_value) for f in (ga_f, gb_f, gc_f, g_q8))
    dn = tuple(int(f.literal_value) for f in (da_f, db_f, dc_f, d_q8))
    g0, g1, g2, g3 = gu
    d0, d1, d2, d3 = dn

    def impl(  # type: ignore[no-untyped-def]
        ga_f, gb_f, gc_f, g_q8, da_f, db_f, dc_f, d_q8,
        ga, gb, gc, da, db, dc, gbias, dbias, kind, alpha, limit, x, j, chosen, starts, order, k,
        ys,
    ):  # fmt: skip
        width = x.shape[1]
        inter = (ga.shape[1] + gb.shape[1] + gc.shape[1]) // 2
        e = chosen[j]
        lo, hi = starts[j], starts[j + 1]
        rows = hi - lo
        xe = np.empty((rows, width), np.float32)
        for i in range(rows):
            xe[i] = x[order[lo + i] // k]
        g = np.empty((rows, 2 * inter), np.float32)
        _product(g0, g1, g2, g3, ga[e], gb[e], gc[e], xe, g)
        _add_rows(g, gbias, e)
        act = np.empty((rows, inter), np.float32)
        if kind == 0:
            glu(g, SILU, act)
        else:
            clamped_glu(g, alpha, limit, act)
        y = np.empty((rows, width), np.float32)
        _product(d0, d1, d2, d3, da[e], db[e], dc[e], act, y)
        _add_rows(y, dbias, e)
        for i in range(rows):
            ys[order[lo + i]] = y[i]

    return impl


@functools.cache
def experts_kernel(gate_up: tuple[int, int, int, int], down: tuple[int, int, int, int]) -> Any:
    """``experts(ga, gb, gc, da, db, dc, gate_up_bias, down_bias, kind, alpha, limit, x,
    chosen, starts, order, k, ys)`` for gate/up's and down's ``(fa, fb, fc, q8)``: for each
    expert ``chosen[j]``, the rows ``order[starts[j]:starts[j + 1]] // k`` of ``x`` through
    its gate/up product (the parts ``ga[e]``, ``gb[e]``, ``gc[e]``) plus its bias, the
    activation (``kind`` 0: SwiGLU; 1: the clamped SwiGLU of ``alpha`` and ``limit``), its
    down product plus its bias (a bias ``[n, 0]``: none), each row's output into
    ``ys[row k + slot]`` (``order`` holds ``row k + slot``). Each step is the expression
    of :func:`meshnode.engine.moe.expert_mlp` (float32 adds, the same activations)."""
    ga_f, gb_f, gc_f, g_q8 = gate_up
    da_f, db_f, dc_f, d_q8 = down

    @entry(nogil=True)
    @variant(*gate_up, *down)
    def experts(  # type: ignore[no-untyped-def]
        ga, gb, gc, da, db, dc, gbias, dbias, kind, alpha, limit, x, chosen, starts, order, k, ys
    ):
        for j in range(chosen.shape[0]):
            _expert(
                ga_f, gb_f, gc_f, g_q8, da_f, db_f, dc_f, d_q8,
                ga, gb, gc, da, db, dc, gbias, dbias, kind, alpha, limit, x, j, chosen, starts,
                order, k, ys,
            )  # fmt: skip

    return experts


# The words of a shared call's argument block (fill_block writes them, the chunk reads
# them): each stack part (ga, gb, gc, da, db, dc) its address, experts, rows and row
# bytes; each bias its address and width; the scalars (alpha and limit as float32 in
# their word's first half); the arrays' addresses and lengths.
PARTS = 0  # 6 x 4 words
GBIAS, GBIAS_W, DBIAS, DBIAS_W, KIND, ALPHA, LIMIT = range(24, 31)
X, ROWS, WIDTH, CHOSEN, M, STARTS, ORDER, ORDER_LEN, K, YS = range(31, 41)
BLOCK_WORDS = 48
# The pool cuts a job into chunks of TASK_ROWS "rows" of its first part: a job of m
# chosen experts is posted with a dummy part of m * TASK_ROWS rows, one expert a chunk.
TASK_ROWS = pool.CHUNK_ROWS
_WORDS, _X = pool.WORDS, pool.X


@entry()
def fill_block(  # type: ignore[no-untyped-def]
    block, ga, gb, gc, da, db, dc, gbias, dbias, kind, alpha, limit, x, chosen, starts, order,
    k, ys,
):  # fmt: skip
    """Write the arguments of an :func:`experts_kernel` call into ``block``
    ``[BLOCK_WORDS]`` (int64) for :func:`experts_chunk` (every array C-contiguous)."""
    for i, part in enumerate((ga, gb, gc, da, db, dc)):
        at = PARTS + 4 * i
        block[at], block[at + 1] = part.ctypes.data, part.shape[0]
        block[at + 2], block[at + 3] = part.shape[1], part.shape[2]
    block[GBIAS], block[GBIAS_W] = gbias.ctypes.data, gbias.shape[1]
    block[DBIAS], block[DBIAS_W] = dbias.ctypes.data, dbias.shape[1]
    block[KIND] = kind
    f = carray(ptr_f32(block.ctypes.data), (2 * BLOCK_WORDS,))
    f[2 * ALPHA], f[2 * LIMIT] = alpha, limit
    block[X], block[ROWS], block[WIDTH] = x.ctypes.data, x.shape[0], x.shape[1]
    block[CHOSEN], block[M], block[STARTS] = chosen.ctypes.data, chosen.shape[0], starts.ctypes.data
    block[ORDER], block[ORDER_LEN], block[K] = order.ctypes.data, order.shape[0], k
    block[YS] = ys.ctypes.data


@inner
def _stack(b, i):  # type: ignore[no-untyped-def]
    """Stack part ``i`` of the block ``b`` as the read-only ``[n, rows, row bytes]`` array."""
    at = PARTS + 4 * i
    return read_only(carray(ptr_u8(b[at]), (b[at + 1], b[at + 2], b[at + 3])))


def _experts_chunk(gate_up: tuple[int, int, int, int], down: tuple[int, int, int, int]) -> Any:
    # ints captured only, no dispatcher (the module docstring)
    ga_f, gb_f, gc_f, g_q8 = gate_up
    da_f, db_f, dc_f, d_q8 = down

    @cfunc(types.void(types.int64, types.int64, types.int64), cache=True)
    @variant(*gate_up, *down)
    def chunk(st_addr, who, ch):  # type: ignore[no-untyped-def]
        # chunk ch: expert chosen[ch] of the call whose block the job's "x" is
        st = carray(ptr_i64(st_addr), (_WORDS,))
        b = carray(ptr_i64(st[_X]), (BLOCK_WORDS,))
        f = carray(ptr_f32(st[_X]), (2 * BLOCK_WORDS,))
        m = b[M]
        n = b[PARTS + 1]
        gbias = carray(ptr_f32(b[GBIAS]), (n, b[GBIAS_W]))
        dbias = carray(ptr_f32(b[DBIAS]), (n, b[DBIAS_W]))
        x = carray(ptr_f32(b[X]), (b[ROWS], b[WIDTH]))
        chosen = carray(ptr_i64(b[CHOSEN]), (m,))
        starts = carray(ptr_i64(b[STARTS]), (m + 1,))
        order = carray(ptr_i64(b[ORDER]), (b[ORDER_LEN],))
        ys = carray(ptr_f32(b[YS]), (b[ORDER_LEN], b[WIDTH]))
        _expert(
            ga_f, gb_f, gc_f, g_q8, da_f, db_f, dc_f, d_q8,
            _stack(b, 0), _stack(b, 1), _stack(b, 2), _stack(b, 3), _stack(b, 4), _stack(b, 5),
            gbias, dbias, b[KIND], f[2 * ALPHA], f[2 * LIMIT], x, ch, chosen, starts, order, b[K],
            ys,
        )  # fmt: skip

    return chunk


@functools.cache
def experts_chunk(gate_up: tuple[int, int, int, int], down: tuple[int, int, int, int]) -> int:
    """The address of the pool's ``chunk(st, who, ch)`` for :func:`experts_kernel`'s
    formats: chunk ``ch`` computes expert ``chosen[ch]`` of the call whose
    :func:`fill_block` block is posted as the job's ``x``."""
    return int(_experts_chunk(gate_up, down).address)


@inner
def _add_rows(out, bias, e):  # type: ignore[no-untyped-def]
    """``out[i] += bias[e]`` for every row (float32 adds); nothing for a bias ``[n, 0]``."""
    if bias.shape[1] == 0:
        return
    for i in range(out.shape[0]):
        for c in range(out.shape[1]):
            out[i, c] = out[i, c] + bias[e, c]


@entry(nogil=True)
def sums(ys, picks, weights, out):  # type: ignore[no-untyped-def]
    """``out[r]`` = the sum over row r's experts ``picks[r]``, ascending, of
    ``weights[r, s] * ys[r k + s]``, from zero (float32, as NumPy's ``+=`` of products)."""
    rows, k = picks.shape
    width = out.shape[1]
    for r in range(rows):
        slots = np.argsort(picks[r])
        for c in range(width):
            out[r, c] = np.float32(0.0)
        for s in slots:
            w = weights[r, s]
            y = ys[r * k + s]
            for c in range(width):
                out[r, c] = out[r, c] + y[c] * w
