"""A block of query rows' attention over one KV head of one sequence's cache: the dot
products and softmax of :mod:`.attention`'s kernel (its weighted sums are
:mod:`.attention_values`'); and the softmax of a
long segment's block of scores (:func:`block_softmax`, for
:func:`meshnode.engine.attention.blocked_attention`, whose products are BLAS's).

The rows are a segment's new rows (a verify window, a short prompt, or a decode step's
one row) at consecutive positions, each with its group's G query heads; each row sees the
keys from its first (0, or the sliding window's start) to its own position. Each block of
sixteen keys, and each block of values (:data:`VALUES` floats), is read once for every
row that sees one of its keys, while it is in L1, rather than once per row: the KV cache
of a window of 8 rows is read once, not 8 times. Within a block the work is cut to fit the
registers (sixteen 8-lane ones with AVX2, where a sixteen-lane vector takes two): the dot
products two queries at a time against two keys (:func:`_tile2`: four sixteen-lane
accumulators, each key and query vector loaded once per step for two products), their
sums across lanes begun in registers (:func:`.simd_sums.wpair`) and ended sixteen keys at
a time (:func:`.simd_sums.wsums_pairs`); the weighted sums of the rows that see every key
of a block of values six queries at a time across rows, sixteen lanes of the head
dimension at a time (:func:`_accumulate6`),
the other rows' two queries at a time over thirty-two lanes. Sixteen accumulators of
sixteen lanes (64 lanes of a value row for two queries, or sixteen keys for one query)
spilled to memory at every step: a resumed suffix of 170 rows over a 1,630-position cache
(issue 30) took 1.6x as long with them (docs/performance.md, "Prefix caching").

What makes it exact is that each query's result is summed in one fixed order whatever
rows it is computed with: a score is the query's dot product with a key over the head
dimension in sixteen float32 lanes, then across the lanes as :func:`.simd.wsum` sums
(:func:`.simd.wsums` makes sixteen such sums at once, each the same bits), times the
scale; the softmax is :func:`softmax` over the row's own scores (the same lanes whatever
block a key came in); the weighted sum runs key by key in order from the row's first key,
each of its sixteen-lane accumulators resumed from memory between blocks. So a row's
output is the same bits alone (decode), in a window (verify), or in a batch. A single
row (decode: nothing to share) takes leaner loops with the same sums: its blocks of keys
counted from its first key, each query's weighted sum in one pass, accumulators in
registers (about 5% faster than the shared loops on one row).

Scores: ``scores[q stride + PAD + j - lo]`` for query ``q = row G + g`` and key ``j``
(``lo`` the row's first key). A block of sixteen keys is stored whole for every query of
a row that sees one of them, so a row's PAD floats either side take the lanes outside its
keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import overload

from meshnode.engine.cpu.simd import wadd, wfma, wload, wmul, wsplat, wstore, wsum, wsums, wzero
from meshnode.engine.cpu.simd_kv import line_of, prefetch_kv, wload_kv
from meshnode.engine.cpu.simd_sums import wpair, wsums_pairs
from meshnode.engine.cpu.vexp import wdiv, wexp_nonpositive, wmax, wmax_lane
from meshnode.engine.kv_cache import KV_BLOCK

__all__ = [
    "LANES",
    "PAD",
    "TILE_SUMS",
    "VALUES",
    "block_softmax",
    "first_key",
    "key_scores",
    "query_first_key",
    "slot_row",
    "softmax",
    "staged",
]

# Sixteen float32 lanes per step over the head dimension (simd.F32x16).
LANES = 16
# A query's scores sit PAD floats into its row of the score buffer, with PAD after its
# last (rounded up to sixteen).
PAD = LANES
# How far ahead (float32 elements: 4 KiB) a single row's weighted sum asks for values.
AHEAD = 1024
# Floats of values read per block by the weighted sums (8 KiB: in L1 with the rows'
# accumulators), at least sixteen keys.
VALUES = 2048
# Floats of scratch past a block of keys (LANES D) that key_scores takes for the
# first-level sums of two queries with a block's sixteen keys (_tile2).
TILE_SUMS = 2 * LANES * LANES // 2


@njit(nogil=True, cache=True, inline="always")
def _dot(a, i, b, j, d):  # type: ignore[no-untyped-def]
    # a[i : i + D] . b[j : j + D] in sixteen lanes, not yet summed across them (b: keys,
    # float32 or float16 widened)
    acc = wmul(wload(a, i), wload_kv(b, j))
    for c in range(LANES, d, LANES):
        acc = wfma(wload(a, i + c), wload_kv(b, j + c), acc)
    return acc


@njit(nogil=True, cache=True, inline="always")
def _scores16(q, q0, kc, at, d):  # type: ignore[no-untyped-def]
    # wsums of _dot(q, q0, kc, at + i D, d) for the sixteen keys i = 0..15: the same
    # products and sums in the same order (so the same bits), the sixteen keys' chains
    # interleaved (sixteen accumulators in registers, each step of the head dimension's
    # query vector loaded once), where sixteen _dot one after the other each wait on
    # their own FMAs
    x = wload(q, q0)
    a0, a1 = wmul(x, wload_kv(kc, at)), wmul(x, wload_kv(kc, at + d))
    a2, a3 = wmul(x, wload_kv(kc, at + 2 * d)), wmul(x, wload_kv(kc, at + 3 * d))
    a4, a5 = wmul(x, wload_kv(kc, at + 4 * d)), wmul(x, wload_kv(kc, at + 5 * d))
    a6, a7 = wmul(x, wload_kv(kc, at + 6 * d)), wmul(x, wload_kv(kc, at + 7 * d))
    a8, a9 = wmul(x, wload_kv(kc, at + 8 * d)), wmul(x, wload_kv(kc, at + 9 * d))
    a10, a11 = wmul(x, wload_kv(kc, at + 10 * d)), wmul(x, wload_kv(kc, at + 11 * d))
    a12, a13 = wmul(x, wload_kv(kc, at + 12 * d)), wmul(x, wload_kv(kc, at + 13 * d))
    a14, a15 = wmul(x, wload_kv(kc, at + 14 * d)), wmul(x, wload_kv(kc, at + 15 * d))
    for c in range(LANES, d, LANES):
        x, k = wload(q, q0 + c), at + c
        a0, a1 = wfma(x, wload_kv(kc, k), a0), wfma(x, wload_kv(kc, k + d), a1)
        a2, a3 = wfma(x, wload_kv(kc, k + 2 * d), a2), wfma(x, wload_kv(kc, k + 3 * d), a3)
        a4, a5 = wfma(x, wload_kv(kc, k + 4 * d), a4), wfma(x, wload_kv(kc, k + 5 * d), a5)
        a6, a7 = wfma(x, wload_kv(kc, k + 6 * d), a6), wfma(x, wload_kv(kc, k + 7 * d), a7)
        a8, a9 = wfma(x, wload_kv(kc, k + 8 * d), a8), wfma(x, wload_kv(kc, k + 9 * d), a9)
        a10, a11 = wfma(x, wload_kv(kc, k + 10 * d), a10), wfma(x, wload_kv(kc, k + 11 * d), a11)
        a12, a13 = wfma(x, wload_kv(kc, k + 12 * d), a12), wfma(x, wload_kv(kc, k + 13 * d), a13)
        a14, a15 = wfma(x, wload_kv(kc, k + 14 * d), a14), wfma(x, wload_kv(kc, k + 15 * d), a15)
    return wsums((a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15))


@njit(nogil=True, cache=True, inline="always")
def _pairs8(sums, at):  # type: ignore[no-untyped-def]
    # wsums of sixteen keys' dot products from their first level (_tile2's eight wpair
    # vectors at sums[at], sums[at + 16]...)
    return wsums_pairs(
        (
            wload(sums, at), wload(sums, at + LANES), wload(sums, at + 2 * LANES),
            wload(sums, at + 3 * LANES), wload(sums, at + 4 * LANES),
            wload(sums, at + 5 * LANES), wload(sums, at + 6 * LANES),
            wload(sums, at + 7 * LANES),
        )
    )  # fmt: skip


@njit(nogil=True, cache=True, inline="always")
def _step2(q, q0, q1, keys, a, b, a0, b0, a1, b1):  # type: ignore[no-untyped-def]
    # one sixteen-lane step of the head dimension of _tile2: queries at q0 and q1, keys at
    # a and b (each loaded once for both queries)
    ka, kb = wload(keys, a), wload(keys, b)
    x = wload(q, q0)
    a0, b0 = wfma(x, ka, a0), wfma(x, kb, b0)
    x = wload(q, q1)
    return a0, b0, wfma(x, ka, a1), wfma(x, kb, b1)


@njit(nogil=True, cache=True, inline="always")
def _begin2(q, q0, q1, keys, a, b):  # type: ignore[no-untyped-def]
    # the first step of _tile2 (products, no sums yet)
    ka, kb = wload(keys, a), wload(keys, b)
    x = wload(q, q0)
    a0, b0 = wmul(x, ka), wmul(x, kb)
    x = wload(q, q1)
    return a0, b0, wmul(x, ka), wmul(x, kb)


@njit(nogil=True, cache=True)
def _tile2(q, q0, keys, k0, d, sums):  # type: ignore[no-untyped-def]
    # _dot(q, q0 + i D, keys, k0 + k D, d) for two queries i and the sixteen keys k of a
    # block (float32: staged), two keys at a time: eight accumulators, the two keys'
    # vectors and a query's in registers, each loaded once per step of the head
    # dimension (in order, each the same product and sum as _dot's: the same bits); the
    # first level of their wsums taken at once (wpair), into sums[(i 8 + k / 2) 16 ...].
    # D a multiple of 64 (else _tile2_any): four steps at a time, straight code (a loop
    # of one step each, or a test of D inside the keys' loop, took ~1.2x as long)
    q1 = q0 + d
    for k in range(0, LANES, 2):
        a = k0 + k * d
        b = a + d
        a0, b0, a1, b1 = _begin2(q, q0, q1, keys, a, b)
        for c in range(LANES, 4 * LANES, LANES):  # constant bounds: unrolled
            a0, b0, a1, b1 = _step2(q, q0 + c, q1 + c, keys, a + c, b + c, a0, b0, a1, b1)
        for c4 in range(4 * LANES, d, 4 * LANES):
            for c in range(c4, c4 + 4 * LANES, LANES):
                a0, b0, a1, b1 = _step2(q, q0 + c, q1 + c, keys, a + c, b + c, a0, b0, a1, b1)
        at = k * LANES // 2
        wstore(sums, at, wpair(a0, b0))
        wstore(sums, at + LANES * LANES // 2, wpair(a1, b1))


@njit(nogil=True, cache=True)
def _tile2_any(q, q0, keys, k0, d, sums):  # type: ignore[no-untyped-def]
    # _tile2 for any D (a multiple of sixteen), a step at a time
    q1 = q0 + d
    for k in range(0, LANES, 2):
        a = k0 + k * d
        b = a + d
        a0, b0, a1, b1 = _begin2(q, q0, q1, keys, a, b)
        for c in range(LANES, d, LANES):
            a0, b0, a1, b1 = _step2(q, q0 + c, q1 + c, keys, a + c, b + c, a0, b0, a1, b1)
        at = k * LANES // 2
        wstore(sums, at, wpair(a0, b0))
        wstore(sums, at + LANES * LANES // 2, wpair(a1, b1))


@njit(nogil=True, cache=True, inline="always")
def first_key(pos, window):  # type: ignore[no-untyped-def]
    """The first position a query at ``pos`` sees (``window``: the sliding window, 0 if
    none)."""
    return 0 if window == 0 else max(0, pos - window + 1)


@njit(nogil=True, cache=True, inline="always")
def query_first_key(q, group, pos0, window):  # type: ignore[no-untyped-def]
    """:func:`first_key` of query ``q`` of a block of rows from ``pos0`` (row ``q //
    group``); without a window 0, and no division (one per query and block of keys cost
    the many-row loops ~2 cycles per score)."""
    return 0 if window == 0 else first_key(pos0 + q // group, window)


# log2 of KV_BLOCK: a position's block is its high bits
_SHIFT = KV_BLOCK.bit_length() - 1
assert 1 << _SHIFT == KV_BLOCK, "the kernels take a power-of-two block size"


@njit(nogil=True, cache=True, inline="always")
def slot_row(blocks, pos):  # type: ignore[no-untyped-def]
    """The row of one KV head's cache ``[rows, D]`` that holds position ``pos`` of a
    sequence whose block table is ``blocks``: block ``pos // KV_BLOCK`` sits in slot
    ``blocks[...]``, rows ``slot KV_BLOCK ...`` (a contiguous cache: ``blocks[i] = i``, so
    the row is the position)."""
    return blocks[pos >> _SHIFT] * KV_BLOCK + (pos & (KV_BLOCK - 1))


def staged(kc: Any, at: int, n: int, buf: Any) -> Any:
    """``(keys, k0)`` such that ``keys[k0 : k0 + n]`` holds ``kc[at : at + n]`` as float32:
    a float32 cache itself, a float16 one's values widened into ``buf`` (once for all the
    queries that read them, rather than once per query). Compiled code only."""
    raise TypeError("staged is for compiled code")


@overload(staged, jit_options={"nogil": True})
def _staged(kc, at, n, buf):  # type: ignore[no-untyped-def]
    if kc.dtype == types.float32:
        return lambda kc, at, n, buf: (kc, at)

    def widen(kc, at, n, buf):  # type: ignore[no-untyped-def]
        for c in range(0, n, LANES):
            wstore(buf, c, wload_kv(kc, at + c))
        return buf, 0

    return widen


@njit(nogil=True, cache=True, inline="always")
def staged_keys(kc, blocks, j, d, buf):  # type: ignore[no-untyped-def]
    # (keys, k0): keys[k0 + i D ...] holds key j + i (i < LANES) as float32: sixteen keys
    # within one block in place (float16 widened into buf, staged), sixteen across two
    # blocks gathered into buf (the same values: each score the same bits)
    if (j & (KV_BLOCK - 1)) + LANES <= KV_BLOCK:
        return staged(kc, slot_row(blocks, j) * d, LANES * d, buf)
    for i in range(LANES):
        at = slot_row(blocks, j + i) * d
        for c in range(0, d, LANES):
            wstore(buf, i * d + c, wload_kv(kc, at + c))
    return buf, 0


@njit(nogil=True, cache=True)
def _block_scores(qbuf, q, end, group, keys, k0, d, pos0, window, j, sc, scores, stride, sums):  # type: ignore[no-untyped-def]
    # the scores of queries q .. end - 1 (query q of row q // G, at position pos0 + q // G)
    # with the sixteen keys from position j (keys[k0 ...], float32): two queries at a
    # time (_tile2, its sums in ``sums``: TILE_SUMS floats), then one
    while q < end:
        if q + 2 <= end:
            if d % (4 * LANES) == 0:
                _tile2(qbuf, q * d, keys, k0, d, sums)
            else:
                _tile2_any(qbuf, q * d, keys, k0, d, sums)
            for i in range(2):
                lo = query_first_key(q + i, group, pos0, window)
                at = (q + i) * stride + PAD + j - lo
                wstore(scores, at, wmul(_pairs8(sums, i * LANES * LANES // 2), sc))
            q += 2
        else:
            lo = query_first_key(q, group, pos0, window)
            s16 = _scores16(qbuf, q * d, keys, k0, d)
            wstore(scores, q * stride + PAD + j - lo, wmul(s16, sc))
            q += 1


@njit(nogil=True, cache=True)
def _row_scores(qbuf, group, kc, blocks, lo, t, d, scale, scores, stride, buf):  # type: ignore[no-untyped-def]
    # key_scores for one row: its t keys from position ``lo`` (its first key), the blocks
    # of sixteen counted from there (each score the same bits whatever block it is in); a
    # float16 block widened into buf (LANES D floats) once for the group's queries
    # (one query after another, as before the many-row path's tiles: whether a row's
    # three queries gain from one is not settled; a first try read ~7% slower, in a grid
    # whose first variant ran with cold caches)
    full = t - t % LANES
    sc = wsplat(scale)
    for j in range(0, full, LANES):
        ahead = slot_row(blocks, lo + min(j + LANES, t - 1)) * d
        for c in range(0, LANES * d, line_of(kc)):  # the next block's keys, a line at a time
            prefetch_kv(kc, ahead + c)
        keys, at = staged_keys(kc, blocks, lo + j, d, buf)
        for g in range(group):
            q0 = g * d
            sums = _scores16(qbuf, q0, keys, at, d)
            wstore(scores, g * stride + PAD + j, wmul(sums, sc))
    for j in range(full, t):
        at = slot_row(blocks, lo + j) * d
        for g in range(group):
            scores[g * stride + PAD + j] = wsum(_dot(qbuf, g * d, kc, at, d)) * scale


@njit(nogil=True, cache=True)
def key_scores(qbuf, group, kc, blocks, pos0, rows, window, d, scale, scores, stride, buf):  # type: ignore[no-untyped-def]
    """``scores[q stride + PAD + j - lo] = (query q . key j) * scale`` for the ``rows``
    query rows at positions ``pos0``, ``pos0 + 1``... (their group's queries: ``q = row G
    + g``, at ``qbuf[q D]``) and each row's keys ``lo .. pos`` of ``kc`` (one KV head's
    keys, ``[rows, D]`` flat, position ``p`` at row :func:`slot_row` of ``blocks``):
    sixteen keys at a time summed across lanes together (wsums),
    each sum as wsum makes it, each block of keys read once for every row that sees one
    of them (a block's lanes outside a row's keys land in its row's margins). ``buf``:
    LANES D + :data:`TILE_SUMS` floats of scratch (a float16 block of keys widened once for
    all its rows, and two queries' first-level sums with it)."""
    lo0, end = first_key(pos0, window), pos0 + rows
    if rows == 1:
        _row_scores(qbuf, group, kc, blocks, lo0, end - lo0, d, scale, scores, stride, buf)
        return
    full = end - (end - lo0) % LANES
    sc = wsplat(scale)
    sums = buf[LANES * d : LANES * d + TILE_SUMS]
    for j in range(lo0, full, LANES):
        ahead = slot_row(blocks, min(j + LANES, end - 1)) * d
        for c in range(ahead, ahead + LANES * d, line_of(kc)):  # the next block's
            prefetch_kv(kc, c)
        keys, k0 = staged_keys(kc, blocks, j, d, buf)
        r0 = max(0, j - pos0)  # the rows that see key j or a later one: r0 .. r1 - 1
        r1 = r0
        while r1 < rows and first_key(pos0 + r1, window) < j + LANES:
            r1 += 1
        q, end_q = r0 * group, r1 * group
        _block_scores(qbuf, q, end_q, group, keys, k0, d, pos0, window, j, sc, scores, stride, sums)
    for j in range(full, end):
        for r in range(max(0, j - pos0), rows):
            lo = first_key(pos0 + r, window)
            if lo > j:
                break
            for g in range(r * group, (r + 1) * group):
                dot = wsum(_dot(qbuf, g * d, kc, slot_row(blocks, j) * d, d))
                scores[g * stride + PAD + j - lo] = dot * scale


@njit(nogil=True, cache=True)
def softmax(s, s0, t):  # type: ignore[no-untyped-def]
    """``s[s0 : s0 + t] = exp(s - max) / sum``, in place, sixteen lanes at a time: the
    lanes past ``t`` (up to a multiple of sixteen: ``s`` is that long) are set to -inf,
    whose exp is 0."""
    full = t + (-t) % LANES
    for j in range(s0 + t, s0 + full):
        s[j] = -np.inf
    top = wload(s, s0)
    for j in range(s0 + LANES, s0 + full, LANES):
        top = wmax(top, wload(s, j))
    shift = wsplat(-wmax_lane(top))
    acc = wzero()
    for j in range(s0, s0 + full, LANES):
        e = wexp_nonpositive(wadd(wload(s, j), shift))  # s - max <= 0
        wstore(s, j, e)
        acc = wadd(acc, e)
    total = wsplat(wsum(acc))
    for j in range(s0, s0 + full, LANES):
        wstore(s, j, wdiv(wload(s, j), total))


@njit(nogil=True, cache=True)
def block_softmax(s, stride, n, rows, q0, lo, keys, window):  # type: ignore[no-untyped-def]
    """The attention weights of a block of query rows from their scores, in place: row
    ``r`` of ``s`` (``s[r stride : r stride + keys]``, flat) holds query row ``r % rows``'s
    (at position ``q0 + r % rows``) scaled dot products with keys ``lo .. lo + keys - 1``;
    each becomes their softmax over the keys the row sees (:func:`first_key` to its
    position) and 0 elsewhere, so a weighted sum over all ``keys`` is the row's output.
    One compiled pass per row where NumPy's softmax took six over the whole block (issue
    30: a resumed suffix over a long cached prefix spent half its attention there). A
    row's weights depend on its own visible scores alone (:func:`softmax`, its lanes
    counted from its first key), not on the block it came in. ``stride >= keys + LANES``:
    :func:`softmax` pads a row's scores to a multiple of sixteen."""
    for r in range(n):
        pos = q0 + r % rows
        base = r * stride
        c0 = first_key(pos, window) - lo
        c1 = min(pos + 1 - lo, keys)
        for j in range(base, base + c0):
            s[j] = 0.0
        softmax(s, base + c0, c1 - c0)
        for j in range(base + c1, base + keys):
            s[j] = 0.0
