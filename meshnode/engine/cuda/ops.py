"""The CUDA backend's array operations: one kernel launch (or a few) per operation.

``CudaBackend`` (``meshnode.engine.backend``) hands each operation of ``model.Stage``'s
block here: products with the weights (:meth:`CudaOps.linear`: the decoding matvec for a
decode or verify batch, a float32 cuBLAS matmul on the weight expanded for a prompt),
RMSNorm and the residual add fused into the next norm, the gated MLP's activation, the
embedding gather, and attention (:class:`CudaAttention`). Every launch goes on CuPy's
current stream and reads what it needs from device arrays, so a CUDA graph captures the
block as it runs (``meshnode.engine.cuda.graphs``). Arrays that are not device matrices
(a hybrid model's weights) go through CuPy's own operators: the same expressions as on
the CPU. The math of every kernel is the function of the same name in
:mod:`meshnode.engine.ops`.

Shapes: N new rows, R rows kept, E hidden, H/Hkv heads, D head dim, I intermediate size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshnode.engine import ops
from meshnode.engine.attention import Segment
from meshnode.engine.config import ModelConfig
from meshnode.engine.cuda.device import DeviceMatrix, Kernels, kernels_for
from meshnode.engine.cuda.kernels import BLOCK, MAX_BATCH_ROWS, MAX_HEAD_DIM, STEP

__all__ = ["CudaAttention", "CudaOps", "StepPlan", "fill_step", "kv_kind"]


def kv_kind(dtype: Any) -> str:
    """The kernels' KV variant of a cache of ``dtype``: ``float`` or ``u16`` (float16 bits)."""
    return "float" if np.dtype(dtype) == np.float32 else "u16"


