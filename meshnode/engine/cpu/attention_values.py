"""The weighted sums of :mod:`.attention`'s kernel: a block of query rows' softmax weights
times the values of one KV head of one sequence's cache (:func:`weighted_values`), cut from
:mod:`.attention_rows` (the dot products and the softmax) at that seam.

Each row's sum runs key by key in order from the row's first key, each of its sixteen-lane
accumulators resumed from memory between blocks of :data:`.attention_rows.VALUES` floats:
the rows that see every key of a block six queries at a time across rows, sixteen lanes of
the head dimension at a time (:func:`_accumulate6`), the other rows two queries at a time
over thirty-two lanes, and a single row (decode) in one pass with its accumulators in
registers (:func:`_row_values`). So a row's output is the same bits alone, in a window or
in a batch (:mod:`.attention_rows` says why that makes the kernel exact).
"""

from __future__ import annotations

from numba import njit

from meshnode.engine.cpu.attention_rows import (
    AHEAD,
    LANES,
    PAD,
    VALUES,
    first_key,
    query_first_key,
    slot_row,
    staged,
)
from meshnode.engine.cpu.simd import wfma, wload, wsplat, wstore, wzero
from meshnode.engine.cpu.simd_kv import line_of, prefetch_kv, wload_kv
from meshnode.engine.kv_cache import KV_BLOCK

__all__ = ["weighted_values"]


@njit(nogil=True, cache=True)
def _accumulate2(p, s0, s1, vc, off, a, b, d, out, o0, o1):  # type: ignore[no-untyped-def]
    # out[o0 : o0 + D] += sum over the values of keys a .. b - 1 (vc[j D + off ...]) of
    # p[s0 + j] * value j, key by key in order, and with p[s1 + j] into out[o1 ...]: each
    # value read once for two queries, thirty-two lanes at a time (two sixteen-lane
    # accumulators each, four in all: they and the values fit the registers, where sixty-
    # four lanes' eight did not) (``out``: a thread's own scratch, never the call's output;
    # weighted_values)
    c = 0
    while c + 2 * LANES <= d:
        x0, x1 = wload(out, o0 + c), wload(out, o0 + c + LANES)
        y0, y1 = wload(out, o1 + c), wload(out, o1 + c + LANES)
        for j in range(a, b):
            u, w = wsplat(p[s0 + j]), wsplat(p[s1 + j])
            at = j * d + c + off
            v0, v1 = wload_kv(vc, at), wload_kv(vc, at + LANES)
            x0, x1 = wfma(u, v0, x0), wfma(u, v1, x1)
            y0, y1 = wfma(w, v0, y0), wfma(w, v1, y1)
        wstore(out, o0 + c, x0)
        wstore(out, o0 + c + LANES, x1)
        wstore(out, o1 + c, y0)
        wstore(out, o1 + c + LANES, y1)
        c += 2 * LANES
    while c < d:
        x0, y0 = wload(out, o0 + c), wload(out, o1 + c)
        for j in range(a, b):
            v0 = wload_kv(vc, j * d + c + off)
            x0 = wfma(wsplat(p[s0 + j]), v0, x0)
            y0 = wfma(wsplat(p[s1 + j]), v0, y0)
        wstore(out, o0 + c, x0)
        wstore(out, o1 + c, y0)
        c += LANES


@njit(nogil=True, cache=True)
def _accumulate(p, s0, vc, off, a, b, d, out, o0):  # type: ignore[no-untyped-def]
    # _accumulate2 for one query
    c = 0
    while c + 4 * LANES <= d:
        x0, x1 = wload(out, o0 + c), wload(out, o0 + c + LANES)
        x2, x3 = wload(out, o0 + c + 2 * LANES), wload(out, o0 + c + 3 * LANES)
        for j in range(a, b):
            u = wsplat(p[s0 + j])
            at = j * d + c + off
            x0 = wfma(u, wload_kv(vc, at), x0)
            x1 = wfma(u, wload_kv(vc, at + LANES), x1)
            x2 = wfma(u, wload_kv(vc, at + 2 * LANES), x2)
            x3 = wfma(u, wload_kv(vc, at + 3 * LANES), x3)
        wstore(out, o0 + c, x0)
        wstore(out, o0 + c + LANES, x1)
        wstore(out, o0 + c + 2 * LANES, x2)
        wstore(out, o0 + c + 3 * LANES, x3)
        c += 4 * LANES
    while c < d:
        x0 = wload(out, o0 + c)
        for j in range(a, b):
            x0 = wfma(wsplat(p[s0 + j]), wload_kv(vc, j * d + c + off), x0)
        wstore(out, o0 + c, x0)
        c += LANES


