"""A stage's forward on a CUDA device: the engine's kernels, fixed buffers, CUDA graphs.

The math is :class:`meshnode.engine.model.Stage`'s, launch by launch (the references are
:mod:`meshnode.engine.ops`); the residual add is fused into the next RMSNorm. Activations
are float32; weights are read in their device format; the KV cache is float32 with
float32 weights and float16 otherwise.

Decode and verify (up to ``MAX_ROWS`` new positions) run on buffers allocated once per
row count, so the step's launches always see the same addresses; the position and the
sequence's cache are read from the device ``step`` array (see ``kernels``). The first
forward of a (rows, output rows) shape runs eagerly; then the same launches are captured
as a CUDA graph, which every later forward of that shape replays after copying its
inputs and step in. If capture fails the stage logs it once and stays eager. Prefill
(more rows) runs eagerly with fresh buffers and float32 matmuls on weights expanded per
layer.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshnode.engine.config import ModelConfig
from meshnode.engine.cuda.device import DeviceMatrix, kernels_for
from meshnode.engine.cuda.kernels import BLOCK, MAX_HEAD_DIM, MAX_ROWS
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.weights import StageWeights

__all__ = ["CudaStage"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Buffers:
    """Device arrays for one forward of ``n`` rows (``logits`` only on the head stage)."""

    ids: Any  # [n] int32
    x: Any  # [n, E] residual stream
    y: Any  # [n, E] normed
    qkv: Any  # [n, (H + 2 Hkv) D]
    att: Any  # [n, H D]
    h: Any  # [n, E] block output before the residual add
    gate_up: Any  # [n, 2 I]
    act: Any  # [n, I]
    logits: Any | None  # [n, V]


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
        self.step = cp.zeros(4, dtype=cp.int64)  # [first position, T, K base, V base]
        import cupyx

        # Page-locked sources for the per-step copies in: ids or hidden rows, and the step.
        self._pinned_ids = cupyx.empty_pinned((MAX_ROWS,), dtype=np.int32)
        self._pinned_x = cupyx.empty_pinned((MAX_ROWS, config.hidden_size), dtype=np.float32)
        self._pinned_step = cupyx.empty_pinned((4,), dtype=np.int64)
        self._buffers: dict[int, _Buffers] = {}
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
        cache.truncate(start_pos)
        n = len(inputs)
        rows = n if out_rows is None or not self.head else min(out_rows, n)
        if start_pos + n > cache.max_tokens:
            raise ValueError(f"KV cache full: {start_pos + n} > {cache.max_tokens} tokens")
        with self._lock, self.stream:
            if n <= MAX_ROWS:
                out = self._small(inputs, start_pos, cache, n, rows)
            else:
                out = self._large(inputs, start_pos, cache, n, rows)
            self.stream.synchronize()
        cache.length = start_pos + n
        return out

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

    # -- decode and verify: fixed buffers, graphs -----------------------------------------

    def _small(self, inputs: Any, pos: int, cache: KVCache, n: int, rows: int) -> Any:
        b = self._buffers.get(n)
        if b is None:
            b = self._buffers[n] = self._allocate(n)
        if self.embed:
            self._pinned_ids[:n] = np.asarray(inputs)
            b.ids.set(self._pinned_ids[:n], stream=self.stream)
        elif isinstance(inputs, np.ndarray):
            self._pinned_x[:n] = inputs
            b.x.set(self._pinned_x[:n], stream=self.stream)
        else:
            b.x[...] = inputs  # already on the device (a stage chained in one process)
        self._pinned_step[:] = (pos, cache.max_tokens, cache.k.data.ptr, cache.v.data.ptr)
        self.step.set(self._pinned_step, stream=self.stream)
        graph = self._graphs.get((n, rows))
        if graph is not None:
            graph[0].launch(self.stream)
            return graph[1].copy()
        out = self._run(b, n, rows).copy()
        if self.use_graphs:
            self._capture(b, n, rows)
        return out

    def _capture(self, b: _Buffers, n: int, rows: int) -> None:
        """Record this shape's launches as a graph (recording runs nothing)."""
        self.stream.synchronize()
        try:
            self.stream.begin_capture()
            try:
                out = self._run(b, n, rows)
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
            gate_up=cp.empty((n, 2 * c.intermediate_size), f32),
            act=cp.empty((n, c.intermediate_size), f32),
            logits=logits,
        )

    # -- prefill -----------------------------------------------------------------------

    def _large(self, inputs: Any, pos: int, cache: KVCache, n: int, rows: int) -> Any:
        b = self._allocate(n)
        if self.embed:
            b.ids[...] = self.cp.asarray(inputs, dtype=self.cp.int32)
        else:
            b.x[...] = self.cp.asarray(inputs, dtype=self.cp.float32)
        host_step = np.array([pos, cache.max_tokens, cache.k.data.ptr, cache.v.data.ptr])
        self.step.set(host_step.astype(np.int64), stream=self.stream)
        return self._run(b, n, rows)

    # -- the forward, launch by launch ---------------------------------------------------------

    def _run(self, b: _Buffers, n: int, rows: int) -> Any:
        """Every launch of one forward; returns the output buffer (a view of ``b``)."""
        c, k, w = self.config, self.k, self.w
        eps = c.rms_norm_eps
        x = b.x
        if self.embed:
            assert w.embed_t is not None
            k.embed(w.embed_t, b.ids, x)
        if not w.layers:
            x = x[n - rows :]
        else:
            k.rms_norm(x, w.layers[0].attn_norm, b.y, eps)
        last = len(w.layers) - 1
        for i, layer in enumerate(w.layers):
            r = rows if i == last else n
            self._linear(b.y, layer.wqkv, b.qkv)  # [S, (H + 2 Hkv) D]
            if layer.bqkv is not None:
                self.cp.add(b.qkv, layer.bqkv, out=b.qkv)
            k.rope_store(b.qkv, self.inv_freq, self.step, i, c.num_heads, c.num_kv_heads, self.kv)
            att = b.att[:r]  # [r, H D]
            k.attention(b.qkv, att, self.step, i, c.num_heads, c.num_kv_heads, self.scale, self.kv)
            h = b.h[:r]
            self._linear(att, layer.wo, h)  # [r, E]
            x = x[x.shape[0] - r :]
            k.add_rms_norm(x, h, layer.ffn_norm, b.y[:r], eps)
            self._linear(b.y[:r], layer.w_gate_up, b.gate_up[:r])  # [r, 2 I]
            k.silu_mul(b.gate_up[:r], b.act[:r])  # [r, I]
            self._linear(b.act[:r], layer.w_down, h)  # [r, E]
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
        self._linear(b.y[:rows], table, logits)  # [r, V]
        return logits

    def _linear(self, x: Any, w: DeviceMatrix, y: Any) -> None:
        """``y = x @ W.T``: the decoding matvec for few rows, a cuBLAS matmul for many.

        Prefill multiplies in float32 with the weight expanded for this one call: float16
        inputs or outputs overflow (65504) on hidden states that real models do reach.
        """
        if x.shape[0] <= MAX_ROWS:
            self.k.gemv(w, x, y)
            return
        dense = w.data if w.fmt == "f32" else self.k.dequantize(w, self.cp.float32)
        self.cp.matmul(x, dense.T, out=y)