class CudaOps:
    """The operations of one device (``cp``: CuPy), launched on the current stream."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.k: Kernels = kernels_for(cp)
        self.k.warm_up()

    def linear(self, x: Any, w: Any, sizes: Sequence[int] | None = None) -> Any:
        """``x @ W.T`` for a device matrix ``W [out, in]`` (else ``x @ w``): the matvec up
        to ``MAX_BATCH_ROWS`` rows (a row's sum does not depend on the others), beyond a
        float32 matmul on W expanded for this call (float16 overflows on hidden states
        real models reach)."""
        if not isinstance(w, DeviceMatrix):
            return x @ w
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        y = cp.empty((x.shape[0], w.out_features), cp.float32)
        if x.shape[0] <= MAX_BATCH_ROWS:
            self.k.gemv(w, x, y)
            return y
        dense = w.data if w.fmt == "f32" else self.k.dequantize(w, cp.float32)
        cp.matmul(x, dense.T, out=y)
        return y

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """RMSNorm of the rows of ``x`` ``[r, E]``."""
        if x.ndim != 2:
            return ops.rms_norm(self.cp, x, weight, eps)
        x = self.cp.ascontiguousarray(x, dtype=self.cp.float32)
        y = self.cp.empty_like(x)
        self.k.rms_norm(x, weight, y, eps)
        return y

    def add_rms_norm(
        self, x: Any, h: Any, h_weight: Any | None, weight: Any | None, eps: float
    ) -> tuple[Any, Any | None]:
        """``x + h`` (``h`` normed first with ``h_weight``) and the sum normed with
        ``weight``, the add fused into the norm; ``x`` is left as it was."""
        if h_weight is not None:
            h = self.rms_norm(h, h_weight, eps)
        if weight is None or x.ndim != 2:
            total = self.add(x, h)
            return total, None if weight is None else self.rms_norm(total, weight, eps)
        cp = self.cp
        total = cp.empty(x.shape, cp.float32)
        cp.copyto(total, x)  # the kernel adds in place
        y = cp.empty_like(total)
        self.k.add_rms_norm(total, cp.ascontiguousarray(h), weight, y, eps)
        return total, y

    def add(self, x: Any, b: Any) -> Any:
        """``x + b`` into a new array (a bias row ``b`` broadcast over the rows)."""
        out = self.cp.empty(x.shape, self.cp.float32)
        self.cp.add(x, b, out=out)
        return out

    def scale(self, x: Any, factor: Any) -> Any:
        """``x * factor`` into a new array."""
        out = self.cp.empty(x.shape, self.cp.float32)
        self.cp.multiply(x, factor, out=out)
        return out

    def glu(self, gate_up: Any, activation: str) -> Any:
        """The gated MLP's activation ``[r, 2 I]`` -> ``[r, I]`` (SwiGLU or GeGLU)."""
        cp = self.cp
        gate_up = cp.ascontiguousarray(gate_up, dtype=cp.float32)
        out = cp.empty((gate_up.shape[0], gate_up.shape[1] // 2), cp.float32)
        if activation == "gelu_tanh":
            self.k.gelu_tanh_mul(gate_up, out)
        else:
            self.k.silu_mul(gate_up, out)
        return out

    def embed_rows(self, table: Any, ids: Any) -> Any:
        """The rows ``[S, E]`` of token ``ids``: of a device matrix ``[V, E]``, decoded by
        the gather kernel; of a plain ``[E, V]`` table, by indexing."""
        cp = self.cp
        if not isinstance(table, DeviceMatrix):
            return table[:, cp.asarray(ids, dtype=cp.int64)].T
        ids = cp.asarray(ids, dtype=cp.int32)
        x = cp.empty((ids.shape[0], table.in_features), cp.float32)
        self.k.embed(table, ids, x)
        return x


@dataclass(frozen=True)
class StepPlan:
    """One forward's step table on the device (see ``kernels``): ``n`` new rows, ``rows``
    kept past the last layer's attention."""

    step: Any  # int64 [>= n, STEP]
    n: int
    rows: int


def fill_step(segs: Sequence[Segment], table: np.ndarray) -> None:
    """The step table of a forward of ``segs``: each new row's position and its
    sequence's cache (rows per head, K and V, its block table on the device); in column
    4, the new row of each kept row."""
    a = o = 0
    for seg in segs:
        c = seg.cache
        table[a : a + seg.n, 0] = np.arange(seg.start_pos, seg.start_pos + seg.n)
        table[a : a + seg.n, 1:4] = (c.k.shape[2], c.k.data.ptr, c.v.data.ptr)
        table[a : a + seg.n, 5] = c.device_blocks.data.ptr
        table[o : o + seg.rows, 4] = np.arange(a + seg.n - seg.rows, a + seg.n)
        a, o = a + seg.n, o + seg.rows


class CudaAttention:
    """Attention of layers ``[start, end)`` on the device, every sequence of a batch in
    one launch per kernel: QK-norm, RoPE with the K/V writes, causal (sliding-window)
    attention, each row reading its position and cache from the step table."""

    def __init__(self, ops_: CudaOps, config: ModelConfig, start: int, end: int) -> None:
        if config.head_dim > MAX_HEAD_DIM or BLOCK % config.head_dim:
            raise ValueError(
                f"CUDA attention needs head_dim dividing {BLOCK}, not {config.head_dim}"
            )
        cp = ops_.cp
        self.ops, self.cp, self.config = ops_, cp, config
        freqs = [np.asarray(config.rope_inv_freq(i), np.float32) for i in range(start, end)]
        self.inv_freq = [cp.asarray(f) for f in freqs]  # [D/2] per layer
        self.windows = [config.window(i) or 0 for i in range(start, end)]
        self.scale = config.attention_scale
        # The step table of forwards of up to MAX_BATCH_ROWS rows: one device array (a
        # captured graph reads it at its address), filled through page-locked memory.
        import cupyx

        self._step = cp.zeros((MAX_BATCH_ROWS, STEP), dtype=cp.int64)
        self._pinned = cupyx.empty_pinned((MAX_BATCH_ROWS, STEP), dtype=np.int64)
        self._pinned[...] = 0

    def prepare(self, segs: Sequence[Segment]) -> StepPlan:
        """The step table of ``segs`` on the device, and the block table of each sequence
        whose table changed (a paged cache took, shared or copied a block), copied on the
        current stream. Raises ``ValueError`` when a sequence would overflow its cache."""
        stream = self.cp.cuda.get_current_stream()
        for seg in segs:
            if (end := seg.start_pos + seg.n) > seg.cache.max_tokens:
                raise ValueError(f"KV cache full: {end} > {seg.cache.max_tokens} tokens")
        for seg in segs:
            if seg.cache.blocks_stale:  # ordered before the forward that reads it
                seg.cache.device_blocks.set(seg.cache.blocks, stream=stream)
                seg.cache.blocks_stale = False
        n, rows = sum(seg.n for seg in segs), sum(seg.rows for seg in segs)
        if n > MAX_BATCH_ROWS:  # a prompt: a table of its own
            table = np.zeros((n, STEP), np.int64)
            fill_step(segs, table)
            return StepPlan(self.cp.asarray(table), n, rows)
        fill_step(segs, self._pinned)
        self._step[:n].set(self._pinned[:n], stream=stream)
        return StepPlan(self._step, n, rows)

    def keep_rows(self, x: Any, segs: Sequence[Segment], plan: StepPlan) -> Any:
        """Each segment's last ``rows`` rows of ``x`` ``[N, E]``, gathered by the step
        table's last column."""
        if plan.rows == x.shape[0]:
            return x
        out = self.cp.empty((plan.rows, x.shape[1]), self.cp.float32)
        self.ops.k.gather_rows(self.cp.ascontiguousarray(x), plan.step, out)
        return out

    def __call__(
        self,
        qkv: Any,
        segs: Sequence[Segment],
        plan: StepPlan,
        layer: int,
        norms: tuple[Any | None, Any | None],
        last: bool,
        sinks: Any | None = None,
    ) -> Any:
        """``qkv`` ``[N, (H + 2 Hkv) D]`` -> ``[R, H D]`` (``R = N`` but in the ``last``
        layer), as :meth:`meshnode.engine.attention.Attention.__call__`. No attention
        sinks: ``CudaBackend.check_model`` refuses a model with them."""
        assert sinks is None  # check_model refused the model
        c, k, cp = self.config, self.ops.k, self.cp
        qkv = cp.ascontiguousarray(qkv, dtype=cp.float32)  # normed and rotated in place
        heads, kv_heads = c.num_heads, c.num_kv_heads
        if norms[0] is not None:
            k.qk_norm(qkv, norms[0], norms[1], heads, kv_heads, c.rms_norm_eps)
        kv = kv_kind(segs[0].cache.k.dtype)
        k.rope_store(qkv, self.inv_freq[layer], plan.step, layer, heads, kv_heads, kv)
        out = cp.empty((plan.rows if last else plan.n, c.q_size), cp.float32)
        window = self.windows[layer]
        k.attention(qkv, out, plan.step, layer, heads, kv_heads, self.scale, kv, window)
        return out
