"""The exact k-row products' passes on AVX-512 (sixteen-lane tiles, 32 registers): panels of
weight rows decoded a block at a time, so at real size the activations' block is read from
the L2 cache once per eight weight rows, not per four.

Every output ``(r, o)`` of an exact product is sixteen FMA chains, lane ``l`` summing
``w[o, j + l] x[r, j + l]`` for ``j = 0, 16, 32, ...`` in order, then the sixteen lanes
summed as a tree (:func:`.simd.wsum`): :mod:`.kernels`' one order. Decoding four weight
rows whole and running the activation rows' 4 x 4 register tiles over them (as before)
reads all ``k`` activation rows again for every four weight rows: eight rows of 2048
float32 are 64 KiB, more than the L1 cache holds beside the decoded rows, and the tiles
waited on the L2 (one thread, eight rows: 0.65-0.95 cycles a weight where the FMAs take
~0.3; rows of 4096 and 14336 the slowest).

A panel here is :data:`ROWS` weight rows (or the last four) decoded :data:`BLOCK` values
at a time into the product's scratch (8 KiB), and every 4 x 4 tile (four weight rows of the
panel, four activation rows) runs over that block before the next is decoded; the chains
wait in the scratch between blocks (stored and loaded as they are, so each chain's FMAs
are the same in the same order). The decoded block, the activations' block (8 rows: 8
KiB) and the chains (8 rows: 4 KiB) stay in the L1 (its 32 KiB on most CPUs at up to 16
rows). Rows shorter than :data:`MIN_N_IN` are decoded whole, four at a time (one block
a panel: the activations and decoded rows fit the L1 there, and a block's chains stored
and loaded cost more than they save).
"""

from __future__ import annotations

from typing import Any

from numba import njit

from meshnode.engine.cpu.blocks import format_row
from meshnode.engine.cpu.groups import group_rows
from meshnode.engine.cpu.narrow import literal_form
from meshnode.engine.cpu.simd import inner, wfma, wlane, wload, wstore, wsum, wsums, wzero
from meshnode.engine.cpu.simd_int import prefetch

__all__ = [
    "BLOCK",
    "CHAINS",
    "MIN_N_IN",
    "ROWS",
    "fits",
    "k_rows",
    "panels",
    "scratch",
    "takes",
]

# weight rows a panel decodes (two register tiles' worth)
ROWS = 8
# values of a panel's rows decoded at a time (a K-quant super-block; eight blocks of the
# 32-value formats): 8 KiB of float32
BLOCK = 256
# The shortest rows decoded a block at a time (shorter ones whole, four rows a panel). One
# thread, eight activation rows, against four rows decoded whole: rows of 2048-14336
# 1.09-1.47x as fast by format, 768-1536 0.91-1.12x, SmolLM2's 8 streams (576, 1536)
# 0.91x (benchmarks/trees.py --streams)
MIN_N_IN = 2048
# float32 of the chains of up to .matrix.MAX_KERNEL_ROWS (16) activation rows: 16 for each
# activation row and weight row of a panel (row r, weight row i at 16 (r ROWS + i) past
# the blocks)
CHAINS = 16 * ROWS * 16


@njit(inline="always")
def scratch(n_in):  # type: ignore[no-untyped-def]
    """Float32 of a k-row product's scratch for rows of ``n_in``: a panel's decoded block
    or four rows decoded whole (4 ``n_in`` at most), then the chains (:data:`CHAINS`)."""
    return 4 * n_in + CHAINS


@njit(inline="always")
def _layout(n_in):  # type: ignore[no-untyped-def]
    # (weight rows a panel, values a block, where the chains begin)
    if n_in >= MIN_N_IN:
        return ROWS, BLOCK, ROWS * BLOCK
    return 4, n_in, 4 * n_in


