"""A stage's forward on a CUDA device: the engine's kernels, fixed buffers, CUDA graphs.

The math is :class:`meshnode.engine.model.Stage`'s, launch by launch (the references are
:mod:`meshnode.engine.ops`); the residual add is fused into the next RMSNorm. Activations
are float32; weights are read in their device format; the KV cache is float32 with
float32 weights and float16 otherwise.

A forward takes a batch: the new rows of several sequences (decode rows, verify windows,
short prompt chunks), stacked. Every product with a weight runs once over all their rows;
RoPE, the K/V writes and attention run per row, each row reading its position and its
sequence's cache from the device ``step`` table (see ``kernels``), so a row's result is
the same whatever else is in the batch. Sequences of up to ``MAX_ROWS`` new rows, up to
``MAX_BATCH_ROWS`` rows in all, run on buffers allocated once, so the launches always see
the same addresses. The first forward of a (rows, output rows) shape runs eagerly; then
the same launches are captured as a CUDA graph, which every later forward of that shape
replays after copying its inputs and step table in (up to ``MAX_GRAPHS`` shapes). If
capture fails the stage logs it once and stays eager. A longer sequence (a prefill) runs
alone, eagerly, with fresh buffers and float32 matmuls on weights expanded per layer.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np

from meshnode.engine.config import ModelConfig
from meshnode.engine.cuda.device import DeviceMatrix, kernels_for
from meshnode.engine.cuda.kernels import BLOCK, MAX_BATCH_ROWS, MAX_HEAD_DIM, MAX_ROWS, STEP
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.weights import StageWeights

__all__ = ["MAX_GRAPHS", "BatchItem", "CudaStage"]

log = logging.getLogger(__name__)

# CUDA graphs a stage keeps, one per (rows, output rows) shape. A server meets few shapes
# (decode batches (B, B), verify windows (k + 1, k + 1), short prompt chunks (n, 1) and
# their mixes), each graph holding a few hundred launch nodes; the bound keeps a stream
# of odd shapes from growing device memory. Shapes past it run eagerly.
MAX_GRAPHS = 256


class BatchItem(Protocol):
    """One sequence's part of a batched forward (``model.BatchRow`` is one)."""

    @property
    def inputs(self) -> Any: ...  # token ids [S] (first stage) or hidden states [S, E]
    @property
    def start_pos(self) -> int: ...
    @property
    def cache(self) -> KVCache: ...
    @property
    def out_rows(self) -> int | None: ...


@dataclass(frozen=True)
class _Part:
    """Where one item sits in a forward: ``n`` new rows from ``start_pos``, the last
    ``rows`` of them wanted out (all of them but on the head stage)."""

    inputs: Any
    start_pos: int
    n: int
    rows: int
    cache: KVCache


@dataclass(frozen=True)
class _Buffers:
    """Device arrays for one forward of ``n`` rows (``logits`` only on the head stage)."""

    ids: Any  # [n] int32
    x: Any  # [n, E] residual stream
    y: Any  # [n, E] normed
    qkv: Any  # [n, (H + 2 Hkv) D]
    att: Any  # [n, H D]
    h: Any  # [n, E] block output before the residual add
    kept: Any  # [n, E] the residual rows the last layer keeps (gathered)
    gate_up: Any  # [n, 2 I]
    act: Any  # [n, I]
    logits: Any | None  # [n, V]

    def first(self, n: int) -> _Buffers:
        """The same arrays cut to their first ``n`` rows (views: the same addresses)."""
        arrays = {f.name: getattr(self, f.name) for f in fields(self)}
        return _Buffers(**{k: None if a is None else a[:n] for k, a in arrays.items()})


