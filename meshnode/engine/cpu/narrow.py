"""The exact k-row products' register tiles for sixteen vector registers (AVX2), the same
bits as :mod:`.kernels`' 4 x 4 tiles of sixteen-lane vectors (which need 32: AVX-512).

Every output ``(r, o)`` of an exact product is sixteen FMA chains, lane ``l`` summing
``w[o, j + l] x[r, j + l]`` for ``j = 0, 16, 32, ...`` in order, then the sixteen lanes
summed as a tree (:func:`.simd.wsum`). A lane's chain does not depend on the other lanes,
so it can be computed eight lanes at a time: lanes 0-7 and lanes 8-15 are two eight-lane
chains, and ``wsum``'s first step adds lane ``l`` and lane ``8 + l``, the rest being
:func:`.simd.vsum`'s tree: ``vsum(lo + hi)`` is the sixteen-lane sum, bit for bit.

A tile here is two activation rows times the four weight rows a pass decodes, eight lanes
wide: eight accumulators and the four weight vectors, twelve registers (a 4 x 4 tile of
sixteen-lane vectors is 32 AVX2 registers of accumulators alone, which LLVM spills). The
four weight rows are decoded a block of :data:`BLOCK` values at a time into the product's
scratch (4 KiB), and every activation row's tiles run over that block before the next is
decoded; the chains' lanes wait in the scratch between blocks (stored and loaded as they
are). So the decoded block and the activations' block stay in the L1 cache, and each
64-byte line of them serves both halves of its sixteen lanes while it is there: run over
whole rows, two passes of half tiles read every line twice from the L2.

One pass for every format (:func:`k_rows`); the format chooses, while compiling, its
decoder of a block (:func:`block_decoder`): :mod:`.groups`' (a group's scales decoded
once), Q8_0 :mod:`.q8_0_exact`'s (an integer add and a fused multiply-add, no
conversion), MXFP4 :mod:`.fp4_exact`'s byte shuffles where the CPU has them. The last
gives the weights in another order, so for it the activations are permuted once a call
(:func:`_permuted`) and the chains put back in their lanes before the sum
(:func:`_unzipped`): every format the same FMA chains, the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.core.errors import TypingError
from numba.np.numpy_support import carray

from meshnode.engine.cpu import fp4_exact
from meshnode.engine.cpu.atomics import ptr_f32
from meshnode.engine.cpu.blocks import format_row
from meshnode.engine.cpu.fp4 import shuffles_bytes
from meshnode.engine.cpu.groups import group_rows
from meshnode.engine.cpu.q8_0_exact import decode_block
from meshnode.engine.cpu.simd import inner, vadd, vfma, vload, vstore, vsum, vzero
from meshnode.engine.cpu.simd_int import prefetch

__all__ = [
    "BLOCK",
    "block_decoder",
    "fits",
    "fp4_shuffled",
    "k_rows",
    "k_rows_fp4",
    "k_rows_of",
    "literal_form",
]

# values of the four weight rows decoded at a time (a K-quant super-block; eight blocks of
# the 32-value formats): 4 KiB of float32
BLOCK = 256
# where the chains' lanes wait in the scratch, after the decoded block
_ACC = 4 * BLOCK


@njit(inline="always")
def fits(n_in, k, scratch):  # type: ignore[no-untyped-def]
    """Whether a scratch of ``scratch`` float32 holds a decoded block and the lanes of
    ``k`` rows' chains (else the rows are left to the row-at-a-time loop, the same
    sums)."""
    return n_in >= BLOCK and scratch >= _ACC + 64 * k


@njit(inline="always")
def _decode_groups(fmt, raw, o, w, j0, m):  # type: ignore[no-untyped-def]
    # values j0 .. j0 + m - 1 of weight rows o .. o + 3 into w[256 i ..] (row i)
    group_rows(fmt, raw, o, 4, w, j0, m, BLOCK)


@njit(inline="always")
def _decode_q8_0(fmt, raw, o, w, j0, m):  # type: ignore[no-untyped-def]
    # Q8_0 by .q8_0_exact's decoder: an integer add and a fused multiply-add a vector, no
    # conversion (the same float32; ~0.79 -> ~0.66 cycles a weight at 8 rows)
    decode_block(raw, o, w, j0, m, BLOCK)


@njit(inline="always")
def _decode_fp4(fmt, raw, o, w, j0, m):  # type: ignore[no-untyped-def]
    # MXFP4 by .fp4_exact's byte shuffles, in its permuted order (_shuffled)
    fp4_exact.decode_block(raw, o, w, j0, m, BLOCK)


def _shuffled(fmt: Any) -> bool:
    # whether MXFP4's passes take .fp4_exact's decoder (256-bit vpshufb: AVX2): its
    # weights come in another order, the activations are permuted to match, and the
    # chains put back in their lanes before the sum (the same bits)
    return format_row(fmt).name == "MXFP4" and shuffles_bytes()


def block_decoder(fmt: Any) -> Any:
    """The format's decoder of a block of four rows (compiled code inlines it; ``fmt`` a
    numba type holding the format id as a compile-time constant)."""
    if _shuffled(fmt):
        return _decode_fp4
    return _decode_q8_0 if format_row(fmt).name == "Q8_0" else _decode_groups


@njit(inline="always")
def _permuted(fmt, x, n):  # type: ignore[no-untyped-def]
    # x[: n] permuted as .fp4_exact's decoder orders the weights, from a 64-byte line
    buf = np.empty(n + 16, np.float32)
    xp = buf[(-(buf.ctypes.data // 4)) % 16 :]
    fp4_exact.permute_rows(x, xp, n)
    return xp


@njit(inline="always")
def _as_they_are(fmt, x, n):  # type: ignore[no-untyped-def]
    return x


@njit(inline="always")
def _unzipped(fmt, lo, hi):  # type: ignore[no-untyped-def]
    # the permuted weights' chains: the even and the odd lanes
    return fp4_exact.unzip_sum(lo, hi)


@njit(inline="always")
def _halves_sum(fmt, lo, hi):  # type: ignore[no-untyped-def]
    # lanes 0-7 and 8-15: the sixteen-lane tree sum
    return vsum(vadd(lo, hi))


@njit(inline="always")
def _block2x4(w, x, r, n_in, j0, m, h):  # type: ignore[no-untyped-def]
    # lanes h .. h + 7 of activation rows r, r + 1 times the block's four weight rows,
    # continuing the chains waiting at _ACC + 64 r + 16 i + h (row r, weight row i)
    p0, p1, at = r * n_in + j0 + h, (r + 1) * n_in + j0 + h, _ACC + 64 * r + h
    a00, a01 = vload(w, at), vload(w, at + 16)
    a02, a03 = vload(w, at + 32), vload(w, at + 48)
    a10, a11 = vload(w, at + 64), vload(w, at + 80)
    a12, a13 = vload(w, at + 96), vload(w, at + 112)
    for j in range(0, m, 16):
        q = h + j
        w0, w1 = vload(w, q), vload(w, BLOCK + q)
        w2, w3 = vload(w, 2 * BLOCK + q), vload(w, 3 * BLOCK + q)
        v = vload(x, p0 + j)
        a00, a01, a02, a03 = vfma(w0, v, a00), vfma(w1, v, a01), vfma(w2, v, a02), vfma(w3, v, a03)
        v = vload(x, p1 + j)
        a10, a11, a12, a13 = vfma(w0, v, a10), vfma(w1, v, a11), vfma(w2, v, a12), vfma(w3, v, a13)
    vstore(w, at, a00)
    vstore(w, at + 16, a01)
    vstore(w, at + 32, a02)
    vstore(w, at + 48, a03)
    vstore(w, at + 64, a10)
    vstore(w, at + 80, a11)
    vstore(w, at + 96, a12)
    vstore(w, at + 112, a13)


@njit(inline="always")
def _block1x4(w, x, r, n_in, j0, m):  # type: ignore[no-untyped-def]
    # activation row r times the block's four weight rows, both halves at once
    p, at = r * n_in + j0, _ACC + 64 * r
    a0, b0 = vload(w, at), vload(w, at + 8)
    a1, b1 = vload(w, at + 16), vload(w, at + 24)
    a2, b2 = vload(w, at + 32), vload(w, at + 40)
    a3, b3 = vload(w, at + 48), vload(w, at + 56)
    for j in range(0, m, 16):
        u, v = vload(x, p + j), vload(x, p + j + 8)
        a0, b0 = vfma(vload(w, j), u, a0), vfma(vload(w, j + 8), v, b0)
        a1, b1 = vfma(vload(w, BLOCK + j), u, a1), vfma(vload(w, BLOCK + j + 8), v, b1)
        a2, b2 = vfma(vload(w, 2 * BLOCK + j), u, a2), vfma(vload(w, 2 * BLOCK + j + 8), v, b2)
        a3, b3 = vfma(vload(w, 3 * BLOCK + j), u, a3), vfma(vload(w, 3 * BLOCK + j + 8), v, b3)
    vstore(w, at, a0)
    vstore(w, at + 8, b0)
    vstore(w, at + 16, a1)
    vstore(w, at + 24, b1)
    vstore(w, at + 32, a2)
    vstore(w, at + 40, b2)
    vstore(w, at + 48, a3)
    vstore(w, at + 56, b3)


@inner
def _tiles(w_at, x_at, k, n_in, j0, m):  # type: ignore[no-untyped-def]
    # the k activation rows (flat at x_at) times the decoded block (in the scratch at
    # w_at), two rows (both halves) at a time. Its own compiled function, holding no
    # format: one compile serves every format's k_rows (inlined, each format's compile
    # typed and lowered the tiles again: ~4 s a format on AVX2, issue 29). Its arrays come
    # as addresses, rebuilt here: as array arguments (a reference count each, and ~20
    # words pushed a call) a call a block made the 2- and 8-row passes 5-10 % slower
    w = carray(ptr_f32(w_at), (_ACC + 64 * k,))
    x = carray(ptr_f32(x_at), (k * n_in,))
    r = 0
    while r + 2 <= k:
        _block2x4(w, x, r, n_in, j0, m, 0)
        _block2x4(w, x, r, n_in, j0, m, 8)
        r += 2
    if r < k:
        _block1x4(w, x, r, n_in, j0, m)


def _k_rows_with(decode: Any, activations: Any, lanes_sum: Any, name: str) -> Any:
    # k_rows with the format's decoder, its activations' order and its chains' sum, each
    # inlined by numba: one function for each (k_rows_of chooses, while compiling), where
    # inline="always" overloads choosing inside one were compiled whole only to be typed
    # (~2 s of a Gemma 3 first start on AVX2, issue 29)
    def k_rows(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
        """Form 8's k-row product (:func:`.kernels.tile_form`; the arguments
        :func:`.kernels._rows`' passes take): weight rows ``o ..`` of ``raw`` (format
        ``fmt``) times the ``k`` activation rows of ``x`` (flat) into columns ``col + o ..``
        of ``out``, four weight rows at a time while four are left, with the float32
        scratch ``w``; returns the first row not done. Where ``w`` does not hold the tiles
        (:func:`fits`), none: the rows are left to the row-at-a-time loop (the same sums).

        The passes' own implementation (``.kernels._quads_any``'s, compiled once a format,
        :func:`k_rows_of`): a function in between, choosing, linked this in and compiled
        it again, LLVM included (issue 29)."""
        o = max(o, 0)
        k = out.shape[0]
        if o + 4 > hi or not fits(n_in, k, w.shape[0]):
            return o
        xs = activations(fmt, x, k * n_in)
        flat, size = raw.reshape(-1), raw.shape[1]
        while o + 4 <= hi:
            ahead = (o + 4) * size  # the next pass's rows, a block's share at a time
            share = (4 * size * BLOCK) // n_in
            for t in range(_ACC, _ACC + 64 * k, 8):
                vstore(w, t, vzero())
            for j0 in range(0, n_in, BLOCK):
                m = min(BLOCK, n_in - j0)
                first = ahead + (share * j0) // BLOCK
                for line in range(0, share, 64):
                    if first + line < flat.shape[0]:
                        prefetch(flat, first + line)
                decode(fmt, raw, o, w, j0, m)
                # by address (both contiguous, as vload reads them), taken here in the loop:
                # so xs (MXFP4's permuted copy) stays alive while the tiles read it
                _tiles(w.ctypes.data, xs.ctypes.data, k, n_in, j0, m)
            for r in range(k):
                for i in range(4):
                    at = _ACC + 64 * r + 16 * i
                    out[r, col + o + i] = lanes_sum(fmt, vload(w, at), vload(w, at + 8))
            o += 4
        return o

    k_rows.__name__ = k_rows.__qualname__ = name
    return k_rows


k_rows = _k_rows_with(_decode_groups, _as_they_are, _halves_sum, "k_rows")
_k_rows_q8_0 = _k_rows_with(_decode_q8_0, _as_they_are, _halves_sum, "k_rows_q8_0")
# MXFP4's, compiled on its own: after its two-row pass (k_rows_fp4)
_rows8_fp4 = inner(_k_rows_with(_decode_fp4, _permuted, _unzipped, "k_rows_shuffled"))


def literal_form(form: Any) -> int:
    """A tile form's value (:func:`.kernels.tile_form`), a compile-time constant."""
    if not isinstance(form, types.IntegerLiteral):
        raise TypingError(f"a tile form must be a compile-time constant, got {form}")
    value: int = form.literal_value
    return value