@njit(inline="always")
def fits(n_in, k, size):  # type: ignore[no-untyped-def]
    """Whether a scratch of ``size`` float32 holds the blocks and the chains of ``k``
    activation rows of ``n_in`` (else the rows are left to the row-at-a-time loop, the
    same sums)."""
    return size >= _layout(n_in)[2] + 16 * ROWS * k


@njit(inline="always")
def _chain(w, at, first):  # type: ignore[no-untyped-def]
    # a chain's lanes waiting at w[at ..], or zeros before the first block
    return wzero() if first else wload(w, at)


@njit(inline="always")
def _tile4(w, x, q, r, n_in, j0, m, blk, c, first):  # type: ignore[no-untyped-def]
    # activation rows r .. r + 3 times the block of the panel's weight rows 4q .. 4q + 3
    # (w[blk i ..]: row i), continuing their chains (at c + 16 (r ROWS + i))
    q0, q1, q2, q3 = 4 * q * blk, (4 * q + 1) * blk, (4 * q + 2) * blk, (4 * q + 3) * blk
    p0, p1, p2, p3 = r * n_in + j0, (r + 1) * n_in + j0, (r + 2) * n_in + j0, (r + 3) * n_in + j0
    c0 = c + 16 * (r * ROWS + 4 * q)
    c1, c2, c3 = c0 + 16 * ROWS, c0 + 32 * ROWS, c0 + 48 * ROWS
    a00, a01 = _chain(w, c0, first), _chain(w, c0 + 16, first)
    a02, a03 = _chain(w, c0 + 32, first), _chain(w, c0 + 48, first)
    a10, a11 = _chain(w, c1, first), _chain(w, c1 + 16, first)
    a12, a13 = _chain(w, c1 + 32, first), _chain(w, c1 + 48, first)
    a20, a21 = _chain(w, c2, first), _chain(w, c2 + 16, first)
    a22, a23 = _chain(w, c2 + 32, first), _chain(w, c2 + 48, first)
    a30, a31 = _chain(w, c3, first), _chain(w, c3 + 16, first)
    a32, a33 = _chain(w, c3 + 32, first), _chain(w, c3 + 48, first)
    for j in range(0, m, 16):
        w0, w1, w2, w3 = wload(w, q0 + j), wload(w, q1 + j), wload(w, q2 + j), wload(w, q3 + j)
        v = wload(x, p0 + j)
        a00, a01, a02, a03 = wfma(w0, v, a00), wfma(w1, v, a01), wfma(w2, v, a02), wfma(w3, v, a03)
        v = wload(x, p1 + j)
        a10, a11, a12, a13 = wfma(w0, v, a10), wfma(w1, v, a11), wfma(w2, v, a12), wfma(w3, v, a13)
        v = wload(x, p2 + j)
        a20, a21, a22, a23 = wfma(w0, v, a20), wfma(w1, v, a21), wfma(w2, v, a22), wfma(w3, v, a23)
        v = wload(x, p3 + j)
        a30, a31, a32, a33 = wfma(w0, v, a30), wfma(w1, v, a31), wfma(w2, v, a32), wfma(w3, v, a33)
    wstore(w, c0, a00)
    wstore(w, c0 + 16, a01)
    wstore(w, c0 + 32, a02)
    wstore(w, c0 + 48, a03)
    wstore(w, c1, a10)
    wstore(w, c1 + 16, a11)
    wstore(w, c1 + 32, a12)
    wstore(w, c1 + 48, a13)
    wstore(w, c2, a20)
    wstore(w, c2 + 16, a21)
    wstore(w, c2 + 32, a22)
    wstore(w, c2 + 48, a23)
    wstore(w, c3, a30)
    wstore(w, c3 + 16, a31)
    wstore(w, c3 + 32, a32)
    wstore(w, c3 + 48, a33)