class CudaStage:
    """The device side of a :class:`~meshnode.engine.model.Stage` (built for it by
    ``CudaBackend.device_stage``)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: StageWeights,
        *,
        embed: bool,
        head: bool,
        cp: Any,
        cuda_graphs: bool = True,
    ) -> None:
        """``cp`` is CuPy; ``cuda_graphs`` whether decode/verify steps are captured."""
        if config.head_dim > MAX_HEAD_DIM or BLOCK % config.head_dim:
            raise ValueError(
                f"CUDA attention needs head_dim dividing {BLOCK}, not {config.head_dim}"
            )
        self.cp, self.config, self.w = cp, config, weights
        self.embed, self.head = embed, head
        self.k = kernels_for(cp)
        self.k.warm_up()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.use_graphs = cuda_graphs
        # float32 weights mean the float32 mode (golden parity): its cache is float32 too.
        first = weights.layers[0].wqkv if weights.layers else None
        self.kv = "float" if first is None or first.fmt == "f32" else "u16"
        inv_freq = np.asarray(config.rope_inv_freq(), dtype=np.float32)
        self.inv_freq = cp.asarray(inv_freq, dtype=cp.float32)
        self.scale = float(1.0 / np.sqrt(config.head_dim))
        self.step = cp.zeros((MAX_BATCH_ROWS, STEP), dtype=cp.int64)  # see kernels
        import cupyx

        # Page-locked sources for the per-step copies in: ids or hidden rows, the step table.
        e = config.hidden_size
        self._pinned_ids = cupyx.empty_pinned((MAX_BATCH_ROWS,), dtype=np.int32)
        self._pinned_x = cupyx.empty_pinned((MAX_BATCH_ROWS, e), dtype=np.float32)
        self._pinned_step = cupyx.empty_pinned((MAX_BATCH_ROWS, STEP), dtype=np.int64)
        self._pinned_step[...] = 0
        self._fixed: _Buffers | None = None  # grown to a power of two of rows as needed
        self._graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def new_cache(self, max_tokens: int) -> KVCache:
        """A KV cache of ``max_tokens`` positions, allocated in full now (float16 or float32)."""
        c, cp = self.config, self.cp
        dtype = cp.float32 if self.kv == "float" else cp.uint16
        return KVCache(
            cp, self.w.end - self.w.start, c.num_kv_heads, c.head_dim, max_tokens, dtype=dtype
        )

    def forward(self, inputs: Any, start_pos: int, cache: KVCache, out_rows: int | None) -> Any:
        """As ``Stage.forward``; returns a new device array (hidden ``[S, E]`` or logits)."""
        return self.forward_batch([_Item(inputs, start_pos, cache, out_rows)])[0]

    def forward_batch(self, items: Sequence[BatchItem]) -> list[Any]:
        """As ``Stage.forward_batch``: one output per item (device arrays, views of one
        new array per forward).

        Items of up to ``MAX_ROWS`` new rows run together, ``MAX_BATCH_ROWS`` rows per
        forward; a longer item runs alone. Raises ``ValueError`` when two items name one
        cache, an item starts past its cache's length, or a cache would overflow.
        """
        if len({id(i.cache) for i in items}) != len(items):
            raise ValueError("a batch names each sequence's cache once")
        for item in items:
            if (end := item.start_pos + len(item.inputs)) > item.cache.max_tokens:
                raise ValueError(f"KV cache full: {end} > {item.cache.max_tokens} tokens")
        parts = [self._part(i) for i in items]
        outs: list[Any] = [None] * len(parts)
        with self._lock, self.stream:
            for group in _groups([p.n for p in parts]):
                if parts[group[0]].n > MAX_ROWS:
                    outs[group[0]] = self._large(parts[group[0]])
                else:
                    run = [parts[i] for i in group]
                    for i, out in zip(group, _split(self._small(run), run), strict=True):
                        outs[i] = out
                # The copies in read the pinned buffers when the stream reaches them: the
                # next forward may rewrite those only once this one is done.
                self.stream.synchronize()
        for p in parts:
            p.cache.length = p.start_pos + p.n
        return outs

    def _part(self, item: BatchItem) -> _Part:
        item.cache.truncate(item.start_pos)
        n, out_rows = len(item.inputs), item.out_rows
        rows = n if out_rows is None or not self.head else min(out_rows, n)
        return _Part(item.inputs, item.start_pos, n, rows, item.cache)

    def replay_seconds(self, rows: int, repeats: int) -> float | None:
        """Device seconds of one replay of the graph for ``rows`` new rows (all output).

        Timed with CUDA events over ``repeats`` back-to-back replays, so it is the device's
        share of a step without the host's. None when no such graph was captured (graphs
        off, or no forward of that shape yet). For benchmarks: the replays rewrite the
        K/V of the last step's positions with the same values.
        """
        graph = self._graphs.get((rows, rows))
        if graph is None:
            return None
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        with self._lock:
            start.record(self.stream)
            for _ in range(repeats):
                graph[0].launch(self.stream)
            end.record(self.stream)
            end.synchronize()
        return float(cp.cuda.get_elapsed_time(start, end)) / 1e3 / repeats

    # -- decode, verify and their batches: fixed buffers, graphs ------------------------

    def _small(self, parts: list[_Part]) -> Any:
        """The stacked output of ``parts`` run as one forward on the fixed buffers."""
        n, rows = sum(p.n for p in parts), sum(p.rows for p in parts)
        b = self._fixed_buffers(n)
        self._copy_inputs(parts, b)
        _fill_step(parts, self._pinned_step)
        self.step.set(self._pinned_step, stream=self.stream)
        graph = self._graphs.get((n, rows))
        if graph is not None:
            graph[0].launch(self.stream)
            return graph[1].copy()
        out = self._run(b, self.step, n, rows, MAX_BATCH_ROWS).copy()
        if self.use_graphs and len(self._graphs) < MAX_GRAPHS:
            self._capture(b, n, rows)
        return out

    def _copy_inputs(self, parts: list[_Part], b: _Buffers) -> None:
        """Token ids or hidden rows of every part into ``b``, through pinned memory."""
        bounds = np.cumsum([0, *(p.n for p in parts)])
        if self.embed:
            for p, a in zip(parts, bounds, strict=False):
                self._pinned_ids[a : a + p.n] = np.asarray(p.inputs)
            b.ids.set(self._pinned_ids[: bounds[-1]], stream=self.stream)
            return
        host = [isinstance(p.inputs, np.ndarray) for p in parts]
        if any(host):
            for p, a, on_host in zip(parts, bounds, host, strict=False):
                if on_host:
                    self._pinned_x[a : a + p.n] = p.inputs
            b.x.set(self._pinned_x[: bounds[-1]], stream=self.stream)
        for p, a, on_host in zip(parts, bounds, host, strict=False):
            if not on_host:  # already on the device (a stage chained in one process)
                b.x[a : a + p.n] = p.inputs

    def _fixed_buffers(self, n: int) -> _Buffers:
        """The fixed buffers cut to ``n`` rows; growing them drops the graphs on the old."""
        if self._fixed is None or self._fixed.x.shape[0] < n:
            size = min(MAX_BATCH_ROWS, 1 << (n - 1).bit_length())
            self._graphs.clear()
            self._fixed = None  # free the old buffers before the new ones are made
            self._fixed = self._allocate(size)
        return self._fixed.first(n)

    def _capture(self, b: _Buffers, n: int, rows: int) -> None:
        """Record this shape's launches as a graph (recording runs nothing)."""
        self.stream.synchronize()
        try:
            self.stream.begin_capture()
            try:
                out = self._run(b, self.step, n, rows, MAX_BATCH_ROWS)
            finally:
                graph = self.stream.end_capture()
        except Exception as exc:  # any CUDA/CuPy refusal: the eager path stays correct
            self.use_graphs = False
            log.warning("CUDA graph capture failed, decoding without graphs: %s", exc)
            return
        self._graphs[(n, rows)] = (graph, out)

    def _allocate(self, n: int) -> _Buffers:
        c, cp = self.config, self.cp
        e, f32 = c.hidden_size, cp.float32
        logits = None
        if self.head:
            table = self.w.head_t if self.w.head_t is not None else self.w.embed_t
            assert table is not None
            logits = cp.empty((n, table.out_features), f32)
        return _Buffers(
            ids=cp.zeros(n, cp.int32),
            x=cp.empty((n, e), f32),
            y=cp.empty((n, e), f32),
            qkv=cp.empty((n, c.q_size + 2 * c.kv_size), f32),
            att=cp.empty((n, c.q_size), f32),
            h=cp.empty((n, e), f32),
            kept=cp.empty((n, e), f32),
            gate_up=cp.empty((n, 2 * c.intermediate_size), f32),
            act=cp.empty((n, c.intermediate_size), f32),
            logits=logits,
        )

    # -- prefill -----------------------------------------------------------------------

    def _large(self, p: _Part) -> Any:
        """One long sequence, eagerly, on fresh buffers and step table."""
        cp = self.cp
        b = self._allocate(p.n)
        if self.embed:
            b.ids[...] = cp.asarray(p.inputs, dtype=cp.int32)
        else:
            b.x[...] = cp.asarray(p.inputs, dtype=cp.float32)
        table = np.zeros((p.n, STEP), np.int64)
        _fill_step([p], table)
        return self._run(b, cp.asarray(table), p.n, p.rows, MAX_ROWS)

    # -- the forward, launch by launch ---------------------------------------------------------

    def _run(self, b: _Buffers, step: Any, n: int, rows: int, matvec_rows: int) -> Any:
        """Every launch of one forward of ``n`` new rows, ``rows`` of them out; returns the
        output buffer (a view of ``b``). Products over at most ``matvec_rows`` rows run on
        the matvec, longer ones as float32 matmuls."""
        c, k, w = self.config, self.k, self.w
        eps = c.rms_norm_eps

        def linear(x: Any, m: DeviceMatrix, y: Any) -> None:
            self._linear(x, m, y, matvec_rows)

        x = b.x
        if self.embed:
            assert w.embed_t is not None
            k.embed(w.embed_t, b.ids, x)
        if not w.layers:
            x = self._keep(x, b, step, rows)
        else:
            k.rms_norm(x, w.layers[0].attn_norm, b.y, eps)
        last = len(w.layers) - 1
        for i, layer in enumerate(w.layers):
            r = rows if i == last else n
            linear(b.y, layer.wqkv, b.qkv)  # [S, (H + 2 Hkv) D]
            if layer.bqkv is not None:
                self.cp.add(b.qkv, layer.bqkv, out=b.qkv)
            # per row: its position, its sequence's cache
            k.rope_store(b.qkv, self.inv_freq, step, i, c.num_heads, c.num_kv_heads, self.kv)
            att = b.att[:r]  # [r, H D]
            k.attention(b.qkv, att, step, i, c.num_heads, c.num_kv_heads, self.scale, self.kv)
            h = b.h[:r]
            linear(att, layer.wo, h)  # [r, E]
            x = self._keep(x, b, step, r)  # [r, E]
            k.add_rms_norm(x, h, layer.ffn_norm, b.y[:r], eps)
            linear(b.y[:r], layer.w_gate_up, b.gate_up[:r])  # [r, 2 I]
            k.silu_mul(b.gate_up[:r], b.act[:r])  # [r, I]
            linear(b.act[:r], layer.w_down, h)  # [r, E]
            if i < last:
                k.add_rms_norm(x, h, w.layers[i + 1].attn_norm, b.y, eps)
            elif self.head:
                assert w.norm is not None
                k.add_rms_norm(x, h, w.norm, b.y[:r], eps)
            else:
                self.cp.add(x, h, out=x)
        if not self.head:
            return x
        if not w.layers:
            assert w.norm is not None
            k.rms_norm(x, w.norm, b.y[:rows], eps)
        table = w.head_t if w.head_t is not None else w.embed_t
        assert table is not None
        assert b.logits is not None
        logits = b.logits[:rows]
        linear(b.y[:rows], table, logits)  # [r, V]
        return logits

    def _keep(self, x: Any, b: _Buffers, step: Any, rows: int) -> Any:
        """The residual rows the rest of the forward needs: all of ``x``, or (the last
        layer) each sequence's last rows, gathered into ``b.kept``."""
        if rows == x.shape[0]:
            return x
        kept = b.kept[:rows]
        self.k.gather_rows(x, step, kept)
        return kept

    def _linear(self, x: Any, w: DeviceMatrix, y: Any, matvec_rows: int) -> None:
        """``y = x @ W.T``: the decoding matvec for few rows, a cuBLAS matmul for many.

        Prefill multiplies in float32 with the weight expanded for this one call: float16
        inputs or outputs overflow (65504) on hidden states that real models do reach.
        """
        if x.shape[0] <= matvec_rows:
            self.k.gemv(w, x, y)
            return
        dense = w.data if w.fmt == "f32" else self.k.dequantize(w, self.cp.float32)
        self.cp.matmul(x, dense.T, out=y)