@njit(nogil=True, cache=True, inline="always")
def _run_end(j, b):  # type: ignore[no-untyped-def]
    # the end of the run of keys from j (before b) whose rows are consecutive: j's block's
    return min(b, (j | (KV_BLOCK - 1)) + 1)


@njit(nogil=True, cache=True)
def _one_query(p, s0, vc, blocks, a, b, d, out, o):  # type: ignore[no-untyped-def]
    # out[o : o + D] = the sum over keys a .. b - 1 of p[s0 + j] * value j, in one pass
    # with the accumulators in registers (a decode row's query: nothing to share); the
    # keys a block at a time (value j at vc[j D + base], base the block's), in order
    c = 0
    while c + 4 * LANES <= d:
        x0, x1, x2, x3 = wzero(), wzero(), wzero(), wzero()
        j0 = a
        while j0 < b:
            j1 = _run_end(j0, b)
            base = (slot_row(blocks, j0) - j0) * d + c
            for j in range(j0, j1):
                u = wsplat(p[s0 + j])
                at = j * d + base
                prefetch_kv(vc, at + AHEAD)
                x0 = wfma(u, wload_kv(vc, at), x0)
                x1 = wfma(u, wload_kv(vc, at + LANES), x1)
                x2 = wfma(u, wload_kv(vc, at + 2 * LANES), x2)
                x3 = wfma(u, wload_kv(vc, at + 3 * LANES), x3)
            j0 = j1
        wstore(out, o + c, x0)
        wstore(out, o + c + LANES, x1)
        wstore(out, o + c + 2 * LANES, x2)
        wstore(out, o + c + 3 * LANES, x3)
        c += 4 * LANES
    while c < d:
        x0 = wzero()
        j0 = a
        while j0 < b:
            j1 = _run_end(j0, b)
            base = (slot_row(blocks, j0) - j0) * d + c
            for j in range(j0, j1):
                x0 = wfma(wsplat(p[s0 + j]), wload_kv(vc, j * d + base), x0)
            j0 = j1
        wstore(out, o + c, x0)
        c += LANES


@njit(nogil=True, cache=True)
def _two_queries(p, s0, s1, vc, blocks, a, b, d, out, o0, o1):  # type: ignore[no-untyped-def]
    # _one_query for two queries at once: each value read (and widened) once for both,
    # eight accumulators in registers; each query's sums those of _one_query
    c = 0
    while c + 4 * LANES <= d:
        x0, x1, x2, x3 = wzero(), wzero(), wzero(), wzero()
        y0, y1, y2, y3 = wzero(), wzero(), wzero(), wzero()
        j0 = a
        while j0 < b:
            j1 = _run_end(j0, b)
            base = (slot_row(blocks, j0) - j0) * d + c
            for j in range(j0, j1):
                u, w = wsplat(p[s0 + j]), wsplat(p[s1 + j])
                at = j * d + base
                prefetch_kv(vc, at + AHEAD)
                v0, v1 = wload_kv(vc, at), wload_kv(vc, at + LANES)
                v2, v3 = wload_kv(vc, at + 2 * LANES), wload_kv(vc, at + 3 * LANES)
                x0, x1 = wfma(u, v0, x0), wfma(u, v1, x1)
                x2, x3 = wfma(u, v2, x2), wfma(u, v3, x3)
                y0, y1 = wfma(w, v0, y0), wfma(w, v1, y1)
                y2, y3 = wfma(w, v2, y2), wfma(w, v3, y3)
            j0 = j1
        wstore(out, o0 + c, x0)
        wstore(out, o0 + c + LANES, x1)
        wstore(out, o0 + c + 2 * LANES, x2)
        wstore(out, o0 + c + 3 * LANES, x3)
        wstore(out, o1 + c, y0)
        wstore(out, o1 + c + LANES, y1)
        wstore(out, o1 + c + 2 * LANES, y2)
        wstore(out, o1 + c + 3 * LANES, y3)
        c += 4 * LANES
    while c < d:
        x0, y0 = wzero(), wzero()
        j0 = a
        while j0 < b:
            j1 = _run_end(j0, b)
            base = (slot_row(blocks, j0) - j0) * d + c
            for j in range(j0, j1):
                v0 = wload_kv(vc, j * d + base)
                x0 = wfma(wsplat(p[s0 + j]), v0, x0)
                y0 = wfma(wsplat(p[s1 + j]), v0, y0)
            j0 = j1
        wstore(out, o0 + c, x0)
        wstore(out, o1 + c, y0)
        c += LANES