@njit(inline="always")
def _tile2(w, x, q, r, n_in, j0, m, blk, c, first):  # type: ignore[no-untyped-def]
    # activation rows r, r + 1 times the block of the panel's weight rows 4q .. 4q + 3
    q0, q1, q2, q3 = 4 * q * blk, (4 * q + 1) * blk, (4 * q + 2) * blk, (4 * q + 3) * blk
    p0, p1 = r * n_in + j0, (r + 1) * n_in + j0
    c0 = c + 16 * (r * ROWS + 4 * q)
    c1 = c0 + 16 * ROWS
    a00, a01 = _chain(w, c0, first), _chain(w, c0 + 16, first)
    a02, a03 = _chain(w, c0 + 32, first), _chain(w, c0 + 48, first)
    a10, a11 = _chain(w, c1, first), _chain(w, c1 + 16, first)
    a12, a13 = _chain(w, c1 + 32, first), _chain(w, c1 + 48, first)
    for j in range(0, m, 16):
        w0, w1, w2, w3 = wload(w, q0 + j), wload(w, q1 + j), wload(w, q2 + j), wload(w, q3 + j)
        v = wload(x, p0 + j)
        a00, a01, a02, a03 = wfma(w0, v, a00), wfma(w1, v, a01), wfma(w2, v, a02), wfma(w3, v, a03)
        v = wload(x, p1 + j)
        a10, a11, a12, a13 = wfma(w0, v, a10), wfma(w1, v, a11), wfma(w2, v, a12), wfma(w3, v, a13)
    wstore(w, c0, a00)
    wstore(w, c0 + 16, a01)
    wstore(w, c0 + 32, a02)
    wstore(w, c0 + 48, a03)
    wstore(w, c1, a10)
    wstore(w, c1 + 16, a11)
    wstore(w, c1 + 32, a12)
    wstore(w, c1 + 48, a13)


@njit(inline="always")
def _tile1(w, x, q, r, n_in, j0, m, blk, c, first):  # type: ignore[no-untyped-def]
    # activation row r times the block of the panel's weight rows 4q .. 4q + 3
    q0, q1, q2, q3 = 4 * q * blk, (4 * q + 1) * blk, (4 * q + 2) * blk, (4 * q + 3) * blk
    p = r * n_in + j0
    c0 = c + 16 * (r * ROWS + 4 * q)
    a0, a1 = _chain(w, c0, first), _chain(w, c0 + 16, first)
    a2, a3 = _chain(w, c0 + 32, first), _chain(w, c0 + 48, first)
    for j in range(0, m, 16):
        v = wload(x, p + j)
        a0, a1 = wfma(wload(w, q0 + j), v, a0), wfma(wload(w, q1 + j), v, a1)
        a2, a3 = wfma(wload(w, q2 + j), v, a2), wfma(wload(w, q3 + j), v, a3)
    wstore(w, c0, a0)
    wstore(w, c0 + 16, a1)
    wstore(w, c0 + 32, a2)
    wstore(w, c0 + 48, a3)


@njit(inline="always")
def _sums(w, out, r, q, col, c):  # type: ignore[no-untyped-def]
    # the chains of activation rows r .. r + 3 and the panel's weight rows 4q .. 4q + 3 into
    # out[r .., col + 4q ..]: sixteen tree sums at once (.simd.wsums, each wsum's bits)
    c0 = c + 16 * (r * ROWS + 4 * q)
    c1, c2, c3 = c0 + 16 * ROWS, c0 + 32 * ROWS, c0 + 48 * ROWS
    d = wsums((
        wload(w, c0), wload(w, c0 + 16), wload(w, c0 + 32), wload(w, c0 + 48),
        wload(w, c1), wload(w, c1 + 16), wload(w, c1 + 32), wload(w, c1 + 48),
        wload(w, c2), wload(w, c2 + 16), wload(w, c2 + 32), wload(w, c2 + 48),
        wload(w, c3), wload(w, c3 + 16), wload(w, c3 + 32), wload(w, c3 + 48),
    ))  # fmt: skip
    for i in range(4):
        for j in range(4):
            out[r + i, col + 4 * q + j] = wlane(d, 4 * i + j)


