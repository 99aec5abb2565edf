"""The compiled functions of :mod:`.experts`: a run of chosen experts, and the rows' sums.

The product kernels are chosen while compiling, by literal formats (:func:`_product`), and
everything else the functions call is a module global: numba's disk cache keys a closure
by its captured values, and a captured kernel (a dispatcher) pickles differently in each
process, so a closure capturing one would compile anew at every start.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba.extending import overload

from meshnode.engine.cpu import kernels, q8_kernels
from meshnode.engine.cpu.glu import SILU, clamped_glu, glu
from meshnode.engine.cpu.simd import INNER, entry, inner

__all__ = ["ONE_ROW_EXPERTS", "experts_kernel", "sums"]

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

    def impl(fa, fb, fc, q8, a, b, c, x, out):  # type: ignore[no-untyped-def]
        if x.shape[0] <= one:
            for i in range(x.shape[0]):
                kernel(a, b, c, x[i], out[i : i + 1])
        else:
            kernel(a, b, c, x.reshape(-1), out)

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
    def experts(  # type: ignore[no-untyped-def]
        ga, gb, gc, da, db, dc, gbias, dbias, kind, alpha, limit, x, chosen, starts, order, k, ys
    ):
        width = x.shape[1]
        inter = (ga.shape[1] + gb.shape[1] + gc.shape[1]) // 2
        for j in range(chosen.shape[0]):
            e = chosen[j]
            lo, hi = starts[j], starts[j + 1]
            rows = hi - lo
            xe = np.empty((rows, width), np.float32)
            for i in range(rows):
                xe[i] = x[order[lo + i] // k]
            g = np.empty((rows, 2 * inter), np.float32)
            _product(ga_f, gb_f, gc_f, g_q8, ga[e], gb[e], gc[e], xe, g)
            _add_rows(g, gbias, e)
            act = np.empty((rows, inter), np.float32)
            if kind == 0:
                glu(g, SILU, act)
            else:
                clamped_glu(g, alpha, limit, act)
            y = np.empty((rows, width), np.float32)
            _product(da_f, db_f, dc_f, d_q8, da[e], db[e], dc[e], act, y)
            _add_rows(y, dbias, e)
            for i in range(rows):
                ys[order[lo + i]] = y[i]

    return experts


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
