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
:func:`.vexp.wexp`; the weighted sum of values key by key (:mod:`.attention_rows`). All
the query rows of a segment (up to :data:`ROW_BLOCK`: a verify window, a short prompt)
and the query heads of one KV head are computed together, each block of keys and values
read once for all of them, each query summed in the same order as alone: a window's row
is the same bits as that row decoded by itself. With more than one kernel thread each
(sequence, KV head) is a task for the pool's threads (:func:`attend_shared`; a window's
rows cut into parts where there would be fewer than two tasks per thread): the same code
computes each head wherever it runs. That code is compiled once, in the chunk function the
threads run (:func:`_chunk`); :func:`queries`, the one-thread call, runs all its tasks
through that function too, by its address (a first start compiled it four times over
before: issue 29). The rotation is the reference's expression
(``x * cos - x' * sin``, not fused), with cos/sin from the caller's table.

Two variants for mixture-of-experts families (issue 31): gpt-oss's learned per-head sink
logit joins each query's softmax as one more score past its keys (its weight lands where
no value is read: the reference's concatenated column, :func:`meshnode.engine.ops.attention`);
and a RoPE table of no positions takes queries and keys that come normed and rotated
(Qwen3.5's gated attention, whose partial RoPE and ``[query; gate]`` heads its caller
unpacks: :func:`meshnode.engine.attention.rotated_attention`).

Shapes: N rows of the batch, H query heads, Hkv key/value heads, G = H / Hkv, D head dim
(a multiple of 16), L layers of the cache, Tmax its positions, P positions of the RoPE
table.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numba import njit, types
from numba.np.numpy_support import carray

from meshnode.engine.cpu import matrix, pool, warmup
from meshnode.engine.cpu.atomics import call3, ptr_f32, ptr_i64
from meshnode.engine.cpu.attention_rows import (
    LANES,
    PAD,
    TILE_SUMS,
    VALUES,
    first_key,
    key_scores,
    slot_row,
    softmax,
)
from meshnode.engine.cpu.attention_values import weighted_values
from meshnode.engine.cpu.simd import wfma, wload, wsum, wzero
from meshnode.engine.cpu.simd_kv import kv_pointer, line_of, prefetch_kv, wstore_kv
from meshnode.engine.cpu.variants import variant
from meshnode.engine.kv_cache import KV_BLOCK

__all__ = [
    "CHUNK_SIGNATURE",
    "COLUMNS",
    "LANES",
    "attend",
    "attend_shared",
    "chunk_cfunc",
    "compile_kernel",
    "kv_kind",
    "queries",
    "segment_table",
    "write_kv",
]

# The columns of the segment table: where the segment's rows start in ``qkv``, how many
# new rows it has, how many of them query in the last layer, its first position, whether
# this kernel computes it (else the caller does, through BLAS), its cache's K and V
# addresses (``[L, Hkv, Tmax, D]`` float32 or float16, C order), Tmax (rows per head),
# and the address and length of its block table (int64: position p at row
# ``blocks[p // KV_BLOCK] KV_BLOCK + p % KV_BLOCK``; :func:`.attention_rows.slot_row`).
ROW, NEW, KEPT, START, KERNEL, K_ADDR, V_ADDR, TMAX, BLOCKS, N_BLOCKS = range(10)
COLUMNS = 10
# Query rows of a segment computed together, their keys and values read once for all of
# them (a segment of more goes in passes of this many): verify windows and short prompts.
ROW_BLOCK = 16


def segment_table(
    segments: Sequence[tuple[int, int, int, bool, Any]],
) -> np.ndarray:
    """The kernel's segment table ``[segments, COLUMNS]`` int64 from ``(new rows, kept
    rows, start position, computed here, cache)`` tuples in batch order; ``cache`` has
    ``k`` and ``v`` arrays ``[L, Hkv, Tmax, D]`` in C order, float32 or float16 (the same
    for every segment the kernel computes: :func:`kv_kind`), and ``blocks``, its block
    table (int64, C order: :class:`~meshnode.engine.kv_cache.KVCache`), which must outlive
    every :func:`attend` call given the table."""
    table = np.zeros((len(segments), COLUMNS), np.int64)
    row = 0
    for i, (n, kept, start, here, cache) in enumerate(segments):
        k, v, blocks = cache.k, cache.v, cache.blocks
        assert blocks.dtype == np.int64, "a block table is int64"
        assert blocks.flags.c_contiguous, "the kernel indexes a block table in C order"
        assert getattr(cache, "block", KV_BLOCK) == KV_BLOCK, "the kernels' block size"
        assert k.dtype in (np.float32, np.float16), k.dtype
        assert v.dtype == k.dtype, v.dtype
        assert k.flags.c_contiguous, "the kernel indexes the caches in C order"
        assert v.flags.c_contiguous, "the kernel indexes the caches in C order"
        table[i, ROW], table[i, NEW], table[i, KEPT], table[i, START] = row, n, kept, start
        table[i, KERNEL] = here
        table[i, K_ADDR], table[i, V_ADDR] = k.ctypes.data, v.ctypes.data
        table[i, TMAX] = k.shape[2]
        table[i, BLOCKS], table[i, N_BLOCKS] = blocks.ctypes.data, blocks.shape[0]
        row += n
    return table


def kv_kind(dtype: Any) -> np.float32 | np.uint16:
    """The ``kv`` argument of :func:`attend` and its kin for caches of ``dtype``: a
    float32 zero for float32 caches, a ``uint16`` zero for float16 ones (the kernels read
    those as bit patterns). Its type picks the compiled variant; its value is unused."""
    if np.dtype(dtype) == np.float16:
        return np.uint16(0)
    if np.dtype(dtype) == np.float32:
        return np.float32(0)
    raise ValueError(f"the attention kernel keeps float32 or float16 caches, not {dtype}")


@njit(nogil=True, cache=True)
def _norm_rope(src, s0, weight, eps, cos, sin, pos, tmp, dst, d0):  # type: ignore[no-untyped-def]
    # dst[d0 : d0 + D] = RoPE(rms_norm(src[s0 : s0 + D]) or src's values), rotate-half;
    # a table of no positions: no rotation (the caller's queries and keys come rotated)
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
    if cos.shape[0] == 0:
        for i in range(d):
            dst[d0 + i] = tmp[i]
        return
    for i in range(half):
        a, b = tmp[i], tmp[i + half]
        dst[d0 + i] = a * cos[pos, i] - b * sin[pos, i]
        dst[d0 + i + half] = b * cos[pos, i + half] + a * sin[pos, i + half]


@njit(nogil=True, cache=True)
def _write_kv(flat, w, r0, n, start, kc, vc, blocks, kv_heads, q_size, k_norm, eps, cos, sin, tmp):  # type: ignore[no-untyped-def]
    # the segment's new keys (normed, rotated) and values into its cache at their
    # positions' rows (a float16 cache gets them rounded to nearest); tmp holds 2 D floats
    d = cos.shape[1]
    kv_size = kv_heads * d
    tmax = kc.shape[0] // kv_size  # rows per head
    for j in range(n):
        pos = start + j
        row = (r0 + j) * w
        for h in range(kv_heads):
            at = (h * tmax + slot_row(blocks, pos)) * d
            _norm_rope(flat, row + q_size + h * d, k_norm, eps, cos, sin, pos, tmp, tmp, d)
            src = row + q_size + kv_size + h * d
            for c in range(0, d, LANES):
                wstore_kv(kc, at + c, wload(tmp, d + c))
                wstore_kv(vc, at + c, wload(flat, src + c))


@njit(nogil=True, cache=True)
def _cache_of(table, s, layer, kv_heads, d, kv):  # type: ignore[no-untyped-def]
    # segment s's K and V cache of one layer, flat [Hkv * Tmax * D] of kv's type (float32,
    # or uint16: float16 bit patterns), and its block table
    size = kv_heads * table[s, TMAX] * d
    end = (layer + 1) * size
    kc = carray(kv_pointer(table[s, K_ADDR], kv), (end,))[layer * size : end]
    vc = carray(kv_pointer(table[s, V_ADDR], kv), (end,))[layer * size : end]
    blocks = carray(ptr_i64(table[s, BLOCKS]), (table[s, N_BLOCKS],))
    return kc, vc, blocks


@njit(nogil=True, cache=True, inline="always")
def _scratch(d):  # type: ignore[no-untyped-def]
    # floats of a call's scratch beside its queries and scores: a query's QK-norm and RoPE
    # (D), a float16 block of keys (LANES D) widened and two queries' sums with it
    # (TILE_SUMS), or a block of values (VALUES) widened
    return max(LANES * d + TILE_SUMS, VALUES)


# Floats of slack a thread's scratch has for its buffers to begin at a 64-byte line: every
# buffer and every query's row of scores is then whole lines, and no 32-byte load of them
# straddles two (NumPy's and the pool's arrays are 16-byte aligned; a many-row pass over
# 1,440 cached positions took ~1.2x as long with half its loads split).
ALIGN = 16


@njit(nogil=True, cache=True, inline="always")
def _aligned(address):  # type: ignore[no-untyped-def]
    # ``address`` rounded up to a 64-byte line (at most ALIGN floats on)
    return (address + 63) & -64


@njit(nogil=True, cache=True)
def _sizes(table, last):  # type: ignore[no-untyped-def]
    # the query rows computed together (most a kernel segment has, up to ROW_BLOCK) and a
    # query's stride in the score buffer: the most positions a query of the table sees,
    # rounded up to whole vectors, and PAD either side
    longest, most = 1, 1
    for s in range(table.shape[0]):
        longest = max(longest, table[s, START] + table[s, NEW])
        if table[s, KERNEL]:
            most = max(most, table[s, KEPT] if last else table[s, NEW])
    return min(most, ROW_BLOCK), longest + (-longest) % LANES + 2 * PAD


@njit(nogil=True, cache=True)
def write_kv(qkv, table, layer, heads, k_norm, eps, cos, sin, kv):  # type: ignore[no-untyped-def]
    """The new keys (QK-normed, rotated) and values of every segment of ``table`` marked
    for the kernel into its cache at layer ``layer`` (arguments as :func:`attend`'s)."""
    d = cos.shape[1]
    w = qkv.shape[1]
    kv_heads = (w // d - heads) // 2
    flat = qkv.reshape(-1)
    tmp = np.empty(2 * d, np.float32)
    for s in range(table.shape[0]):
        if table[s, KERNEL]:
            kc, vc, blocks = _cache_of(table, s, layer, kv_heads, d, kv)
            n, start = table[s, NEW], table[s, START]
            args = (kv_heads, heads * d, k_norm, eps, cos, sin, tmp)
            _write_kv(flat, w, table[s, ROW], n, start, kc, vc, blocks, *args)


@njit(nogil=True, cache=True)
def queries(  # type: ignore[no-untyped-def]
    qkv, table, layer, heads, q_norm, k_norm, eps, cos, sin, scale, window, sinks, last, out, kv,
    write, chunk,
):  # fmt: skip
    """The attention of every kernel segment's query rows into ``out``; their keys and
    values written into the caches first when ``write`` (:func:`write_kv`), else already
    there; the other arguments as :func:`attend`'s, ``chunk`` the address of the chunk
    function of the caches' kind (:func:`_chunk`). The rows are computed by that chunk
    function, the one the kernel threads run (:func:`attend_shared`), all its tasks in
    one chunk on this thread: the kernel's code is compiled once, in the chunk function,
    not again in this function (numba optimizes and emits each compiled function with
    every function it calls, so a caller linking the kernel's code cost a first start
    ~3 s of CPU more, and a compiled ``attend`` around it once ~2.5 s more)."""
    if write:
        write_kv(qkv, table, layer, heads, k_norm, eps, cos, sin, kv)
    args = (qkv, table, layer, heads, q_norm, eps, cos, sin, scale, window, sinks, last, out)
    block, tasks = task_args(*args, 0)  # no threads: whole ROW_BLOCK parts
    st = np.zeros(pool.WORDS, np.int64)
    scratch = np.empty(4 * block.shape[0], np.float32)  # the buffers (task_args)
    _run_tasks(chunk, st, block, scratch, tasks)


@njit(nogil=True, cache=True)
def _run_tasks(chunk, st, block, scratch, tasks):  # type: ignore[no-untyped-def]
    # every task of the argument block as one chunk of the chunk function at address
    # ``chunk``, on this thread (the pool's words it reads: st); the arrays are the
    # caller's, alive until this returns
    st[pool.X], st[pool.SCRATCH], st[pool.STRIDE] = block.ctypes.data, scratch.ctypes.data, 0
    st[pool.ROWS] = tasks * pool.CHUNK_ROWS
    call3(chunk, st.ctypes.data, 0, 0)


def attend(
    qkv: np.ndarray,
    table: np.ndarray,
    layer: int,
    heads: int,
    q_norm: np.ndarray,
    k_norm: np.ndarray,
    eps: np.float32,
    cos: np.ndarray,
    sin: np.ndarray,
    scale: np.float32,
    window: int,
    sinks: np.ndarray,
    last: bool,
    out: np.ndarray,
    kv: np.float32 | np.uint16,
) -> None:
    """For every segment of ``table`` marked for the kernel: write its new keys and values
    into its cache at layer ``layer`` and its query rows' attention into ``out`` (one
    compiled call: :func:`queries`).

    ``qkv`` ``[N, (H + 2 Hkv) D]`` (C order) is the fused projection of the batch's rows;
    ``q_norm``/``k_norm`` ``[D]`` are QK-norm weights (empty: none); ``cos``/``sin``
    ``[P, D]`` the RoPE table of the layer's kind (P past every new position; a table
    of no positions, ``[0, D]``: no rotation, the queries and keys come rotated);
    ``window`` the sliding window (0: none); ``sinks`` ``[H]`` the heads' sink logits
    (gpt-oss: one more logit in each query's softmax, with no value; empty: none).
    ``out`` ``[R, H D]`` gets a segment's rows at its place in the batch: all its new
    rows, or in the ``last`` layer its kept ones.
    ``kv`` is :func:`kv_kind` of the caches' dtype: float32 caches, or float16 ones
    (written rounded to nearest, read widened; the arithmetic stays float32).
    """
    args = (q_norm, k_norm, eps, cos, sin, scale, window, sinks, last, out, kv)
    queries(qkv, table, layer, heads, *args, True, _chunk(isinstance(kv, np.uint16)))


# -- the query groups shared with the kernel threads (.pool) ----------------------------

# The words of the argument block a shared call posts as the pool job's "x" (int64; EPS
# and SCALE hold a float32 in their low half), then each segment's first output row, then
# the parts of the kernel segments (three words: segment, first and end row). A task is
# the query heads of one KV head for one part: all a segment's query rows (up to
# ROW_BLOCK), or fewer where that makes at least TASKS_PER_THREAD tasks per thread.
QKV, N, W, TABLE, SEGS, LAYER, HEADS, QN, QN_LEN, EPS, COS, SIN = range(12)
POSITIONS, SCALE, WINDOW, LAST, OUT, OUT_ROWS, TASKS, KV_HEADS, MOST, STRIDE = range(12, 22)
SINKS, SINKS_LEN = range(22, 24)
HEADER = 24
TASKS_PER_THREAD = 2


@njit(nogil=True, cache=True)
def _part_rows(table, last, kv_heads, threads):  # type: ignore[no-untyped-def]
    # query rows per part: ROW_BLOCK, halved while that leaves fewer than
    # TASKS_PER_THREAD tasks per thread (a window of one KV head on two threads: two parts)
    size = ROW_BLOCK
    while size > 1:
        tasks = 0
        for s in range(table.shape[0]):
            if table[s, KERNEL]:
                rows = table[s, KEPT] if last else table[s, NEW]
                tasks += kv_heads * ((rows + size - 1) // size)
        if tasks >= TASKS_PER_THREAD * threads:
            break
        size = (size + 1) // 2
    return size


@njit(nogil=True, cache=True)
def task_args(  # type: ignore[no-untyped-def]
    qkv, table, layer, heads, q_norm, eps, cos, sin, scale, window, sinks, last, out, threads
):
    """The argument block of a shared :func:`queries` call (its arguments, and the threads
    that may share it) and its number of tasks; long enough that a thread's scratch (4
    floats per word) holds its buffers."""
    d = cos.shape[1]
    w = qkv.shape[1]
    kv_heads = (w // d - heads) // 2
    segs = table.shape[0]
    size = _part_rows(table, last, kv_heads, threads)
    parts = 0
    for s in range(segs):
        if table[s, KERNEL]:
            parts += ((table[s, KEPT] if last else table[s, NEW]) + size - 1) // size
    most, stride = _sizes(table, last)
    queries = most * (heads // kv_heads)
    floats = ALIGN + queries * d + _scratch(d) + queries * stride
    words = max(HEADER + segs + 3 * parts, (floats + 3) // 4)
    a = np.zeros(words, np.int64)
    f = carray(ptr_f32(a.ctypes.data), (2 * HEADER,))  # not a.view(): its checks compile ~1 s
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
    a[SINKS], a[SINKS_LEN] = sinks.ctypes.data, sinks.shape[0]
    a[TASKS], a[KV_HEADS], a[MOST], a[STRIDE] = parts * kv_heads, kv_heads, most, stride
    f[2 * EPS], f[2 * SCALE] = eps, scale
    o_row = 0
    for s in range(segs):  # each segment's first row in ``out``
        a[HEADER + s] = o_row
        o_row += table[s, KEPT] if last else table[s, NEW]
    at = HEADER + segs
    for s in range(segs):
        if table[s, KERNEL]:
            n = table[s, NEW]
            for i0 in range(n - (table[s, KEPT] if last else n), n, size):
                a[at], a[at + 1], a[at + 2] = s, i0, min(n, i0 + size)
                at += 3
    return a, parts * kv_heads


def _chunk_function(kv: Any) -> Callable[[int, int, int], None]:
    """The chunk function (for :func:`_chunk`) over caches of ``kv``'s kind (:func:`kv_kind`;
    a constant in the compiled code)."""

    @variant(kv.dtype.itemsize)  # 2 or 4 bytes a value (.variants)
    def chunk(st_addr, who, ch):  # type: ignore[no-untyped-def]
        # chunk ch of a posted queries() call (.pool's words at st_addr): the tasks whose
        # rows of the posted "a" part (CHUNK_ROWS each) start in its rows. A task: the
        # query rows lo .. hi - 1 of segment s (a range of its new rows: all it queries,
        # or some) for the query heads of KV head g (its cache written), into oflat's rows
        # from the segment's first query row's, up to MOST rows at a time, each block of
        # keys and values read once for those rows
        st = carray(ptr_i64(st_addr), (pool.WORDS,))
        head = carray(ptr_i64(st[pool.X]), (HEADER,))
        segs, tasks, kv_heads = head[SEGS], head[TASKS], head[KV_HEADS]
        f = carray(ptr_f32(st[pool.X]), (2 * HEADER,))
        eps, scale = f[2 * EPS], f[2 * SCALE]
        heads, w = head[HEADS], head[W]
        d = w // (heads + 2 * kv_heads)
        group = heads // kv_heads
        q_size = heads * d
        flat = carray(ptr_f32(head[QKV]), (head[N] * w,))
        table = carray(ptr_i64(head[TABLE]), (segs, COLUMNS))
        q_norm = carray(ptr_f32(head[QN]), (head[QN_LEN],))
        sinks = carray(ptr_f32(head[SINKS]), (head[SINKS_LEN],))
        cos = carray(ptr_f32(head[COS]), (head[POSITIONS], d))
        sin = carray(ptr_f32(head[SIN]), (head[POSITIONS], d))
        oflat = carray(ptr_f32(head[OUT]), (head[OUT_ROWS] * heads * d,))
        rest = carray(ptr_i64(st[pool.X] + 8 * HEADER), (segs + 3 * (tasks // kv_heads),))
        scratch = _aligned(st[pool.SCRATCH] + 4 * who * st[pool.STRIDE])
        most, stride = head[MOST], head[STRIDE]
        nq = most * group  # queries computed together
        qbuf = carray(ptr_f32(scratch), (nq * d,))  # [B G D]
        tmp = carray(ptr_f32(scratch + 4 * nq * d), (_scratch(d),))
        scores = carray(ptr_f32(scratch + 4 * (nq * d + _scratch(d))), (nq * stride,))
        rows = st[pool.ROWS]
        t0 = (ch * rows + pool.CHUNK_ROWS - 1) // pool.CHUNK_ROWS
        t1 = min(tasks, ((ch + 1) * rows + pool.CHUNK_ROWS - 1) // pool.CHUNK_ROWS)
        layer, window, last = head[LAYER], head[WINDOW], head[LAST] != 0
        for t in range(t0, t1):
            at, g = segs + 3 * (t // kv_heads), t % kv_heads
            s, lo, hi = rest[at], rest[at + 1], rest[at + 2]
            n, start, tmax, r0 = table[s, NEW], table[s, START], table[s, TMAX], table[s, ROW]
            first = n - (table[s, KEPT] if last else n)
            kc, vc, blocks = _cache_of(table, s, layer, kv_heads, d, kv)
            base = g * tmax * d
            kh, vh = kc[base : base + tmax * d], vc[base : base + tmax * d]
            k0 = slot_row(blocks, first_key(start + lo, window)) * d
            for c in range(k0, k0 + LANES * d, line_of(kh)):  # the first keys and values
                prefetch_kv(kh, c)
            for c in range(k0, k0 + VALUES, line_of(vh)):
                prefetch_kv(vh, c)
            for i0 in range(lo, hi, most):
                n_rows = min(most, hi - i0)
                for r in range(n_rows):  # the queries, QK-normed and rotated
                    pos = start + i0 + r
                    for k in range(group):
                        q0 = (r0 + i0 + r) * w + (g * group + k) * d
                        d0 = (r * group + k) * d
                        _norm_rope(flat, q0, q_norm, eps, cos, sin, pos, tmp, qbuf, d0)
                pos0 = start + i0
                sc = (window, d, scale, scores, stride, tmp)
                key_scores(qbuf, group, kh, blocks, pos0, n_rows, *sc)
                for r in range(n_rows):
                    t_keys = pos0 + r + 1 - first_key(pos0 + r, window)
                    for k in range(r * group, (r + 1) * group):
                        s0 = k * stride + PAD
                        if sinks.shape[0] == 0:
                            softmax(scores, s0, t_keys)
                        else:  # the head's sink: one more score past the keys (no value)
                            scores[s0 + t_keys] = sinks[g * group + k - r * group]
                            softmax(scores, s0, t_keys + 1)
                o = (rest[s] + i0 - first) * q_size + g * group * d
                wv = (d, stride, oflat, o, q_size, tmp, qbuf)  # qbuf: the queries are spent
                weighted_values(scores, group, vh, blocks, pos0, n_rows, window, *wv)

    return chunk


# The chunk function's C signature: void f(int64 st_addr, int64 who, int64 chunk)
CHUNK_SIGNATURE = types.void(types.int64, types.int64, types.int64)


def chunk_cfunc(half: bool) -> Any:
    """The chunk function over float16 (``half``) or float32 caches as numba's ``CFunc``,
    cached on disk, not yet compiled (``compile()``: compiled, or loaded from the cache)."""
    from numba.core import sigutils
    from numba.core.ccallback import CFunc

    body = _chunk_function(np.uint16(0) if half else np.float32(0))
    # (args, return type), as numba.cfunc hands it to CFunc
    sig = sigutils.normalize_signature(CHUNK_SIGNATURE)  # type: ignore[no-untyped-call]
    compiled = CFunc(body, sig, locals={}, options={})
    compiled.enable_caching()
    return compiled


@functools.cache
def _chunk(half: bool) -> int:
    """The address of the chunk function for float16 (``half``) or float32 caches: the
    kernel's one compiled entry, which :func:`queries` and the kernel threads call.
    Compiled (or loaded from numba's cache) at its first use: a stage compiles only its
    own caches' kind."""
    compiled = chunk_cfunc(half)
    compiled.compile()
    return int(compiled.address)


def compile_kernel(signatures: Sequence[tuple[Any, ...]], half: bool) -> None:
    """Compile (or load from numba's cache) the chunk function over float16 (``half``) or
    float32 caches and :func:`queries` for each of ``signatures``: what a compile-ahead
    worker runs (:mod:`.warmup`, ``KernelAttention.compile_ahead``)."""
    _chunk(half)
    for sig in signatures:
        queries.compile(sig)


# Below this many keys read (query heads times the positions they see) a call is not shared
# with the kernel threads: posting it costs about what a second thread would save.
SHARED_MIN_READS = 4096
_EMPTY = np.zeros((0, 0), np.uint8)
_NO_OUT = np.zeros((1, 1), np.float32)
_F32 = np.float32(0)
_NO_SINKS = np.zeros(0, np.float32)


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
    kv: np.float32 | np.uint16 = _F32,
    sinks: np.ndarray = _NO_SINKS,
) -> None:
    """As :func:`attend` (``norms`` are ``(q_norm, k_norm)``, ``rope`` ``(cos, sin)``),
    the query groups shared with the kernel threads (:mod:`.pool`) when more than one may
    run and the call reads at least :data:`SHARED_MIN_READS` keys. Each group is computed
    by the same code on whichever thread: the result is bit-identical to :func:`attend`'s.
    ``keep`` holds every array the call reads or writes (the caches too): the pool keeps it
    while a descheduled helper may still run a chunk of it. ``keys``: :func:`reads` of the
    call, if the caller knows it; ``kv``: :func:`kv_kind` of the caches; ``sinks``: the
    heads' sink logits (float32, C order; empty: none)."""
    (q_norm, k_norm), (cos, sin) = norms, rope
    warmup.wait("attention")  # the first call: the worker compiling it ahead (.warmup)
    threads = matrix._threads_here()
    if threads < 2 or (reads(table, heads, last) if keys is None else keys) < SHARED_MIN_READS:
        attend(
            qkv, table, layer, heads, q_norm, k_norm, eps, cos, sin, scale, window, sinks, last,
            out, kv,
        )  # fmt: skip
        return
    write_kv(qkv, table, layer, heads, k_norm, eps, cos, sin, kv)
    args = (qkv, table, layer, heads, q_norm, eps, cos, sin, scale, window, sinks, last, out)
    block, tasks = task_args(*args, threads)
    parts = (np.zeros((tasks * pool.CHUNK_ROWS, 1), np.uint8), _EMPTY, _EMPTY)
    chunk = _chunk(isinstance(kv, np.uint16))
    if not matrix._pool().run(chunk, parts, block, _NO_OUT, threads, keep=keep):
        rest = (eps, cos, sin, scale, window, sinks, last, out, kv)
        queries(qkv, table, layer, heads, q_norm, k_norm, *rest, False, chunk)