def fp4_shuffled(fmt: Any, form: Any) -> bool:
    """Whether MXFP4's products take :mod:`.fp4_exact`'s byte-shuffle decoder (the same
    bits): eight-lane tiles and 256-bit ``vpshufb`` (AVX2); AVX-512 keeps :mod:`.lookup`'s
    ``vpermps``."""
    return format_row(fmt).name == "MXFP4" and literal_form(form) == 8 and shuffles_bytes()


def k_rows_fp4(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
    """:func:`k_rows` of MXFP4 on AVX2 (:mod:`.fp4_exact`'s decoder): two rows in
    registers, more by the tiles."""
    if out.shape[0] == 2:
        return fp4_exact.pass2(raw, x, out, o, hi, col, n_in, w)
    return _rows8_fp4(fmt, form, many, raw, x, out, o, hi, col, w, n_in)


def k_rows_of(fmt: Any, form: Any) -> Any:
    """Form 8's k-row passes of a format (compile-time constants, as ``.kernels._quads_any``
    chooses them): :func:`k_rows` with the format's decoder (:func:`block_decoder`), or
    :func:`k_rows_fp4`."""
    if fp4_shuffled(fmt, form):
        return k_rows_fp4
    return _k_rows_q8_0 if format_row(fmt).name == "Q8_0" else k_rows