@dataclass(frozen=True, slots=True)
class _Item:
    inputs: Any
    start_pos: int
    cache: KVCache
    out_rows: int | None


def _groups(sizes: list[int]) -> list[list[int]]:
    """Items (by index) in forwards: a sequence of more than ``MAX_ROWS`` rows alone, the
    others together in order, at most ``MAX_BATCH_ROWS`` rows per forward."""
    groups: list[list[int]] = []
    run: list[int] = []
    for i, n in enumerate(sizes):
        if n > MAX_ROWS:
            groups.append([i])
            continue
        if run and sum(sizes[j] for j in run) + n > MAX_BATCH_ROWS:
            groups.append(run)
            run = []
        run.append(i)
    return [*groups, run] if run else groups


def _fill_step(parts: list[_Part], table: np.ndarray) -> None:
    """The step table of a forward of ``parts`` (see ``kernels``): each new row's position
    and its sequence's cache; in the last column, the new row of each output row."""
    a = o = 0
    for p in parts:
        table[a : a + p.n, 0] = np.arange(p.start_pos, p.start_pos + p.n)
        table[a : a + p.n, 1:4] = (p.cache.max_tokens, p.cache.k.data.ptr, p.cache.v.data.ptr)
        table[o : o + p.rows, 4] = np.arange(a + p.n - p.rows, a + p.n)
        a, o = a + p.n, o + p.rows


def _split(out: Any, parts: list[_Part]) -> list[Any]:
    """The stacked output of a forward cut back into one array per part."""
    bounds = np.cumsum([0, *(p.rows for p in parts)])
    return [out[a:b] for a, b in itertools.pairwise(bounds)]
