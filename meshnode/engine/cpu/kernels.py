"""Compiled CPU kernels over GGUF blocks: k-row products (row gathers and whole-matrix
decode: :func:`.tiles.decode_kernel`).

The weights of one product come as up to three parts (Q/K/V or gate/up, each ``[out_i,
row bytes]`` in its own format) so a fused projection is one call.
Every weight is dequantized as gguf does it (bit for bit: :mod:`.wide`, :mod:`.groups`),
sixteen values a vector, and then multiplied in float32. **One order for every product:**
output element ``(r, o)`` is one FMA chain ``acc = fma(w[o, j:j+16], x[r, j:j+16], acc)``
over ``j = 0, 16, 32, ...`` in order, then the sixteen lanes summed as a tree
(:func:`.simd.wsum`); so a row's result is the same bits whether it is multiplied alone
or with up to :data:`.matrix.MAX_KERNEL_ROWS` - 1 others, in any position of the batch,
by any thread (issue 35). The terms are those of "dequantize, then multiply"; their order
differs from a plain loop's. Each weight row's bytes are asked for
:data:`PREFETCH_BYTES` ahead; a K-quant's one-row passes ask for the next pass's four rows
instead, a super-block's share at a time between the dot products.

- one activation row (decode): four weight rows a pass, decoded in registers a group at
  a time, each into its own chain (:mod:`.passes`);
- ``k`` rows (verify windows, batches): weight rows are decoded once into a small
  float32 buffer (L1-resident: :mod:`.panels`' eight rows a block of 256 values at a time,
  or four rows whole), then multiplied with the activation rows four at a time as a 4 x 4
  register tile of sixteen-lane vectors (each element its own chain, as above), so ``k``
  rows cost one pass over the weights, the decode is paid once, and every vector loaded
  feeds four FMAs.

The register tiles come in two forms (:func:`tile_form`, chosen while compiling), the
same bits: the above where the CPU has 32 vector registers (AVX-512: :mod:`.panels`, the
plain floats' four rows whole here), and for sixteen (AVX2) :mod:`.narrow`'s tiles of two
rows eight lanes wide over blocks of the decoded rows in the L1, and the K-quants'
one-row passes (Q4_K, Q6_K) reading the four rows' scales from the scratch (broadcast
loads) instead of keeping them in registers that spill.

Each product exists whole, for the calling thread alone, and as a C function computing one
chunk of output rows, for :mod:`.pool`'s threads (which claim chunks one at a time).
Compiled with numba at first use and cached on disk (``cache=True`` in
``NUMBA_CACHE_DIR``, see :mod:`.matrix`); a first start compiles only what its model's
formats use: the formats are compile-time constants, chosen while compiling
(:func:`.blocks.literal_format`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
from numba import cfunc, njit, types
from numba.core.errors import TypingError
from numba.extending import overload
from numba.np.numpy_support import carray

from meshnode.engine.cpu import narrow, panels, passes, pool
from meshnode.engine.cpu.atomics import ptr_f32, ptr_i64, ptr_u8
from meshnode.engine.cpu.blocks import chunk, format_row
from meshnode.engine.cpu.groups import group_chunk, group_chunks, group_scales
from meshnode.engine.cpu.lookup import permutes
from meshnode.engine.cpu.narrow import literal_form
from meshnode.engine.cpu.panels import scratch as panel_scratch
from meshnode.engine.cpu.simd import (
    INNER,
    entry,
    inner,
    line_up,
    lined,
    vstore,
    wfma,
    wlane,
    wload,
    wstore,
    wsum,
    wsums,
    wzero,
)
from meshnode.engine.cpu.simd_int import prefetch
from meshnode.engine.cpu.simd_q8 import read_only
from meshnode.engine.cpu.variants import variant

# How far ahead of the row it decodes a product asks for weight bytes (as the q8 kernels
# do): the hardware prefetchers alone leave a decode product waiting on memory. Measured on
# the weights of both models in forward order, one thread (thread CPU time, load 4-6),
# against none: one activation row 0.68x (Gemma 3's Q8_0 output head, 174 MB), 0.81x
# (SmolLM2's Q4_1 layers), 0.68x (its Q8_0 head); eight rows 0.81-0.91x on the big
# matrices; 2 and 8 KiB did no better.
PREFETCH_BYTES = 4096
# the words of a posted product (:mod:`.pool`), as compile-time constants
_WORDS = pool.WORDS
_A, _NA, _RBA, _B, _NB, _RBB = pool.A, pool.NA, pool.RBA, pool.B, pool.NB, pool.RBB
_C, _NC, _RBC, _X, _K, _N_IN = pool.C, pool.NC, pool.RBC, pool.X, pool.K, pool.N_IN
_OUT, _N_OUT, _SCRATCH, _STRIDE = pool.OUT, pool.N_OUT, pool.SCRATCH, pool.STRIDE
_CA, _CB, _ROWS = pool.CA, pool.CB, pool.ROWS


def _decode_wide(fmt, row, w, base, n_in):  # type: ignore[no-untyped-def]
    # the whole row into w[base : base + n_in], a group at a time (the K-quants' eight
    # sub-blocks of a super-block in one unrolled loop: its header read once)
    n = group_chunks(fmt)
    for g in range(n_in // (32 * n)):
        sc = group_scales(fmt, row, g)
        for s in range(n):
            w0, w1 = group_chunk(fmt, row, g, s, sc)
            o = base + 32 * (n * g + s)
            wstore(w, o, w0)
            wstore(w, o + 16, w1)


def _decode_any(fmt: Any, row: Any, w: Any, base: Any, n_in: Any) -> None:
    raise TypeError("for compiled code")


@overload(_decode_any, prefer_literal=True, jit_options=INNER)
def _decode_typed(fmt, row, w, base, n_in):  # type: ignore[no-untyped-def]
    return _decode_wide if format_row(fmt).lanes == 16 else _decode


def _decode(fmt, row, w, base, n_in):  # type: ignore[no-untyped-def]
    # the whole row into w[base : base + n_in] (float32)
    for c in range(n_in // 32):
        w0, w1, w2, w3 = chunk(fmt, row, c)
        o = base + 32 * c
        vstore(w, o, w0)
        vstore(w, o + 8, w1)
        vstore(w, o + 16, w2)
        vstore(w, o + 24, w3)


@njit(inline="always")
def _dot4x4(w, x, r, n_in):  # type: ignore[no-untyped-def]
    # activation rows r .. r + 3 (x flat, rows of n_in) times the four decoded weight rows
    # of w (flat [4, n_in]), sixteen lanes at a time: 16 accumulators, and each vector
    # loaded serves four FMAs (a register tile, as a GEMM micro-kernel: FMA-bound, where
    # one weight row at a time is bound by its loads of the activations)
    p0, p1, p2, p3 = r * n_in, (r + 1) * n_in, (r + 2) * n_in, (r + 3) * n_in
    q1, q2, q3 = n_in, 2 * n_in, 3 * n_in
    a00, a01, a02, a03 = wzero(), wzero(), wzero(), wzero()
    a10, a11, a12, a13 = wzero(), wzero(), wzero(), wzero()
    a20, a21, a22, a23 = wzero(), wzero(), wzero(), wzero()
    a30, a31, a32, a33 = wzero(), wzero(), wzero(), wzero()
    for j in range(0, n_in, 16):
        w0, w1, w2, w3 = wload(w, j), wload(w, q1 + j), wload(w, q2 + j), wload(w, q3 + j)
        v = wload(x, p0 + j)
        a00, a01, a02, a03 = wfma(w0, v, a00), wfma(w1, v, a01), wfma(w2, v, a02), wfma(w3, v, a03)
        v = wload(x, p1 + j)
        a10, a11, a12, a13 = wfma(w0, v, a10), wfma(w1, v, a11), wfma(w2, v, a12), wfma(w3, v, a13)
        v = wload(x, p2 + j)
        a20, a21, a22, a23 = wfma(w0, v, a20), wfma(w1, v, a21), wfma(w2, v, a22), wfma(w3, v, a23)
        v = wload(x, p3 + j)
        a30, a31, a32, a33 = wfma(w0, v, a30), wfma(w1, v, a31), wfma(w2, v, a32), wfma(w3, v, a33)
    # the sixteen sums as one vector (lane 4 i + j: activation row r + i, weight row j)
    return wsums((
        a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33,
    ))  # fmt: skip


@njit(inline="always")
def _dot2x4(w, x, r, n_in):  # type: ignore[no-untyped-def]
    # activation rows r, r + 1 times the four decoded weight rows of w
    p0, p1, q1, q2, q3 = r * n_in, (r + 1) * n_in, n_in, 2 * n_in, 3 * n_in
    a00, a01, a02, a03 = wzero(), wzero(), wzero(), wzero()
    a10, a11, a12, a13 = wzero(), wzero(), wzero(), wzero()
    for j in range(0, n_in, 16):
        w0, w1, w2, w3 = wload(w, j), wload(w, q1 + j), wload(w, q2 + j), wload(w, q3 + j)
        v = wload(x, p0 + j)
        a00, a01, a02, a03 = wfma(w0, v, a00), wfma(w1, v, a01), wfma(w2, v, a02), wfma(w3, v, a03)
        v = wload(x, p1 + j)
        a10, a11, a12, a13 = wfma(w0, v, a10), wfma(w1, v, a11), wfma(w2, v, a12), wfma(w3, v, a13)
    return (
        wsum(a00), wsum(a01), wsum(a02), wsum(a03),
        wsum(a10), wsum(a11), wsum(a12), wsum(a13),
    )  # fmt: skip


@njit(inline="always")
def _dot1x4(w, x, r, n_in):  # type: ignore[no-untyped-def]
    # activation row r times the four decoded weight rows of w
    p, q1, q2, q3 = r * n_in, n_in, 2 * n_in, 3 * n_in
    a0, a1, a2, a3 = wzero(), wzero(), wzero(), wzero()
    for j in range(0, n_in, 16):
        v = wload(x, p + j)
        a0, a1 = wfma(wload(w, j), v, a0), wfma(wload(w, q1 + j), v, a1)
        a2, a3 = wfma(wload(w, q2 + j), v, a2), wfma(wload(w, q3 + j), v, a3)
    return wsum(a0), wsum(a1), wsum(a2), wsum(a3)


@njit(inline="always")
def _dot_one(w, x, r, n_in):  # type: ignore[no-untyped-def]
    # activation row r times the decoded weight row w[:n_in], one chain as every product's
    p = r * n_in
    a = wzero()
    for j in range(0, n_in, 16):
        a = wfma(wload(w, j), wload(x, p + j), a)
    return wsum(a)


@njit(inline="always")
def _ahead(raw, o):  # type: ignore[no-untyped-def]
    # ask for the cache lines of the weight bytes PREFETCH_BYTES past row o's start
    size = raw.shape[1]
    flat = raw.reshape(-1)
    at = o * size + PREFETCH_BYTES
    if at + size <= flat.shape[0]:
        for line in range(0, size, 64):
            prefetch(flat, at + line)


@inner
def _tiles(w, x, out, c, n_in):  # type: ignore[no-untyped-def]
    # the k activation rows times the four decoded weight rows of w into out[:, c .. c + 3]:
    # 4 x 4 tiles of sixteen-lane vectors (32 registers: AVX-512), then two rows, then one.
    # Its own compiled function, holding no format: one compile serves every format's
    # _fours (inlined by numba, each format's compile copied and typed it again: issue 29)
    k = out.shape[0]
    r: Any = np.int64(0)  # not a literal 0: one compiled _dot4x4
    while r + 4 <= k:
        d = _dot4x4(w, x, r, n_in)
        for i in range(4):
            for j in range(4):
                out[r + i, c + j] = wlane(d, 4 * i + j)
        r += 4
    if r + 2 <= k:
        d2 = _dot2x4(w, x, r, n_in)
        for i in range(2):
            for j in range(4):
                out[r + i, c + j] = d2[4 * i + j]
        r += 2
    if r < k:
        d4 = _dot1x4(w, x, r, n_in)
        for j in range(4):
            out[r, c + j] = d4[j]


def tile_form() -> int:
    """The lanes of the register tiles the k-row products use on this CPU: 16 where it
    has 32 vector registers (AVX-512), else 8 (AVX2's 16 registers would spill a 4 x 4
    tile of sixteen-lane vectors). Both give every output the same bits; the choice is
    only speed. ``MESHNODE_TILE_FORM`` (8 or 16) overrides it, for tests and benchmarks."""
    forced = os.environ.get("MESHNODE_TILE_FORM")
    if forced in ("8", "16"):
        return int(forced)
    return 16 if permutes() else 8


# which activation rows a compiled product serves, a compile-time constant of its _rows:
# one row only (decode), two or more only (.narrow's tiles), or either (chosen at run time).
# A product compiled for one row holds none of the k-row tiles' code, so a node that only
# decodes one stream never compiles them (issue 29: ~3.5 s of a first start's CPU)
ONE_ROW, K_ROWS, ANY_ROWS = 1, 2, 3


@inner
def _rows(fmt, form, many, raw, x, out, lo, hi, col, w):  # type: ignore[no-untyped-def]
    # rows lo .. hi - 1 of one part (format fmt, a compile-time constant: each compiled
    # _rows holds its format's decoder only; form: the registers', tile_form's, another;
    # many: ONE_ROW, K_ROWS or ANY_ROWS, the activation rows it takes) into columns
    # col + lo .. of out; w: float32 [4 n_in] scratch. lo is never negative: said so, LLVM
    # drops the wraparound of negative indices from the row loops (as for a literal 0: as
    # fast, one compiled _rows per format for the serial products and the chunks alike).
    # Its own compiled function, not inlined: numba compiles an overload's implementation
    # (_quads_any's passes) once per caller's compile flags, so inlined into the serial
    # products (an entry point) and the chunks (a cfunc) each pass compiled twice
    lo = max(lo, 0)
    k = out.shape[0]
    n_in = x.shape[0] // k
    o = _quads_any(fmt, form, many, raw, x, out, lo, hi, col, w, n_in)
    while o < hi:  # the last rows of a part whose length is not a multiple of four
        _decode_any(fmt, raw[o], w, np.int64(0), n_in)  # int64: one compiled decoder
        for r in range(k):
            out[r, col + o] = _dot_one(w, x, r, n_in)
        o += 1


def _quads_any(*args: Any) -> Any:  # (fmt, form, many, raw, x, out, o, hi, col, w, n_in)
    raise TypeError("for compiled code")


@overload(_quads_any, prefer_literal=True, jit_options=INNER)
def _quads_typed(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
    # rows o .. of whole passes of four weight rows; returns the first row not done. The
    # one-row passes (every one of them: each format's _pass4 takes four rows while four
    # are left) or the k rows' tiles, as ``many`` says (both for ANY_ROWS, by the row
    # count), chosen while compiling: the format's own passes (.blocks.format_row; a
    # K-quant's by where it keeps its scales, _pass4_k_with; MXFP4's on AVX2, .fp4_exact),
    # and for k rows sixteen registers' .narrow tiles, 32's .panels (each where its scratch
    # holds them, else the rows are left to _rows' row-at-a-time loop, the same sums), the
    # plain floats on 32 _fours. The implementation is the passes' function itself, called
    # by _rows: each layer between them (an overload's lambda, a function that only picks)
    # compiled again, LLVM included, the code it calls (issue 29: ~12 s of a Gemma 3 first
    # start on AVX2), and numba compiles an inline="always" overload whole only to type it
    if not isinstance(many, types.IntegerLiteral):
        raise TypingError(f"the rows a product takes must be a compile-time constant, got {many}")
    if many.literal_value == ONE_ROW:
        return passes.one_row(fmt, form)
    if many.literal_value == K_ROWS:
        if literal_form(form) == 8:
            return narrow.k_rows_of(fmt, form)
        return panels.k_rows if panels.takes(fmt, form) else _fours
    return _either


def _either(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
    # ANY_ROWS: the one-row passes or the k rows' tiles, by the rows at run time
    if out.shape[0] == 1:
        return _quads_any(fmt, form, ONE_ROW, raw, x, out, o, hi, col, w, n_in)
    return _quads_any(fmt, form, K_ROWS, raw, x, out, o, hi, col, w, n_in)


def _fours(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
    # k rows of a plain float format on 32 registers: four weight rows decoded, then a
    # register tile per four activation rows
    o = max(o, 0)  # as _rows' lo
    while o + 4 <= hi:
        for i in range(4):
            _ahead(raw, o + i)
            _decode_any(fmt, raw[o + i], w, i * n_in, n_in)
        _tiles(w, x, out, col + o, n_in)
        o += 4
    return o


@njit(inline="always")
def _scratch(many, n_in):  # type: ignore[no-untyped-def]
    # float32 of a product's scratch: a one-row pass's scales or permuted activations (4
    # n_in), or four decoded rows and .panels' chains
    return 4 * n_in if many == ONE_ROW else panel_scratch(n_in)


def _chunk_product(fa: int, fb: int, fc: int, form: int, many: int) -> Any:
    @cfunc(types.void(types.int64, types.int64, types.int64), cache=True)
    @variant(fa, fb, fc, form, many)
    def chunk(st_addr, who, ch):  # type: ignore[no-untyped-def]
        st = carray(ptr_i64(st_addr), (_WORDS,))
        na, nb, nc, k, n_in, rows = st[_NA], st[_NB], st[_NC], st[_K], st[_N_IN], st[_ROWS]
        x = carray(ptr_f32(st[_X]), (k * n_in,))
        out = carray(ptr_f32(st[_OUT]), (k, st[_N_OUT]))
        # the thread's scratch from its first 64-byte line where its row has room to move
        # up to 15 floats on (the pool's rows: 7 n_in floats, 4 n_in + pool.PANEL_CHAINS
        # at least)
        size = _scratch(many, n_in)
        w_at = st[_SCRATCH] + 4 * who * st[_STRIDE]
        if st[_STRIDE] >= size + 16:
            w_at = line_up(w_at)
        w = carray(ptr_f32(w_at), (size,))
        ca, cb = st[_CA], st[_CB]
        if ch < ca:
            a = read_only(carray(ptr_u8(st[_A]), (na, st[_RBA])))
            lo = ch * rows
            _rows(fa, form, many, a, x, out, lo, min(na, lo + rows), np.int64(0), w)
        elif ch < ca + cb:
            b = read_only(carray(ptr_u8(st[_B]), (nb, st[_RBB])))
            lo = (ch - ca) * rows
            _rows(fb, form, many, b, x, out, lo, min(nb, lo + rows), na, w)
        else:
            c = read_only(carray(ptr_u8(st[_C]), (nc, st[_RBC])))
            lo = (ch - ca - cb) * rows
            _rows(fc, form, many, c, x, out, lo, min(nc, lo + rows), na + nb, w)

    return chunk


def _serial_product(fa: int, fb: int, fc: int, form: int, many: int) -> Any:
    @entry()
    @variant(fa, fb, fc, form, many)
    def product(a, b, c, x, out):  # type: ignore[no-untyped-def]
        zero, na, nab = np.int64(0), a.shape[0], a.shape[0] + b.shape[0]
        w = lined(_scratch(many, x.shape[0] // out.shape[0]))
        # int64 arguments, as the chunks': one compiled _rows per format
        _rows(fa, form, many, a, x, out, zero, na, zero, w)
        _rows(fb, form, many, b, x, out, zero, b.shape[0], na, w)
        _rows(fc, form, many, c, x, out, zero, c.shape[0], nab, w)

    return product


@functools.cache
def product_kernel(fa: int, fb: int, fc: int, many: int = ANY_ROWS) -> Any:
    """``product(a, b, c, x, out)``: ``out[r, o] = x[r] . row o`` of the parts ``a``,
    ``b``, ``c`` (formats ``fa``, ``fb``, ``fc``) stacked along ``out``, in the calling
    thread.

    ``x`` is the activations flattened (``k`` rows of ``n_in``), ``out`` is ``[k, n_out]``;
    an unused part has zero rows. Its own compiled function, not :func:`chunk_kernel`'s
    chunks run in this thread (the same sums): its arrays as arguments, not rebuilt from
    addresses, made one-row products ~5 % faster (SmolLM2's shapes).

    Each format mix is its own compiled function: the ids are compile-time constants in
    it, so each part's decoder is inlined with no dispatch in the loops. numba's disk
    cache keys a closure by its captured values, so each mix compiles once per machine.
    ``many`` (:data:`ONE_ROW`, :data:`K_ROWS`, :data:`ANY_ROWS`): the activation rows it
    takes, one, two or more, or either (the same sums for each row: the row count only
    picks the code), so a node compiles the k-row tiles at its first k-row product only.
    """
    return _serial_product(fa, fb, fc, tile_form(), many)


@functools.cache
def chunk_kernel(fa: int, fb: int, fc: int, many: int = ANY_ROWS) -> int:
    """The address of ``void chunk(st, who, ch)``: chunk ``ch`` (:data:`.pool.CHUNK_ROWS`
    output rows) of the product :func:`.pool.KernelPool.run` posted in the words at
    ``st``, with thread ``who``'s scratch; the same rows and sums as
    :func:`product_kernel`, for the pool's threads.

    Each format mix is its own compiled function: the ids are compile-time constants in
    it, so each part's decoder is inlined with no dispatch in the loops. numba's disk
    cache keys a closure by its captured values, so each mix compiles once per machine.
    ``many`` as :func:`product_kernel`'s.
    """
    return int(_chunk_product(fa, fb, fc, tile_form(), many).address)
