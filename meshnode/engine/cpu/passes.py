"""The exact products' one-row passes (decode: one activation row), for :mod:`.kernels`.

Four weight rows a pass, decoded in registers a group at a time (a K-quant's super-block
with its scales decoded once, :mod:`.groups`; a block of the 32-value formats; 32 plain
floats), each into its own chain: four independent chains hide the FMA latency, each
activation vector loaded serves four FMAs, and nothing is stored; the passes over a part
(or a pool's chunk) loop inside one compiled call per format (a call per pass cost ~0.05
cycles a weight: the arrays' reference counts, a reshape, a division). Each output is
:mod:`.kernels`' one order: ``acc = fma(w[o, j:j+16], x[j:j+16], acc)`` over ``j = 0, 16,
..`` in order, then the sixteen lanes summed as a tree, so a row's result is the same bits
as the k-row tiles give it.

:func:`one_row` picks a format's pass while compiling: the 32-value formats'
(:func:`pass4_blocks`), a K-quant's by where it keeps its scales (in registers on 32,
:func:`pass4_k`, but Q6_K's; on sixteen, AVX2, and Q6_K's on 32, from a small scratch:
:func:`pass4_k_buf`, and for Q4_K :func:`pass4_k_rows`, a row at a time through each pair
of sub-blocks; where the CPU has AVX2 and FMA, Q4_K's and Q6_K's steps in assembly,
:mod:`.k_asm`: :func:`pass4_k_asm` and :func:`pass4_k_asm6`), MXFP4's on AVX2
(:mod:`.fp4_exact`). Every pass takes ``(fmt, form, many, raw, x, out, o, hi, col, w,
n_in)``: weight rows ``o .. hi - 1`` of one part, four a pass while four are left, into
columns ``col + o ..`` of ``out``, with ``w`` a float32 scratch of ``4 n_in``; it returns
the first row not done.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from meshnode.engine.cpu import fp4_exact
from meshnode.engine.cpu.blocks import format_row
from meshnode.engine.cpu.groups import group_chunk, group_chunk_at, group_scales
from meshnode.engine.cpu.k_asm import assembles, wq4k_pair, wq6k_steps
from meshnode.engine.cpu.narrow import fp4_shuffled, literal_form
from meshnode.engine.cpu.simd import inner, wfma, wload, wstore, wsum, wzero
from meshnode.engine.cpu.simd_int import prefetch
from meshnode.engine.cpu.sixbit import wq6_join

__all__ = [
    "one_row",
    "pass4_blocks",
    "pass4_fp4",
    "pass4_k",
    "pass4_k_asm",
    "pass4_k_asm6",
    "pass4_k_buf",
    "pass4_k_rows",
]


def one_row(fmt: Any, form: Any) -> Any:
    """The one-row pass of format ``fmt`` for the registers ``form`` (both numba literals:
    :func:`.blocks.format_row`, :func:`.narrow.literal_form`), chosen while compiling."""
    if fp4_shuffled(fmt, form):
        return pass4_fp4
    name = format_row(fmt).name
    if format_row(fmt).block_size != 256:
        return pass4_blocks
    if literal_form(form) != 8 or name not in ("Q4_K", "Q6_K"):
        # Q6_K's scales from the scratch on 32 registers too: each broadcast from memory
        # folds into its multiply, where a lane picked from a register is a shuffle per
        # sixteen values (Q6_K has a scale per sixteen) on the port the sign-extending
        # loads use. AVX-512 (Zen 5), benchmarks/exact_kernels.py --formats Q6_K --rows 1
        # --stat min: 0.107 -> 0.087 cycles a weight in cache, 0.108 -> 0.084 streamed;
        # Q4_K read that way was no faster (0.076 both: its lookup table stays)
        return pass4_k_buf if name == "Q6_K" else pass4_k
    if not assembles():
        return pass4_k_rows if name == "Q4_K" else pass4_k_buf
    return pass4_k_asm if name == "Q4_K" else pass4_k_asm6


@inner
def _step4(fmt, rows, g, s, scales, x, p, acc):  # type: ignore[no-untyped-def]
    # chunk s of group g of four weight rows into their four FMA chains, sixteen values
    # a step in order, as the tiles' (four independent chains hide the FMA latency, and
    # each activation vector loaded serves four FMAs)
    u, v = wload(x, p), wload(x, p + 16)
    w0, w1 = group_chunk(fmt, rows[0], g, s, scales[0])
    a0 = wfma(w1, v, wfma(w0, u, acc[0]))
    w0, w1 = group_chunk(fmt, rows[1], g, s, scales[1])
    a1 = wfma(w1, v, wfma(w0, u, acc[1]))
    w0, w1 = group_chunk(fmt, rows[2], g, s, scales[2])
    a2 = wfma(w1, v, wfma(w0, u, acc[2]))
    w0, w1 = group_chunk(fmt, rows[3], g, s, scales[3])
    a3 = wfma(w1, v, wfma(w0, u, acc[3]))
    return a0, a1, a2, a3


@njit(inline="always")
def _step4_at(fmt, rows, g, s, buf, x, p, acc):  # type: ignore[no-untyped-def]
    # _step4 with the four rows' scales read from buf (row i's at 16 i). Inlined by numba:
    # LLVM inlined Q6_K's but called Q4_K's, eight calls a super-block, each passing the
    # rows (reference counts) and the chains through memory (0.62-0.67x as fast). The
    # scales' places are int64, not literals: one compiled group_chunk_at a format, not
    # four (LLVM inlines it, and the places are constants again)
    u, v, i64 = wload(x, p), wload(x, p + 16), np.int64
    w0, w1 = group_chunk_at(fmt, rows[0], g, s, buf, i64(0))
    a0 = wfma(w1, v, wfma(w0, u, acc[0]))
    w0, w1 = group_chunk_at(fmt, rows[1], g, s, buf, i64(16))
    a1 = wfma(w1, v, wfma(w0, u, acc[1]))
    w0, w1 = group_chunk_at(fmt, rows[2], g, s, buf, i64(32))
    a2 = wfma(w1, v, wfma(w0, u, acc[2]))
    w0, w1 = group_chunk_at(fmt, rows[3], g, s, buf, i64(48))
    a3 = wfma(w1, v, wfma(w0, u, acc[3]))
    return a0, a1, a2, a3


def pass4_blocks(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
    # weight rows o .. hi - 1 of a 32-value format times the one activation row x, four
    # a pass (decoded in registers a block at a time) while four are left, into columns
    # col + o ..; returns the first row not done. The passes loop here, not in the
    # caller: one call per part or chunk, not one per four rows. The next pass's four
    # rows are asked for a block's share at a time, between the dot products, as
    # _pass4_k does a super-block's (a burst of the four rows' lines before each pass
    # left the loads and the arithmetic taking turns: one thread's CPU time beside other
    # work, AVX-512, the burst against the share, cycles a weight streamed / in cache:
    # Q8_0 0.70 -> 0.33 / 0.51 -> 0.28, F16 0.79 -> 0.53 / 0.27 -> 0.21, MXFP4 0.39 ->
    # 0.35 / 0.26 -> 0.37 (the one loss, in cache only); benchmarks/exact_kernels.py).
    # The hints may name bytes past the last row: a prefetch does not fault
    o, none = max(o, 0), (wzero(), wzero(), wzero(), wzero())  # o >= 0: as _rows' lo
    flat, size, blocks = raw.reshape(-1), raw.shape[1], n_in // 32
    last = max(0, flat.shape[0] - 4 * size)  # the last pass asks for its own rows again
    share = 4 * size // blocks  # the four rows' bytes of a block: 68 (MXFP4) .. 512 (F32)
    while o + 4 <= hi:
        ahead = min((o + 4) * size, last)
        rows = raw[o], raw[o + 1], raw[o + 2], raw[o + 3]
        acc = wzero(), wzero(), wzero(), wzero()
        for c in range(blocks):
            at = ahead + share * c  # every line of [at, at + share)
            for line in range(0, share, 64):
                prefetch(flat, at + line)
            prefetch(flat, at + share - 1)
            acc = _step4(fmt, rows, c, 0, none, x, 32 * c, acc)
        _put4(out, col + o, acc)
        o += 4
    return o


def _pass4_k_with(super4: Any, name: str) -> Any:
    # the one-row passes of a K-quant, a super-block at a time: its scales decoded once
    # (super4: _super4_regs or _super4_buf, inlined by numba), one pass function for each
    # (_quads_any chooses, while compiling): an inline="always" overload choosing inside
    # one pass was compiled whole by numba only to type it (1.7 s of a Gemma 3 first start
    # on AVX2, issue 29)
    def pass4(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
        # as pass4_blocks. The next pass's four rows are asked for a super-block's share
        # at a time, between the dot products (a burst of them before the pass left the
        # loads and the arithmetic taking turns)
        o, flat, size = max(o, 0), raw.reshape(-1), raw.shape[1]  # o >= 0: as _rows' lo
        share = 4 * (size // (n_in // 256))
        last = max(0, flat.shape[0] - 4 * size)  # the last pass asks for its own rows again
        while o + 4 <= hi:
            ahead = min((o + 4) * size, last)
            rows = raw[o], raw[o + 1], raw[o + 2], raw[o + 3]
            acc = wzero(), wzero(), wzero(), wzero()
            for g in range(n_in // 256):
                for line in range(0, share, 64):
                    prefetch(flat, ahead + share * g + line)
                acc = super4(fmt, rows, g, w, x, acc)  # w: the scales' buffer
            _put4(out, col + o, acc)
            o += 4
        return o

    pass4.__name__ = pass4.__qualname__ = name
    return pass4


@njit(inline="always")
def _super4_regs(fmt, rows, g, buf, x, acc):  # type: ignore[no-untyped-def]
    # super-block g of the four rows into their chains, the scales held in registers
    sc = (
        group_scales(fmt, rows[0], g),
        group_scales(fmt, rows[1], g),
        group_scales(fmt, rows[2], g),
        group_scales(fmt, rows[3], g),
    )
    for h in range(2):  # four sub-blocks a step: each one's place in its half constant
        p, s = 256 * g + 128 * h, 4 * h
        acc = _step4(fmt, rows, g, s, sc, x, p, acc)
        acc = _step4(fmt, rows, g, s + 1, sc, x, p + 32, acc)
        acc = _step4(fmt, rows, g, s + 2, sc, x, p + 64, acc)
        acc = _step4(fmt, rows, g, s + 3, sc, x, p + 96, acc)
    return acc


@njit(inline="always")
def _super4_buf(fmt, rows, g, buf, x, acc):  # type: ignore[no-untyped-def]
    # the same for sixteen registers (AVX2): the four rows' scales stored in buf (64
    # float32) once a super-block and broadcast from there, not kept in eight registers
    # (spilled) and picked lane by lane with shuffles; the same values, the same chains
    for i in range(4):
        wstore(buf, 16 * i, group_scales(fmt, rows[i], g))
    for h in range(2):
        p, s = 256 * g + 128 * h, 4 * h
        acc = _step4_at(fmt, rows, g, s, buf, x, p, acc)
        acc = _step4_at(fmt, rows, g, s + 1, buf, x, p + 32, acc)
        acc = _step4_at(fmt, rows, g, s + 2, buf, x, p + 64, acc)
        acc = _step4_at(fmt, rows, g, s + 3, buf, x, p + 96, acc)
    return acc


@njit(inline="always")
def _super4_rows(fmt, rows, g, buf, x, acc):  # type: ignore[no-untyped-def]
    # Q4_K's on sixteen registers: as _super4_buf, the scales from buf, but a row at a
    # time through each pair of sub-blocks (2 q and 2 q + 1: the low and the high nibbles
    # of the same 32 bytes), not the four rows through one sub-block. The bytes a row
    # widens for the low nibbles are still in registers for the high ones, where four
    # rows' were spilled to the stack and read back between them (588 instructions a
    # loop of 512 weights, 1069 a loop of 1024 now); the activations are read again for
    # each row, from the L1. Each chain's FMAs in the same order: the same bits
    for i in range(4):
        wstore(buf, 16 * i, group_scales(fmt, rows[i], g))
    p = 256 * g  # four pairs, unrolled here: each pair's places constant
    acc = _pairs4_at(fmt, rows, g, 0, buf, x, p, acc)
    acc = _pairs4_at(fmt, rows, g, 2, buf, x, p + 64, acc)
    acc = _pairs4_at(fmt, rows, g, 4, buf, x, p + 128, acc)
    return _pairs4_at(fmt, rows, g, 6, buf, x, p + 192, acc)


@njit(inline="always")
def _super4_asm(fmt, rows, g, buf, x, acc):  # type: ignore[no-untyped-def]
    # _super4_rows with each row's pair of sub-blocks one block of assembly (.k_asm:
    # the same operations in the same order, no spills)
    for i in range(4):
        wstore(buf, 16 * i, group_scales(fmt, rows[i], g))
    p, qs = 256 * g, 144 * g + 16
    for k in range(4):
        s = 2 * k
        acc = (
            wq4k_pair(rows[0], qs + 32 * k, buf, s, x, p + 64 * k, acc[0]),
            wq4k_pair(rows[1], qs + 32 * k, buf, 16 + s, x, p + 64 * k, acc[1]),
            wq4k_pair(rows[2], qs + 32 * k, buf, 32 + s, x, p + 64 * k, acc[2]),
            wq4k_pair(rows[3], qs + 32 * k, buf, 48 + s, x, p + 64 * k, acc[3]),
        )
    return acc


@njit(inline="always")
def _super4_asm6(fmt, rows, g, buf, x, acc):  # type: ignore[no-untyped-def]
    # Q6_K's on AVX2: the super-block's bytes joined for the four rows first
    # (.sixbit.wq6_join, into buf past their scales, 64 float32 a row), then 64 values of
    # each row at a time one block of assembly (.k_asm: the same operations in the same
    # order as _super4_buf's)
    for i in range(4):
        wstore(buf, 16 * i, group_scales(fmt, rows[i], g))
    for i in range(4):
        for h in range(2):
            wq6_join(rows[i], 210 * g + 64 * h, 210 * g + 128 + 32 * h, buf, 64 + 64 * i + 32 * h)
    for k in range(4):
        p = 256 * g + 64 * k
        acc = (
            wq6k_steps(buf, 64 + 16 * k, 4 * k, x, p, acc[0]),
            wq6k_steps(buf, 128 + 16 * k, 16 + 4 * k, x, p, acc[1]),
            wq6k_steps(buf, 192 + 16 * k, 32 + 4 * k, x, p, acc[2]),
            wq6k_steps(buf, 256 + 16 * k, 48 + 4 * k, x, p, acc[3]),
        )
    return acc


@njit(inline="always")
def _pairs4_at(fmt, rows, g, s, buf, x, p, acc):  # type: ignore[no-untyped-def]
    # sub-blocks s and s + 1 (values p .. p + 63) of the four rows, a row at a time
    i64 = np.int64
    a0 = _pair_at(fmt, rows[0], g, s, buf, i64(0), x, p, acc[0])
    a1 = _pair_at(fmt, rows[1], g, s, buf, i64(16), x, p, acc[1])
    a2 = _pair_at(fmt, rows[2], g, s, buf, i64(32), x, p, acc[2])
    a3 = _pair_at(fmt, rows[3], g, s, buf, i64(48), x, p, acc[3])
    return a0, a1, a2, a3


@njit(inline="always")
def _pair_at(fmt, row, g, s, buf, at, x, p, a):  # type: ignore[no-untyped-def]
    # one row's chain through sub-blocks s and s + 1, sixteen values a step in order
    w0, w1 = group_chunk_at(fmt, row, g, s, buf, at)
    a = wfma(w1, wload(x, p + 16), wfma(w0, wload(x, p), a))
    w0, w1 = group_chunk_at(fmt, row, g, s + 1, buf, at)
    return wfma(w1, wload(x, p + 48), wfma(w0, wload(x, p + 32), a))


# The scales from buf on sixteen registers (the formats whose scales group_scales decodes:
# Q4_K, Q6_K), in registers on 32. A/B on AVX2 (benchmarks/exact_kernels.py, loaded), one
# row against the registers: Q6_K 1.45-1.69x as fast, Q4_K 1.40-1.46x (once _step4_at was
# inlined). Each inlined (numba's inline="always"): as a call, each super-block passed the
# chains through memory (Q6_K's pass ~0.9x as fast). Q4_K there a row at a time through
# each pair of sub-blocks (_super4_rows; Q6_K's pass lost 0.85-0.9x so: its quants are
# joined into buf once a half instead, .sixbit.wq6_join)
pass4_k = _pass4_k_with(_super4_regs, "pass4_k")
pass4_k_buf = _pass4_k_with(_super4_buf, "pass4_k_buf")
pass4_k_rows = _pass4_k_with(_super4_rows, "pass4_k_rows")
pass4_k_asm = _pass4_k_with(_super4_asm, "pass4_k_asm")
pass4_k_asm6 = _pass4_k_with(_super4_asm6, "pass4_k_asm6")


@njit(inline="always")
def _put4(out, c, acc):  # type: ignore[no-untyped-def]
    # the four chains' sums into out[0, c .. c + 3]
    out[0, c] = wsum(acc[0])
    out[0, c + 1] = wsum(acc[1])
    out[0, c + 2] = wsum(acc[2])
    out[0, c + 3] = wsum(acc[3])


def pass4_fp4(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
    # w (4 n_in float32) holds the permuted activation row
    return fp4_exact.pass4(raw, x, out, o, hi, col, n_in, w)
