"""One layer's attention for every short segment of a batch, as one compiled call.

What ``model.Stage`` did per sequence in some thirty small NumPy calls (split q/k/v out of
the fused projection, QK-norm, RoPE, the cache write, grouped-query attention with a
causal and sliding-window mask, a stable softmax) here runs for all the decode and
verify segments of a batch in one call per layer. The per-call overhead of NumPy, not
the arithmetic, was what an 8-sequence decode step spent there (~19 ms of 57 ms on
SmolLM2-135M; see the README, "Many users at once").

The caches stay separate arrays, one per sequence: the call gets a table of their
addresses (:func:`segment_table`), which the stage builds once per forward, and views each
through ``numba.carray``. Each query row is computed by the same code whatever else is in
the batch, so a sequence's output is bit-identical alone or batched.

The math is :func:`meshnode.engine.ops.attention`'s with its RoPE and norms, in another
summation order: dot products over the head dimension in sixteen float32 lanes, then
across lanes; softmax ``exp(s - max) / sum`` over the visible keys only (those no query
may see are never read, rather than masked with ``-inf``), sixteen lanes at a time with
:func:`.vexp.wexp`; the weighted sum of values key by key. The query heads of one KV
head are computed together (a block of sixteen keys is read once for all of them), and
with more than one kernel thread each (sequence, KV head) is a task for the pool's
threads (:func:`attend_shared`): the same code computes each head wherever it runs. The
rotation is the reference's expression (``x * cos - x' * sin``, not fused), with cos/sin
from the caller's table.

Shapes: N rows of the batch, H query heads, Hkv key/value heads, G = H / Hkv, D head dim
(a multiple of 16), L layers of the cache, Tmax its positions, P positions of the RoPE
table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import cfunc, njit, types
from numba.np.numpy_support import carray

from meshnode.engine.cpu import matrix, pool
from meshnode.engine.cpu.atomics import ptr_f32, ptr_i64
from meshnode.engine.cpu.simd import wadd, wfma, wload, wmul, wsplat, wstore, wsum, wsums, wzero
from meshnode.engine.cpu.vexp import prefetch_f32, wdiv, wexp, wmax, wmax_lane

__all__ = ["COLUMNS", "LANES", "attend", "attend_shared", "queries", "segment_table", "write_kv"]

# The columns of the segment table: where the segment's rows start in ``qkv``, how many
# new rows it has, how many of them query in the last layer, its first position, whether
# this kernel computes it (else the caller does, through BLAS), its cache's K and V
# addresses (``[L, Hkv, Tmax, D]`` float32, C order) and Tmax.
ROW, NEW, KEPT, START, KERNEL, K_ADDR, V_ADDR, TMAX = range(8)
COLUMNS = 8
# Sixteen float32 lanes per step over the head dimension (simd.F32x16).
LANES = 16
# How far ahead (float32 elements: 4 KiB) the dot products and the weighted sum ask for
# the keys and values they read next.
AHEAD = 1024


def segment_table(
    segments: Sequence[tuple[int, int, int, bool, Any]],
) -> np.ndarray:
    """The kernel's segment table ``[segments, COLUMNS]`` int64 from ``(new rows, kept
    rows, start position, computed here, cache)`` tuples in batch order; ``cache`` has
    ``k`` and ``v`` float32 arrays ``[L, Hkv, Tmax, D]`` in C order, which must outlive
    every :func:`attend` call given the table."""
    table = np.zeros((len(segments), COLUMNS), np.int64)
    row = 0
    for i, (n, kept, start, here, cache) in enumerate(segments):
        k, v = cache.k, cache.v
        assert k.dtype == np.float32, k.dtype
        assert k.flags.c_contiguous, "the kernel indexes the caches in C order"
        assert v.flags.c_contiguous, "the kernel indexes the caches in C order"
        table[i, ROW], table[i, NEW], table[i, KEPT], table[i, START] = row, n, kept, start
        table[i, KERNEL] = here
        table[i, K_ADDR], table[i, V_ADDR] = k.ctypes.data, v.ctypes.data
        table[i, TMAX] = k.shape[2]
        row += n
    return table


@njit(nogil=True, cache=True)
def _norm_rope(src, s0, weight, eps, cos, sin, pos, tmp, dst, d0):  # type: ignore[no-untyped-def]
    # dst[d0 : d0 + D] = RoPE(rms_norm(src[s0 : s0 + D]) or src's values), rotate-half
    d = cos.shape[1]
    half = d // 2
    if weight.shape[0] > 0:
        acc = wzero()
        for c in range(0, d, LANES):
            x = wload(src, s0 + c)
            acc = wfma(x, x, acc)
        den = np.float32(math.sqrt(wsum(acc) / np.float32(d) + eps))
        for i in range(d):
            tmp[i] = weight[i] * (src[s0 + i] / den)
    else:
        for i in range(d):
            tmp[i] = src[s0 + i]
    for i in range(half):
        a, b = tmp[i], tmp[i + half]
        dst[d0 + i] = a * cos[pos, i] - b * sin[pos, i]
        dst[d0 + i + half] = b * cos[pos, i + half] + a * sin[pos, i + half]


@njit(nogil=True, cache=True)
def _write_kv(flat, w, r0, n, start, kc, vc, tmax, kv_heads, q_size, k_norm, eps, cos, sin, tmp):  # type: ignore[no-untyped-def]
    # the segment's new keys (normed, rotated) and values into its cache at their positions
    d = cos.shape[1]
    kv_size = kv_heads * d
    for j in range(n):
        pos = start + j
        row = (r0 + j) * w
        for h in range(kv_heads):
            at = (h * tmax + pos) * d
            _norm_rope(flat, row + q_size + h * d, k_norm, eps, cos, sin, pos, tmp, kc, at)
            src = row + q_size + kv_size + h * d
            for c in range(0, d, LANES):
                wstore(vc, at + c, wload(flat, src + c))


@njit(nogil=True, cache=True, inline="always")
def _dot(a, i, b, j, d):  # type: ignore[no-untyped-def]
    # a[i : i + D] . b[j : j + D] in sixteen lanes, not yet summed across them
    acc = wmul(wload(a, i), wload(b, j))
    for c in range(LANES, d, LANES):
        acc = wfma(wload(a, i + c), wload(b, j + c), acc)
    return acc


@njit(nogil=True, cache=True)
def _scores(qbuf, group, kc, base, t, d, scale, scores, stride):  # type: ignore[no-untyped-def]
    # scores[g stride + j] = (query g . key j) * scale for the group's queries (qbuf[g D ...])
    # and the t keys from ``base``; sixteen keys at a time summed across lanes together
    # (wsums), each sum as wsum makes it; each block of keys read once for the group
    full = t - t % LANES
    sc = wsplat(scale)
    for j in range(0, full, LANES):
        at = base + j * d
        for c in range(0, LANES * d, LANES):  # the next block's keys, a line at a time
            prefetch_f32(kc, at + AHEAD + c)
        for g in range(group):
            q0 = g * d
            sums = wsums(
                (
                    _dot(qbuf, q0, kc, at, d),
                    _dot(qbuf, q0, kc, at + d, d),
                    _dot(qbuf, q0, kc, at + 2 * d, d),
                    _dot(qbuf, q0, kc, at + 3 * d, d),
                    _dot(qbuf, q0, kc, at + 4 * d, d),
                    _dot(qbuf, q0, kc, at + 5 * d, d),
                    _dot(qbuf, q0, kc, at + 6 * d, d),
                    _dot(qbuf, q0, kc, at + 7 * d, d),
                    _dot(qbuf, q0, kc, at + 8 * d, d),
                    _dot(qbuf, q0, kc, at + 9 * d, d),
                    _dot(qbuf, q0, kc, at + 10 * d, d),
                    _dot(qbuf, q0, kc, at + 11 * d, d),
                    _dot(qbuf, q0, kc, at + 12 * d, d),
                    _dot(qbuf, q0, kc, at + 13 * d, d),
                    _dot(qbuf, q0, kc, at + 14 * d, d),
                    _dot(qbuf, q0, kc, at + 15 * d, d),
                )
            )
            wstore(scores, g * stride + j, wmul(sums, sc))
    for j in range(full, t):
        for g in range(group):
            scores[g * stride + j] = wsum(_dot(qbuf, g * d, kc, base + j * d, d)) * scale


@njit(nogil=True, cache=True)
def _softmax(s, s0, t):  # type: ignore[no-untyped-def]
    # s[s0 : s0 + t] = exp(s - max) / sum, in place, sixteen lanes at a time: the lanes
    # past t (up to a multiple of sixteen: ``s`` is that long) are -inf, whose exp is 0
    full = t + (-t) % LANES
    for j in range(s0 + t, s0 + full):
        s[j] = -np.inf
    top = wload(s, s0)
    for j in range(s0 + LANES, s0 + full, LANES):
        top = wmax(top, wload(s, j))
    shift = wsplat(-wmax_lane(top))
    acc = wzero()
    for j in range(s0, s0 + full, LANES):
        e = wexp(wadd(wload(s, j), shift))
        wstore(s, j, e)
        acc = wadd(acc, e)
    total = wsplat(wsum(acc))
    for j in range(s0, s0 + full, LANES):
        wstore(s, j, wdiv(wload(s, j), total))


@njit(nogil=True, cache=True)
def _weighted_values(p, s0, vc, base, t, d, out, o):  # type: ignore[no-untyped-def]
    # out[o : o + D] = sum over the t values from ``base`` of p[s0 + j] * value j: four
    # sixteen-lane accumulators in registers per 64 columns (one where D is not a multiple)
    c = 0
    while c + 4 * LANES <= d:
        a0, a1, a2, a3 = wzero(), wzero(), wzero(), wzero()
        for j in range(t):
            w = wsplat(p[s0 + j])
            at = base + j * d + c
            prefetch_f32(vc, at + AHEAD)
            a0 = wfma(w, wload(vc, at), a0)
            a1 = wfma(w, wload(vc, at + LANES), a1)
            a2 = wfma(w, wload(vc, at + 2 * LANES), a2)
            a3 = wfma(w, wload(vc, at + 3 * LANES), a3)
        wstore(out, o + c, a0)
        wstore(out, o + c + LANES, a1)
        wstore(out, o + c + 2 * LANES, a2)
        wstore(out, o + c + 3 * LANES, a3)
        c += 4 * LANES
    while c < d:
        a0 = wzero()
        for j in range(t):
            a0 = wfma(wsplat(p[s0 + j]), wload(vc, base + j * d + c), a0)
        wstore(out, o + c, a0)
        c += LANES


@njit(nogil=True, cache=True)
def _cache_of(table, s, layer, kv_heads, d):  # type: ignore[no-untyped-def]
    # segment s's K and V cache of one layer, flat [Hkv * Tmax * D]
    size = kv_heads * table[s, TMAX] * d
    kc = carray(ptr_f32(table[s, K_ADDR] + 4 * layer * size), (size,))
    vc = carray(ptr_f32(table[s, V_ADDR] + 4 * layer * size), (size,))
    return kc, vc


@njit(nogil=True, cache=True)
def _longest(table):  # type: ignore[no-untyped-def]
    # the most positions a query of the table sees, rounded up to whole vectors
    longest = 1
    for s in range(table.shape[0]):
        longest = max(longest, table[s, START] + table[s, NEW])
    return longest + (-longest) % LANES


@njit(nogil=True, cache=True)
def write_kv(qkv, table, layer, heads, k_norm, eps, cos, sin):  # type: ignore[no-untyped-def]
    """The new keys (QK-normed, rotated) and values of every segment of ``table`` marked
    for the kernel into its cache at layer ``layer`` (arguments as :func:`attend`'s)."""
    d = cos.shape[1]
    w = qkv.shape[1]
    kv_heads = (w // d - heads) // 2
    flat = qkv.reshape(-1)
    tmp = np.empty(d, np.float32)
    for s in range(table.shape[0]):
        if table[s, KERNEL]:
            kc, vc = _cache_of(table, s, layer, kv_heads, d)
            n, start, tmax = table[s, NEW], table[s, START], table[s, TMAX]
            args = (kv_heads, heads * d, k_norm, eps, cos, sin, tmp)
            _write_kv(flat, w, table[s, ROW], n, start, kc, vc, tmax, *args)


@njit(nogil=True, cache=True)
def _group(flat, w, table, s, g, layer, heads, how, bufs, oflat, o_row):  # type: ignore[no-untyped-def]
    # segment s's query rows for the query heads of KV head g (its cache written) into
    # oflat's rows from o_row; ``how`` is (q_norm, eps, cos, sin, scale, window, last)
    q_norm, eps, cos, sin, scale, window, last = how
    qbuf, tmp, scores = bufs  # [G D], [D], [G stride]
    d = cos.shape[1]
    kv_heads = (w // d - heads) // 2
    group = heads // kv_heads
    stride = scores.shape[0] // group
    q_size = heads * d
    n, start, tmax, r0 = table[s, NEW], table[s, START], table[s, TMAX], table[s, ROW]
    kept = table[s, KEPT] if last else n
    kc, vc = _cache_of(table, s, layer, kv_heads, d)
    for i in range(n - kept, n):
        pos = start + i
        lo = 0 if window == 0 else max(0, pos - window + 1)
        o = (o_row + i - (n - kept)) * q_size
        base, t = (g * tmax + lo) * d, pos + 1 - lo
        for k in range(group):  # the queries, QK-normed and rotated
            q0 = (r0 + i) * w + (g * group + k) * d
            _norm_rope(flat, q0, q_norm, eps, cos, sin, pos, tmp, qbuf, k * d)
        _scores(qbuf, group, kc, base, t, d, scale, scores, stride)
        for k in range(group):
            _softmax(scores, k * stride, t)
            _weighted_values(scores, k * stride, vc, base, t, d, oflat, o + (g * group + k) * d)


@njit(nogil=True, cache=True)
def _out_rows(table, last):  # type: ignore[no-untyped-def]
    # each segment's first row in ``out``
    rows = np.empty(table.shape[0], np.int64)
    o_row = 0
    for s in range(table.shape[0]):
        rows[s] = o_row
        o_row += table[s, KEPT] if last else table[s, NEW]
    return rows


@njit(nogil=True, cache=True)
def queries(qkv, table, layer, heads, q_norm, eps, cos, sin, scale, window, last, out):  # type: ignore[no-untyped-def]
    """The attention of every kernel segment's query rows into ``out``, their keys and
    values already in the caches (:func:`write_kv`); arguments as :func:`attend`'s."""
    d = cos.shape[1]
    w = qkv.shape[1]
    kv_heads = (w // d - heads) // 2
    flat, oflat = qkv.reshape(-1), out.reshape(-1)
    group = heads // kv_heads
    bufs = (
        np.empty(group * d, np.float32),
        np.empty(d, np.float32),
        np.empty(group * _longest(table), np.float32),
    )
    o_rows = _out_rows(table, last)
    how = (q_norm, eps, cos, sin, scale, window, last)
    for s in range(table.shape[0]):
        if table[s, KERNEL]:
            for g in range(kv_heads):
                _group(flat, w, table, s, g, layer, heads, how, bufs, oflat, o_rows[s])


@njit(nogil=True, cache=True)
def attend(qkv, table, layer, heads, q_norm, k_norm, eps, cos, sin, scale, window, last, out):  # type: ignore[no-untyped-def]
    """For every segment of ``table`` marked for the kernel: write its new keys and values
    into its cache at layer ``layer`` and its query rows' attention into ``out``.

    ``qkv`` ``[N, (H + 2 Hkv) D]`` (C order) is the fused projection of the batch's rows;
    ``q_norm``/``k_norm`` ``[D]`` are QK-norm weights (empty: none); ``cos``/``sin``
    ``[P, D]`` the RoPE table of the layer's kind (P past every new position);
    ``window`` the sliding window (0: none). ``out`` ``[R, H D]`` gets a segment's rows
    at its place in the batch: all its new rows, or in the ``last`` layer its kept ones.
    """
    write_kv(qkv, table, layer, heads, k_norm, eps, cos, sin)
    queries(qkv, table, layer, heads, q_norm, eps, cos, sin, scale, window, last, out)


# -- the query groups shared with the kernel threads (.pool) ----------------------------

# The words of the argument block a shared call posts as the pool job's "x" (int64; EPS
# and SCALE hold a float32 in their low half), then each segment's first output row, then
# the kernel segments' indices. A task is one kernel segment's query heads of one KV head.
QKV, N, W, TABLE, SEGS, LAYER, HEADS, QN, QN_LEN, EPS, COS, SIN = range(12)
POSITIONS, SCALE, WINDOW, LAST, OUT, OUT_ROWS, TASKS, KV_HEADS, SCORES = range(12, 21)
HEADER = 21


@njit(nogil=True, cache=True)
def task_args(qkv, table, layer, heads, q_norm, eps, cos, sin, scale, window, last, out):  # type: ignore[no-untyped-def]
    """The argument block of a shared :func:`queries` call (its arguments) and its number
    of tasks; long enough that a thread's scratch (4 floats per word) holds its buffers."""
    d = cos.shape[1]
    w = qkv.shape[1]
    kv_heads = (w // d - heads) // 2
    segs = table.shape[0]
    kernel = 0
    for s in range(segs):
        kernel += table[s, KERNEL] != 0
    scores = _longest(table)
    group = heads // kv_heads
    words = max(HEADER + segs + kernel, ((group + 1) * d + group * scores + 3) // 4)
    a = np.zeros(words, np.int64)
    f = a.view(np.float32)
    a[QKV], a[N], a[W], a[TABLE], a[SEGS] = (
        qkv.ctypes.data,
        qkv.shape[0],
        w,
        table.ctypes.data,
        segs,
    )
    a[LAYER], a[HEADS], a[QN], a[QN_LEN] = layer, heads, q_norm.ctypes.data, q_norm.shape[0]
    a[COS], a[SIN], a[POSITIONS] = cos.ctypes.data, sin.ctypes.data, cos.shape[0]
    a[WINDOW], a[LAST], a[OUT], a[OUT_ROWS] = window, last, out.ctypes.data, out.shape[0]
    a[TASKS], a[KV_HEADS], a[SCORES] = kernel * kv_heads, kv_heads, scores
    f[2 * EPS], f[2 * SCALE] = eps, scale
    a[HEADER : HEADER + segs] = _out_rows(table, last)
    at = HEADER + segs
    for s in range(segs):
        if table[s, KERNEL]:
            a[at] = s
            at += 1
    return a, kernel * kv_heads


@cfunc(types.void(types.int64, types.int64, types.int64), cache=True)
def _chunk(st_addr, who, ch):  # type: ignore[no-untyped-def]
    # chunk ch of a posted queries() call (.pool's words at st_addr): the tasks whose rows
    # of the posted "a" part (CHUNK_ROWS each) start in its rows
    st = carray(ptr_i64(st_addr), (pool.WORDS,))
    head = carray(ptr_i64(st[pool.X]), (HEADER,))
    segs, tasks, kv_heads = head[SEGS], head[TASKS], head[KV_HEADS]
    f = carray(ptr_f32(st[pool.X]), (2 * HEADER,))
    eps, scale = f[2 * EPS], f[2 * SCALE]
    heads, w = head[HEADS], head[W]
    d = w // (heads + 2 * kv_heads)
    flat = carray(ptr_f32(head[QKV]), (head[N] * w,))
    table = carray(ptr_i64(head[TABLE]), (segs, COLUMNS))
    q_norm = carray(ptr_f32(head[QN]), (head[QN_LEN],))
    cos = carray(ptr_f32(head[COS]), (head[POSITIONS], d))
    sin = carray(ptr_f32(head[SIN]), (head[POSITIONS], d))
    oflat = carray(ptr_f32(head[OUT]), (head[OUT_ROWS] * heads * d,))
    rest = carray(ptr_i64(st[pool.X] + 8 * HEADER), (2 * segs,))
    scratch = st[pool.SCRATCH] + 4 * who * st[pool.STRIDE]
    group = heads // kv_heads
    bufs = (
        carray(ptr_f32(scratch), (group * d,)),
        carray(ptr_f32(scratch + 4 * group * d), (d,)),
        carray(ptr_f32(scratch + 4 * (group + 1) * d), (group * head[SCORES],)),
    )
    rows = st[pool.ROWS]
    first = (ch * rows + pool.CHUNK_ROWS - 1) // pool.CHUNK_ROWS
    end = min(tasks, ((ch + 1) * rows + pool.CHUNK_ROWS - 1) // pool.CHUNK_ROWS)
    layer, window, last = head[LAYER], head[WINDOW], head[LAST] != 0
    how = (q_norm, eps, cos, sin, scale, window, last)
    for t in range(first, end):
        s, g = rest[segs + t // kv_heads], t % kv_heads
        _group(flat, w, table, s, g, layer, heads, how, bufs, oflat, rest[s])


# Below this many keys read (query heads times the positions they see) a call is not shared
# with the kernel threads: posting it costs about what a second thread would save.
SHARED_MIN_READS = 4096
_EMPTY = np.zeros((0, 0), np.uint8)
_NO_OUT = np.zeros((1, 1), np.float32)


def reads(table: np.ndarray, heads: int, last: bool) -> int:
    """Keys the query rows of ``table``'s kernel segments read (about: whole segments)."""
    kernel = table[:, KERNEL] != 0
    rows = table[kernel, KEPT] if last else table[kernel, NEW]
    return int((rows * (table[kernel, START] + table[kernel, NEW])).sum()) * heads


def attend_shared(
    qkv: np.ndarray,
    table: np.ndarray,
    layer: int,
    heads: int,
    norms: tuple[np.ndarray, np.ndarray],
    eps: np.float32,
    rope: tuple[np.ndarray, np.ndarray],
    scale: np.float32,
    window: int,
    last: bool,
    out: np.ndarray,
    keep: object,
    keys: int | None = None,
) -> None:
    """As :func:`attend` (``norms`` are ``(q_norm, k_norm)``, ``rope`` ``(cos, sin)``),
    the query groups shared with the kernel threads (:mod:`.pool`) when more than one may
    run and the call reads at least :data:`SHARED_MIN_READS` keys. Each group is computed
    by the same code on whichever thread: the result is bit-identical to :func:`attend`'s.
    ``keep`` holds every array the call reads or writes (the caches too): the pool keeps it
    while a descheduled helper may still run a chunk of it. ``keys``: :func:`reads` of the
    call, if the caller knows it."""
    (q_norm, k_norm), (cos, sin) = norms, rope
    threads = matrix._threads_here()
    if threads < 2 or (reads(table, heads, last) if keys is None else keys) < SHARED_MIN_READS:
        attend(qkv, table, layer, heads, q_norm, k_norm, eps, cos, sin, scale, window, last, out)
        return
    write_kv(qkv, table, layer, heads, k_norm, eps, cos, sin)
    args = (qkv, table, layer, heads, q_norm, eps, cos, sin, scale, window, last, out)
    block, tasks = task_args(*args)
    parts = (np.zeros((tasks * pool.CHUNK_ROWS, 1), np.uint8), _EMPTY, _EMPTY)
    if not matrix._pool().run(_chunk.address, parts, block, _NO_OUT, threads, keep=keep):
        queries(*args)