@njit(nogil=True, cache=True)
def _accumulate6(p, ss, vc, off, a, b, d, out, oo):  # type: ignore[no-untyped-def]
    # _accumulate for six queries at once (their p offsets ``ss``, out offsets ``oo``):
    # sixteen lanes of the head dimension at a time, each value read once for the six,
    # six accumulators in registers; each query's sums those of _accumulate
    s0, s1, s2, s3, s4, s5 = ss
    o0, o1, o2, o3, o4, o5 = oo
    n = b - a
    # each query's weights of these keys as its own view, indexed from 0 (no index that
    # could be negative: numba's wrap-around of one per query and key spilled registers)
    p0, p1, p2 = p[s0 + a : s0 + b], p[s1 + a : s1 + b], p[s2 + a : s2 + b]
    p3, p4, p5 = p[s3 + a : s3 + b], p[s4 + a : s4 + b], p[s5 + a : s5 + b]
    for c in range(0, d, LANES):
        x0, x1, x2 = wload(out, o0 + c), wload(out, o1 + c), wload(out, o2 + c)
        x3, x4, x5 = wload(out, o3 + c), wload(out, o4 + c), wload(out, o5 + c)
        at = a * d + c + off
        for j in range(n):
            v = wload_kv(vc, at + j * d)
            x0, x1 = wfma(wsplat(p0[j]), v, x0), wfma(wsplat(p1[j]), v, x1)
            x2, x3 = wfma(wsplat(p2[j]), v, x2), wfma(wsplat(p3[j]), v, x3)
            x4, x5 = wfma(wsplat(p4[j]), v, x4), wfma(wsplat(p5[j]), v, x5)
        wstore(out, o0 + c, x0)
        wstore(out, o1 + c, x1)
        wstore(out, o2 + c, x2)
        wstore(out, o3 + c, x3)
        wstore(out, o4 + c, x4)
        wstore(out, o5 + c, x5)


@njit(nogil=True, cache=True, inline="always")
def _offsets(q, group, pos0, window, stride, d):  # type: ignore[no-untyped-def]
    # query q's first score (of its row's first key, less that key) and accumulators
    return q * stride + PAD - query_first_key(q, group, pos0, window), q * d


@njit(nogil=True, cache=True)
def _full_rows(p, group, vals, off, a, b, pos0, f0, f1, window, d, stride, acc):  # type: ignore[no-untyped-def]
    # weighted_values' sums over keys a .. b - 1 for the queries of rows f0 .. f1 - 1,
    # which all see every one of those keys: six queries at a time (across rows), then
    # two, then one; each query's sums in the same order however it is grouped
    q, end = f0 * group, f1 * group
    while q + 6 <= end:
        s0, o0 = _offsets(q, group, pos0, window, stride, d)
        s1, o1 = _offsets(q + 1, group, pos0, window, stride, d)
        s2, o2 = _offsets(q + 2, group, pos0, window, stride, d)
        s3, o3 = _offsets(q + 3, group, pos0, window, stride, d)
        s4, o4 = _offsets(q + 4, group, pos0, window, stride, d)
        s5, o5 = _offsets(q + 5, group, pos0, window, stride, d)
        ss, oo = (s0, s1, s2, s3, s4, s5), (o0, o1, o2, o3, o4, o5)
        _accumulate6(p, ss, vals, off, a, b, d, acc, oo)
        q += 6
    while q + 2 <= end:
        s0, o0 = _offsets(q, group, pos0, window, stride, d)
        s1, o1 = _offsets(q + 1, group, pos0, window, stride, d)
        _accumulate2(p, s0, s1, vals, off, a, b, d, acc, o0, o1)
        q += 2
    if q < end:
        s0, o0 = _offsets(q, group, pos0, window, stride, d)
        _accumulate(p, s0, vals, off, a, b, d, acc, o0)


