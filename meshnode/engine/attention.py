"""A stage's attention over the sequences of a batch: the NumPy reference, and the CPU's
compiled kernel for short segments.

``model.Stage`` hands each layer's fused q/k/v projection of the whole batch here and gets
back the rows ``wo`` multiplies. Per sequence (a :class:`Segment`): split q/k/v, QK-norm,
RoPE, write K/V into the sequence's cache, causal (and sliding-window) grouped-query
attention over it. :class:`Attention` does it with the functions of
:mod:`meshnode.engine.ops`, a segment at a time; :class:`KernelAttention` (the CPU backend
over GGUF blocks) does every segment (decode, verify windows, prompts of any length: see
:func:`_for_kernel`) in one compiled call per layer (:mod:`meshnode.engine.cpu.attention`),
so a row's bits do not depend on how its prompt was cut; where the kernel cannot run (a
head dimension not a multiple of sixteen) a long segment goes a block of query rows at a
time through BLAS (:func:`blocked_attention`). Qwen3.5's gated
attention rotates its own queries and keys and hands its short passes to the same kernel
(:func:`rotated_attention`).

RoPE's cos/sin come from a table per kind of layer (:class:`RopeTable`), computed once
for positions ``0 .. P`` with :func:`ops.rope_cos_sin` and grown as sequences get longer,
instead of per segment per forward.

Shapes: N rows of the batch, S a segment's new rows, r its query rows, R all query rows,
H query heads, Hkv key/value heads, D head dim, P positions of a RoPE table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np

from meshnode.engine import ops
from meshnode.engine.config import ModelConfig
from meshnode.engine.cpu import matrix

__all__ = [
    "BLOCK_ROWS",
    "KERNEL_MAX_ROWS",
    "Attention",
    "KernelAttention",
    "RopeTable",
    "Segment",
    "blocked_attention",
    "kept_rows",
    "reference_heads",
    "rotated_attention",
]

# The most rows of a segment the few-row paths take: Qwen3.5's gated attention's kernel
# pass (:func:`rotated_attention`, the hybrid stage) and the reference's row-at-a-time
# attention (:func:`reference_heads`). :class:`KernelAttention` takes every segment,
# however long (:func:`_for_kernel`: it reads a segment's keys and values once for up to
# its ROW_BLOCK rows at a time). ``benchmarks/attention.py --grid``, one thread, a forward's
# attention (kernel / BLAS, ms): SmolLM2 (30 layers) 1 row at 512 positions 1.31 / 3.89,
# 8 rows at 128 2.14 / 3.50, 8 at 512 6.98 / 8.59, 16 at 512 11.8 / 14.6; Gemma 3 (18
# layers) 8 at 128 1.61 / 3.24, 16 at 512 9.61 / 10.96.
KERNEL_MAX_ROWS = 16
# Query rows per block of a long segment's attention (blocked_attention): a block's scores
# stay in the L2 cache, and the blocks skip most of the masked half of a causal square.
# SmolLM2 (9 heads of 64), 400 rows, one thread: 32 rows 0.45x the reference's time,
# 64 rows 0.23x, 128 rows 0.47x; Gemma 3 (4 heads of 256): 0.70x, 0.64x, 0.68x (load 5-7).
BLOCK_ROWS = 64
# Positions a RoPE table holds at first; it doubles as needed.
ROPE_TABLE_MIN = 256


@dataclass(frozen=True, slots=True)
class Segment:
    """Where one sequence sits in a batch: S new rows from ``start_pos``, of which the
    last ``rows`` go past attention in the stage's last layer."""

    start_pos: int
    n: int
    rows: int
    cache: Any