@inner
def _block(w, x, k, rows, n_in, j0, m, blk, c, first):  # type: ignore[no-untyped-def]
    # the k activation rows times the decoded block (values j0 .. j0 + m - 1) of a panel's
    # rows, every 4 x 4 tile (then the 2 x 4 and 1 x 4 of the last rows) continuing its
    # chains. Its own compiled function, not inlined in each format's panels: it holds no
    # format, so one compile serves them all (numba typed and lowered the tiles once per
    # format, ~3 s of a first start each)
    for q in range(rows // 4):
        r = 0
        while r + 4 <= k:
            _tile4(w, x, q, r, n_in, j0, m, blk, c, first)
            r += 4
        if r + 2 <= k:
            _tile2(w, x, q, r, n_in, j0, m, blk, c, first)
            r += 2
        if r < k:
            _tile1(w, x, q, r, n_in, j0, m, blk, c, first)


@inner
def _panel_sums(w, out, k, rows, col, c):  # type: ignore[no-untyped-def]
    # a panel's chains into out[.., col ..] (col: its first weight row's column), one
    # compile for every format as _block's
    r = 0
    while r + 4 <= k:
        for q in range(rows // 4):
            _sums(w, out, r, q, col, c)
        r += 4
    while r < k:
        for i in range(rows):
            out[r, col + i] = wsum(wload(w, c + 16 * (r * ROWS + i)))
        r += 1


@inner
def panels(fmt, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
    """Weight rows ``o ..`` of ``raw`` (format ``fmt``) times the ``k`` activation rows of
    ``x`` (flat) into columns ``col + o ..`` of ``out``: panels of :data:`ROWS` weight rows
    while that many are left, then one of four while four are (rows shorter than
    :data:`MIN_N_IN`: four at a time, decoded whole), with the float32 scratch ``w``
    (:func:`fits` it); returns the first row not done (a part's last rows when its length
    is not a multiple of four)."""
    o = max(o, 0)
    k = out.shape[0]
    most, blk, c = _layout(n_in)
    flat, size = raw.reshape(-1), raw.shape[1]
    share = (most * size * blk) // n_in  # bytes of a panel's rows a block covers
    while o + 4 <= hi:
        rows = most if o + most <= hi else 4
        ahead = (o + rows) * size  # the next panel's bytes, a block's share at a time
        for j0 in range(0, n_in, blk):
            m = min(blk, n_in - j0)
            first = ahead + (share * j0) // blk
            for line in range(0, share, 64):
                if first + line < flat.shape[0]:
                    prefetch(flat, first + line)
            group_rows(fmt, raw, o, rows, w, j0, m, blk)
            _block(w, x, k, rows, n_in, j0, m, blk, c, j0 == 0)
        _panel_sums(w, out, k, rows, col + o, c)
        o += rows
    return o


def takes(fmt: Any, form: Any) -> bool:
    """Whether panels take a k-row product's rows (compile-time constants: the format
    and the tile form, :func:`.kernels.tile_form`): sixteen-lane tiles (AVX-512's 32
    registers) and a format decoded sixteen lanes a vector (every quantized one; the plain
    floats keep :mod:`.kernels`' four-row passes)."""
    return literal_form(form) == 16 and format_row(fmt).lanes == 16


def k_rows(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
    """Form 16's k-row product of weight rows ``o ..`` of a format panels :func:`takes`
    (the arguments :func:`.kernels._rows`' passes take): :func:`panels` where the scratch
    :func:`fits`, else ``o`` (the rows left to the row-at-a-time loop, the same sums);
    returns the first row not done."""
    if not fits(n_in, out.shape[0], w.shape[0]):
        return o
    return panels(fmt, raw, x, out, o, hi, col, w, n_in)