@njit(nogil=True, cache=True)
def _row_values(p, group, vc, blocks, lo0, end, d, stride, out, o):  # type: ignore[no-untyped-def]
    # weighted_values for one row (keys lo0 .. end - 1): each query, or pair of queries,
    # in one pass (a function of its own: compiled into weighted_values beside the
    # many-row loops, one KV head's row over 1,630 keys took 0.049 ms, here 0.019)
    for g in range(0, group - 1, 2):
        s0, s1 = g * stride + PAD - lo0, (g + 1) * stride + PAD - lo0
        _two_queries(p, s0, s1, vc, blocks, lo0, end, d, out, o + g * d, o + (g + 1) * d)
    if group % 2:
        g = group - 1
        _one_query(p, g * stride + PAD - lo0, vc, blocks, lo0, end, d, out, o + g * d)


@njit(nogil=True, cache=True)
def weighted_values(p, group, vc, blocks, pos0, rows, window, d, stride, out, o, q_size, buf, acc):  # type: ignore[no-untyped-def]
    """``out[o + r q_size + g D ...]`` = the sum over row ``r``'s keys ``lo .. pos`` of
    ``p[q stride + PAD + j - lo]`` times value ``j`` of ``vc`` (one KV head's values,
    ``[rows, D]`` flat, position ``j`` at row :func:`slot_row` of ``blocks``; ``q = r G +
    g``), key by key in order from 0 as one query's accumulators alone would sum: a block
    of values (:data:`VALUES` floats, in L1, never across a ``KV_BLOCK`` boundary) is read
    once for every row that sees one of its keys, each row's accumulators resumed from
    ``acc`` (rows G D floats of the caller's scratch) between blocks (a float16 block
    widened once, into ``buf``: max(LANES D, :data:`VALUES`) floats).

    ``out`` is only ever stored finished sums, never a partial one: the kernel pool may
    run a task twice at once (its caller redoes a chunk a descheduled helper holds, and the
    helper may finish it after the caller has returned, :mod:`.pool`), which is harmless
    only when each run writes ``out`` the same final values. Sums resumed from ``out``
    itself were zeroed and re-summed under the other run's feet (issue 30: an 8-row
    window's output wrong on two kernel threads under load)."""
    lo0, end = first_key(pos0, window), pos0 + rows
    if rows == 1:  # one row: each query (or pair of queries) in one pass
        _row_values(p, group, vc, blocks, lo0, end, d, stride, out, o)
        return
    for c in range(0, rows * group * d, LANES):
        wstore(acc, c, wzero())
    block = max(LANES, VALUES // d)
    jb = lo0
    while jb < end:
        # keys jb .. je - 1: at most a block's, within one KV_BLOCK (rows in one slot)
        je = min(jb + block, _run_end(jb, end))
        row = slot_row(blocks, jb)
        ahead = slot_row(blocks, min(je, end - 1)) * d
        for c in range(ahead, ahead + (je - jb) * d, line_of(vc)):  # the next block, by lines
            prefetch_kv(vc, c)
        vals, v0 = staged(vc, row * d, (je - jb) * d, buf)
        off = v0 - jb * d  # value j at vals[j D + off]
        # the rows that see every key jb .. je - 1 (f0 .. f1 - 1): their queries six at a
        # time, whatever row each is in; the other rows that see some, a row at a time
        f0 = max(0, je - 1 - pos0)
        f1 = f0
        while f1 < rows and first_key(pos0 + f1, window) <= jb:
            f1 += 1
        if f1 > f0:
            _full_rows(p, group, vals, off, jb, je, pos0, f0, f1, window, d, stride, acc)
        for r in range(max(0, jb - pos0), rows):
            if f0 <= r < f1:
                continue
            pos = pos0 + r
            lo = first_key(pos, window)
            if lo >= je:
                break
            a, b = max(jb, lo), min(je, pos + 1)
            q = r * group
            for g in range(0, group - 1, 2):
                s0, s1 = (q + g) * stride + PAD - lo, (q + g + 1) * stride + PAD - lo
                x0, x1 = (q + g) * d, (q + g + 1) * d
                _accumulate2(p, s0, s1, vals, off, a, b, d, acc, x0, x1)
            if group % 2:
                g = group - 1
                _accumulate(p, (q + g) * stride + PAD - lo, vals, off, a, b, d, acc, (q + g) * d)
        jb = je
    for r in range(rows):  # the finished sums, stored once
        for c in range(0, group * d, LANES):
            wstore(out, o + r * q_size + c, wload(acc, r * group * d + c))