class RopeTable:
    """RoPE's cos and sin ``[P, D]`` for positions ``0 .. P - 1`` of one set of
    frequencies, computed as :func:`ops.rope_cos_sin` computes them (each entry depends on
    its position alone, so a slice equals a per-segment computation bit for bit)."""

    def __init__(self, xp: ModuleType, inv_freq: Any, scale: float = 1.0) -> None:
        self._xp, self._inv_freq = xp, inv_freq
        self._scale = scale  # YaRN's attention factor: cos and sin times it (else 1)
        self.cos, self.sin = ops.rope_cos_sin(xp, inv_freq, 0, 0)

    def reach(self, end: int) -> None:
        """Hold at least positions ``0 .. end - 1``."""
        size = self.cos.shape[0]
        if end > size:
            size = max(end, 2 * size, ROPE_TABLE_MIN)
            self.cos, self.sin = ops.rope_cos_sin(self._xp, self._inv_freq, 0, size)
            if self._scale != 1.0:  # as transformers scales them, in float32
                factor = self._xp.float32(self._scale)
                self.cos, self.sin = self.cos * factor, self.sin * factor

    def rows(self, start: int, n: int) -> tuple[Any, Any]:
        """cos and sin ``[S, D]`` of positions ``start .. start + n - 1``."""
        self.reach(start + n)
        return self.cos[start : start + n], self.sin[start : start + n]


class Attention:
    """Attention of layers ``[start, end)`` of a model, a segment at a time through
    :mod:`meshnode.engine.ops` (the reference)."""

    def __init__(self, xp: ModuleType, config: ModelConfig, start: int, end: int) -> None:
        self.xp, self.config = xp, config
        # RoPE frequencies [D/2] of each distinct kind of layer (Gemma 3: local and global),
        # and which kind each layer of the stage is.
        kinds = [tuple(config.rope_inv_freq(i)) for i in range(start, end)]
        distinct = list(dict.fromkeys(kinds))
        freqs = [xp.asarray(np.asarray(f, dtype=np.float32)) for f in distinct]
        self.tables = [RopeTable(xp, f, config.rope_attention_factor) for f in freqs]
        self.rope_kind = [distinct.index(k) for k in kinds]
        self.windows = [config.window(i) for i in range(start, end)]
        self.scale = config.attention_scale

    def prepare(self, segs: Sequence[Segment]) -> Any:
        """What :meth:`__call__` needs for ``segs`` in every layer of one forward (here the
        RoPE tables grown to reach every new position)."""
        end = max(seg.start_pos + seg.n for seg in segs)
        for table in self.tables:
            table.reach(end)
        return None

    def keep_rows(self, x: Any, segs: Sequence[Segment], plan: Any) -> Any:
        """Each segment's last ``rows`` rows of ``x`` ``[N, E]`` -> ``[R, E]`` (what the
        stage's last layer keeps past attention)."""
        return x[kept_rows(self.xp, segs)]

    def __call__(
        self,
        qkv: Any,
        segs: Sequence[Segment],
        plan: Any,
        layer: int,
        norms: tuple[Any | None, Any | None],
        last: bool,
        sinks: Any | None = None,
    ) -> Any:
        """``qkv`` ``[N, (H + 2 Hkv) D]`` of stage layer ``layer`` -> ``[R, H D]``: each
        segment's new K/V written to its cache, its query rows (all, or in the ``last``
        layer its last ``rows``) attended. ``norms`` are the QK-norm weights (or None),
        ``sinks`` the layer's per-head sink logits ``[H]`` (gpt-oss; or None);
        ``plan`` is what :meth:`prepare` returned. Raises ``ValueError`` when a cache is
        full."""
        outs, offset = [], 0
        for seg in segs:
            rows = seg.rows if last else seg.n
            part = qkv[offset : offset + seg.n]
            outs.append(self.attend(part, seg, layer, norms, rows, sinks))
            offset += seg.n
        return outs[0] if len(outs) == 1 else self.xp.concatenate(outs, axis=0)

    def attend(
        self,
        qkv: Any,
        seg: Segment,
        layer: int,
        norms: tuple[Any | None, Any | None],
        rows: int,
        sinks: Any | None = None,
    ) -> Any:
        """One sequence's attention: ``qkv`` ``[S, (H + 2 Hkv) D]`` -> ``[r, H D]``."""
        c, xp = self.config, self.xp
        cos, sin = self.tables[self.rope_kind[layer]].rows(seg.start_pos, seg.n)  # [S, D]
        n = seg.n
        q = qkv[n - rows :, : c.q_size].reshape(rows, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].reshape(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].reshape(n, c.num_kv_heads, c.head_dim)
        q = self._maybe_norm(q, norms[0]).transpose(1, 0, 2)  # QK-norm per head; [H, r, D]
        k = self._maybe_norm(k, norms[1]).transpose(1, 0, 2)  # [Hkv, S, D]
        q = ops.rotate_half(xp, q, cos[n - rows :], sin[n - rows :])
        k = ops.rotate_half(xp, k, cos, sin)
        keys, values = seg.cache.write(layer, seg.start_pos, k, v.transpose(1, 0, 2))  # [Hkv, T, D]
        out = self._heads(q, keys, values, self.windows[layer], sinks)  # [H, r, D]
        return out.transpose(1, 0, 2).reshape(rows, c.q_size)  # [r, H D]

    def _heads(self, q: Any, keys: Any, values: Any, window: int | None, sinks: Any | None) -> Any:
        return ops.attention(self.xp, q, keys, values, self.scale, window, sinks)

    def _maybe_norm(self, x: Any, weight: Any | None) -> Any:
        return x if weight is None else ops.rms_norm(self.xp, x, weight, self.config.rms_norm_eps)


class KernelAttention(Attention):
    """As :class:`Attention`, with every segment (:func:`_for_kernel`) computed
    by one compiled call per layer (NumPy arrays, float32 or float16 caches in C order;
    one kind per batch)."""

    def __init__(self, xp: ModuleType, config: ModelConfig, start: int, end: int) -> None:
        super().__init__(xp, config, start, end)
        # the kernel steps over the head dimension sixteen lanes at a time
        self._usable = config.head_dim % 16 == 0
        self._eps = np.float32(config.rms_norm_eps)
        self._scale = np.float32(self.scale)
        self._none = np.zeros(0, np.float32)
        # the last plan and the keys its calls read, all rows' and the last layer's
        # (whether a call is shared with the kernel threads: cpu.attention.attend_shared)
        self._reads: tuple[Any, int, int] = (None, 0, 0)
        # the last plan and the kernel variant of its caches (cpu.attention.kv_kind)
        self._kv: tuple[Any, Any] = (None, None)

    def prepare(self, segs: Sequence[Segment]) -> Any:
        """The kernel's segment table (cache addresses, rows, positions), after checking
        that its segments fit their caches (``ValueError`` if not)."""
        super().prepare(segs)
        parts = []
        for seg in segs:
            end = seg.start_pos + seg.n
            here = self._usable and _for_kernel(seg.n, end)
            if here and end > seg.cache.max_tokens:
                raise ValueError(f"KV cache full: {end} > {seg.cache.max_tokens} tokens")
            parts.append((seg.n, seg.rows, seg.start_pos, here, seg.cache))
        table = _kernels().segment_table(parts)
        heads, kernel = self.config.num_heads, [p for p in parts if p[3]]
        self._kv = (table, _kv_kind([p[4] for p in kernel]))
        every = heads * sum(n * (start + n) for n, _, start, _, _ in kernel)
        kept = heads * sum(rows * (start + n) for n, rows, start, _, _ in kernel)
        self._reads = (table, every, kept)
        return table if kernel else None

    def __call__(
        self,
        qkv: Any,
        segs: Sequence[Segment],
        plan: Any,
        layer: int,
        norms: tuple[Any | None, Any | None],
        last: bool,
        sinks: Any | None = None,
    ) -> Any:
        """As :meth:`Attention.__call__`; the kernel's segments in one call (gpt-oss's
        sinks too: one more logit in each query's softmax)."""
        if plan is None:
            return super().__call__(qkv, segs, plan, layer, norms, last, sinks)
        k = _kernels()
        qkv = np.ascontiguousarray(qkv, dtype=np.float32)
        kept = [seg.rows if last else seg.n for seg in segs]
        out = np.empty((sum(kept), self.config.q_size), np.float32)  # [R, H D]
        (q_norm, k_norm), rope, window, sink = self._layer_args(layer, norms, sinks)
        keep = (qkv, out, plan, segs, q_norm, k_norm, rope, sink)  # what the kernel reads
        reads = self._reads[2 if last else 1] if self._reads[0] is plan else None
        if self._kv[0] is plan:
            kv = self._kv[1]
        else:
            kv = _kv_kind([seg.cache for i, seg in enumerate(segs) if plan[i, k.KERNEL]])
        k.attend_shared(
            qkv, plan, layer, self.config.num_heads, (q_norm, k_norm), self._eps,
            rope, self._scale, window, last, out, keep, reads, kv, sink,
        )  # fmt: skip
        offset = row = 0
        for i, (seg, rows) in enumerate(zip(segs, kept, strict=True)):
            if not plan[i, k.KERNEL]:  # where the kernel cannot run: through BLAS
                part = qkv[offset : offset + seg.n]
                out[row : row + rows] = self.attend(part, seg, layer, norms, rows, sinks)
            offset, row = offset + seg.n, row + rows
        return out

    def _layer_args(
        self, layer: int, norms: tuple[Any | None, Any | None], sinks: Any | None
    ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], int, np.ndarray]:
        """The kernel's arguments of layer ``layer``: its QK-norm weights, RoPE table
        (cos, sin), sliding window (0: none) and sink logits (empty: none)."""
        q_norm, k_norm = (self._none if n is None else np.asarray(n, np.float32) for n in norms)
        table = self.tables[self.rope_kind[layer]]
        sink = self._none if sinks is None else np.ascontiguousarray(sinks, np.float32)
        return (q_norm, k_norm), (table.cos, table.sin), self.windows[layer] or 0, sink

    def compile_ahead(self, layers: Sequence[Any], kv_dtype: Any) -> bool:
        """Start compiling the kernel for these layers' weights (``q_norm``, ``k_norm``,
        ``sinks``) and caches of ``kv_dtype`` in a worker process (``cpu.warmup``): its
        chunk function and the entry :func:`~meshnode.engine.cpu.attention.queries`, unless
        numba's cache holds them; its first call waits for it. Returns whether a worker
        started."""
        if not self._usable or not layers:
            return False
        from meshnode.engine.cpu import warmup

        if not warmup.enabled():
            return False
        k, half = _kernels(), np.dtype(kv_dtype) == np.float16
        sigs = [s for s in self.signatures(layers, kv_dtype) if not warmup.cached(k.queries, s)]
        if not sigs and warmup.cached(k.chunk_cfunc(half), k.CHUNK_SIGNATURE):
            return False
        return warmup.run("attention", [warmup.Call(k.__name__, "compile_kernel", (sigs, half))])

    def signatures(self, layers: Sequence[Any], kv_dtype: Any) -> list[tuple[Any, ...]]:
        """The argument types of the compiled kernel (``cpu.attention.queries``) in the
        calls :meth:`__call__` makes for these layers and caches of ``kv_dtype``."""
        from numba import typeof

        k, found = _kernels(), []
        qkv = out = np.zeros((1, 1), np.float32)
        plan, kv = np.zeros((1, k.COLUMNS), np.int64), k.kv_kind(kv_dtype)
        for layer, w in enumerate(layers):
            norms, (cos, sin), window, sink = self._layer_args(layer, (w.q_norm, w.k_norm), w.sinks)
            # as cpu.attention.attend calls it (write=True; attend_shared's fallback: False;
            # the chunk function's address, an int)
            args: tuple[Any, ...] = (qkv, plan, layer, self.config.num_heads, *norms, self._eps)
            args += (cos, sin)
            args += (self._scale, window, sink, True, out, kv, True, 0)
            sig = tuple(typeof(a) for a in args)  # type: ignore[no-untyped-call]
            if sig not in found:
                found.append(sig)
        return found

    def _heads(self, q: Any, keys: Any, values: Any, window: int | None, sinks: Any | None) -> Any:
        """A segment's heads where the kernel cannot run: :func:`blocked_attention`, its
        blocks shared by the threads that may run (:func:`meshnode.engine.cpu.matrix.share`);
        with sinks the reference."""
        if sinks is not None:
            return reference_heads(self.xp, q, keys, values, self.scale, window, sinks)
        threads = matrix.shared_threads()
        return blocked_attention(
            q, keys, values, self._scale, window, lambda fn, n: matrix.share(fn, n, threads)
        )


def blocked_attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: Any,
    window: int | None,
    run: Callable[[Callable[[int], None], int], None] | None = None,
) -> np.ndarray:
    """:func:`ops.attention` (NumPy, float32) by blocks of :data:`BLOCK_ROWS` query rows,
    each over the keys some row of the block sees: the scores past the causal diagonal
    (and before a sliding window) are not computed, and a block's scores stay in the
    cache. Per key/value head, the block's scores are one matrix product (BLAS) of its
    scaled queries with the keys, its weights a compiled softmax of each row over the keys
    it sees (:func:`meshnode.engine.cpu.attention_rows.block_softmax`, one pass per row
    where NumPy's took six over the block: issue 30, a resumed suffix over a long cached
    prefix), its output one product of the weights with the values. The same terms as the
    reference, summed in another order. ``q`` ``[H, r, D]``, ``keys``/``values``
    ``[Hkv, T, D]``; returns ``[H, r, D]``. ``run(fn, n)`` calls ``fn(i)`` for each of
    the ``n`` blocks (default: one after another; the CPU backend shares them between
    threads): a block's result does not depend on which thread computes it."""
    rows_kernel = _rows_kernel()
    scale = np.float32(scale)
    heads, rows, dim = q.shape
    kv_heads, t = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    q4 = q.reshape(kv_heads, group, rows, dim)
    out = np.empty((kv_heads, group, rows, dim), np.float32)  # [Hkv, G, r, D]
    first = t - rows  # query row 0's position

    def block(item: int) -> None:
        i, h = divmod(item, kv_heads)  # block i of query rows, key/value head h
        a, b = i * BLOCK_ROWS, min(rows, (i + 1) * BLOCK_ROWS)
        lo = 0 if window is None else max(0, first + a - window + 1)
        hi = first + b  # keys lo .. hi - 1: what some row of the block sees
        n, width = group * (b - a), hi - lo
        qb = q4[h, :, a:b].reshape(n, dim) * scale  # [G b, D] (the reference scales s)
        # the scores s [G b, K], in rows of K + 16 floats (the softmax pads each row)
        buf = np.empty((n, width + rows_kernel.LANES), np.float32)
        s = np.matmul(qb, keys[h, lo:hi].T, out=buf[:, :width])
        rows_kernel.block_softmax(
            buf.reshape(-1), buf.shape[1], n, b - a, first + a, lo, width, window or 0
        )
        out[h, :, a:b] = (s @ values[h, lo:hi]).reshape(group, b - a, dim)

    # Items of one key/value head's block each: a resumed suffix of a few blocks still
    # splits evenly between threads (3 blocks of SmolLM2's 3 heads: 9 items, not 3).
    count = -(-rows // BLOCK_ROWS) * kv_heads
    if run is None:
        for i in range(count):
            block(i)
    else:
        run(block, count)
    return out.reshape(heads, rows, dim)


def rotated_attention(
    qkv: np.ndarray, start: int, rows: int, cache: Any, layer: int, heads: int, scale: float
) -> np.ndarray:
    """One sequence's attention through the compiled kernel (:mod:`.cpu.attention`) when
    its queries and keys come normed and rotated (Qwen3.5's gated attention, whose partial
    RoPE and ``[query; gate]`` heads the caller unpacks): ``qkv`` ``[S, (H + 2 Hkv) D]``
    float32 in C order (the rotated queries, of which the last ``rows`` are read; the
    rotated keys; the values) of S new rows from ``start``, written into ``cache``'s layer
    ``layer``; returns the last ``rows`` rows' attention ``[r, H D]``, each row the bits of
    a decode step at its position (a verify window's rows are its steps'). For segments of
    up to :data:`KERNEL_MAX_ROWS` rows; raises ``ValueError`` when the cache is full,
    before anything is written."""
    k, n = _kernels(), qkv.shape[0]
    if start + n > cache.max_tokens:
        raise ValueError(f"KV cache full: {start + n} > {cache.max_tokens} tokens")
    dim = cache.k.shape[-1]
    table = k.segment_table([(n, rows, start, True, cache)])
    out = np.empty((rows, heads * dim), np.float32)  # [r, H D]
    none, rope = np.zeros(0, np.float32), np.zeros((0, dim), np.float32)  # no norm, no RoPE
    keep = (qkv, out, table, cache, none, rope)  # what the kernel reads by address
    k.attend_shared(
        qkv, table, layer, heads, (none, none), np.float32(0), (rope, rope),
        np.float32(scale), 0, True, out, keep, None, k.kv_kind(cache.k.dtype),
    )  # fmt: skip
    return out


def reference_heads(
    xp: Any,
    q: Any,
    keys: Any,
    values: Any,
    scale: float,
    window: int | None = None,
    sinks: Any | None = None,
) -> Any:
    """The reference's heads (:func:`ops.attention`) where the compiled kernel does not
    run (a head dimension not a multiple of sixteen, a backend without it: gpt-oss's
    sinks, Qwen3.5's gated attention): up to :data:`KERNEL_MAX_ROWS`
    query rows (decode, verify windows) a row at a time (:func:`ops.attention_by_rows`:
    a window's rows are its decode steps' bits, as the kernel's are), more in one call.
    ``q`` ``[H, r, D]``, ``keys``/``values`` ``[Hkv, T, D]``; returns ``[H, r, D]``."""
    rows = q.shape[1]
    attend = ops.attention_by_rows if rows <= KERNEL_MAX_ROWS else ops.attention
    return attend(xp, q, keys, values, scale, window, sinks)


def kept_rows(xp: Any, segs: Sequence[Segment]) -> Any:
    """Indices of each segment's last ``rows`` rows in the stacked ``[N, E]`` activations
    (a slice for one segment: no copy)."""
    if len(segs) == 1:
        return slice(segs[0].n - segs[0].rows, segs[0].n)
    ends = np.cumsum([seg.n for seg in segs])
    return xp.asarray(
        np.concatenate([np.arange(e - s.rows, e) for e, s in zip(ends, segs, strict=True)])
    )


def _kv_kind(caches: Sequence[Any]) -> Any:
    """The kernel variant (:func:`meshnode.engine.cpu.attention.kv_kind`) of the caches of
    a batch's kernel segments; raises ``ValueError`` if they are of more than one dtype."""
    kinds = {cache.k.dtype for cache in caches}
    if len(kinds) > 1:
        raise ValueError(f"a batch mixes KV caches of {sorted(map(str, kinds))}")
    return _kernels().kv_kind(kinds.pop() if kinds else np.float32)


def _for_kernel(rows: int, end: int) -> bool:
    """Whether a segment of ``rows`` new rows ending at position ``end`` goes through the
    kernel: every one (issue 30). The kernel sums each query row in one order whatever
    rows share its call, so a row's attention is the same bits however its prompt was cut
    into pieces: prefilled whole, in chunks, resumed from cached prefix blocks, or decoded
    a row at a time. Segments of more than :data:`KERNEL_MAX_ROWS` rows went to
    :func:`blocked_attention`, whose blocks of query rows count from the piece's start and
    whose BLAS products sum a row's keys in panels set by the block's width: a prompt
    resumed at 1,440 of 1,630 tokens then gave SmolLM2's last logits up to 1.0 apart in q8
    (2.3e-5 in the exact mode) from the same prompt prefilled in 256-token pieces, in about
    the same CPU time as through the kernel (docs/api.md, "Prefix caching")."""
    return True


@cache
def _rows_kernel() -> Any:
    """The compiled rows' module (:func:`blocked_attention`'s softmax), imported (numba
    with it) at the first long segment."""
    from meshnode.engine.cpu import attention_rows as module

    return module


@cache
def _kernels() -> Any:
    """The compiled kernel's module, imported (numba with it) at the first forward."""
    from meshnode.engine.cpu import attention as module

    return module
