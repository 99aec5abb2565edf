"""A mixture-of-experts layer's feed-forward for one decode row in one compiled call.

Between a decode step's weight products the forward runs Python and small compiled calls,
and each runs with cold caches, right after a product has streamed megabytes of weights
(``benchmarks/glue.py``): on Qwen3-30B-A3B's shape at two threads ~2.6 ms of a ~16 ms
token, half of it the products' own Python, which a second kernel thread does not shorten.
Trimming that Python did not help (``docs/performance.md``); fewer calls do. So a single
decode row's feed-forward half of a layer - the residual add and norm, the router's
product, the routing, the chosen experts, their sums, the next add and norm - is one
call to :func:`.moe_step_kernels.moe_step`, which posts its two products to the kernel
pool (:mod:`.pool`) from compiled code. The same compiled functions in the same order as
``engine.moe`` and ``CpuBackend.add_rms_norm`` reach one at a time: the same bits
(``tests/engine/test_moe_step.py``).

:func:`step_for` takes a layer when its feed-forward is routed experts in GGUF blocks
(the compiled experts, :class:`.experts.ExpertLayer`) with a GGUF router and no shared
expert, the row is one, and the norms are a plain pre-norm block's; else it returns None
and the stage takes the Python path. The pool's bookkeeping stays here: the cores the
gauge leaves (fewer than two: both products run alone in the call), its lock (held by
another thread: alone), each product's plan and patience (as the pool keeps them, not
learned from these posts), the job numbers, the arrays a helper may still read (kept as
:meth:`.pool.KernelPool.run` keeps them) and its counts.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.experts import ExpertLayer, job_parts
from meshnode.engine.cpu.matrix import BlockMatrix

__all__ = ["MoeStep", "step_for"]

_NO_WEIGHT = np.zeros(0, np.float32)
_NO_OUT = np.zeros((1, 1), np.float32)  # the experts' job's "output" (ys is its own)


@functools.cache
def _compiled() -> ModuleType:
    """:mod:`.moe_step_kernels`, imported (numba configured first) at the first call."""
    matrix.kernels()
    from meshnode.engine.cpu import moe_step_kernels

    return moe_step_kernels


def step_for(
    w: Any, moe: Any, eps: float, q8: bool
) -> Callable[[Any, Any, Any], tuple[Any, Any] | None] | None:
    """Layer ``w``'s :class:`MoeStep` (what ``Backend.moe_step`` gives), or None where it
    does not take the layer: not routed experts in GGUF blocks (``w.moe.stacked``) with a
    GGUF router, a float32 router bias if any and no shared expert, or norms after the
    attention or the feed-forward. ``moe``: the model's
    :class:`~meshnode.engine.moe_config.MoeConfig`; ``q8``: the 8-bit products
    (``--dtype q8``)."""
    f = getattr(w, "moe", None)
    if f is None or moe is None or w.post_attn_norm is not None or w.post_ffn_norm is not None:
        return None
    bias = f.router_bias
    bias_ok = bias is None or (isinstance(bias, np.ndarray) and bias.dtype == np.float32)
    if not isinstance(f.stacked, ExpertLayer) or f.shared is not None or not bias_ok:
        return None
    if not isinstance(f.router, BlockMatrix):
        return None
    routing = (moe.routing == "topk_softmax", moe.norm_topk_prob, moe.top_k)
    return MoeStep(f.router, bias, f.stacked, routing, q8, w.ffn_norm, eps)


class MoeStep:
    """One layer's feed-forward half of a one-row step in one call: ``step(x, h, then)``
    gives the layer's output for one decode row ``x`` ``[1, E]`` (the residual) and its
    attention output ``h``, and that through the norm ``then`` (None: not normed); None
    where it does not take the call (the caller then takes the Python path, the same
    bits). What does not change from call to call is worked out at the first."""

    def __init__(
        self,
        router: BlockMatrix,
        router_bias: np.ndarray | None,
        layer: ExpertLayer,
        routing: tuple[bool, bool, int],
        q8: bool,
        ffn_norm: np.ndarray,
        eps: float,
    ) -> None:
        self.router, self.layer, self.routing, self.q8 = router, layer, routing, q8
        self.bias = _NO_WEIGHT if router_bias is None else router_bias
        self.ffn_norm, self.eps = ffn_norm, np.float32(eps)
        self._static: tuple[Any, ...] | None = None  # at the first call

    def _statics(self, width: int) -> tuple[Any, ...]:
        """The call's arguments that do not change: the router's chunk function, parts
        and bias; the experts' stacks, activation, chunk function and parts; the rule."""
        k, layer = _compiled(), self.layer
        kernels = matrix.kernels()
        router_fn = kernels.chunk_kernel(*self.router._fmts, kernels.ONE_ROW)
        experts_fn = k.experts_kernels.experts_chunk(*layer.keys(self.q8))
        topk_softmax, norm_topk, top_k = self.routing
        n = self.router.n_out
        return (
            router_fn, self.router._raws, self.bias,
            (*layer.gate_up.raws, *layer.down.raws, layer.gate_up_bias, layer.down_bias,
             layer.kind, np.float32(layer.alpha), np.float32(layer.limit)),
            experts_fn, job_parts(top_k), (topk_softmax, norm_topk, top_k),
            k.f32_words(width, n, top_k), k.i64_words(n, top_k),
        )  # fmt: skip

    def __call__(self, x: Any, h: Any, then: Any) -> tuple[np.ndarray, np.ndarray | None] | None:
        if x.shape[0] != 1 or h.shape != x.shape or x.shape[1] % 16:
            return None
        if x.dtype != np.float32 or h.dtype != np.float32:
            return None
        width = x.shape[1]
        if self._static is None:
            self._static = self._statics(width)
        router_fn, router_parts, bias, experts, experts_fn, e_parts, rule, f32n, i64n = self._static
        k = _compiled()
        x, h = np.ascontiguousarray(x), np.ascontiguousarray(h)
        pool = matrix._pool()
        threads = min(matrix._threads_here(), int(pool.gauge.free() + 0.5))
        shared = threads > 1 and os.getpid() == pool._pid and pool._lock.acquire(blocking=False)
        try:
            if shared:
                pool._start(threads, 7 * width)
                n = self.router.n_out
                r_plan = pool.plan_of(router_fn, router_parts, 1, width, n, threads)
                words = k.experts_kernels.BLOCK_WORDS
                e_plan = pool.plan_of(experts_fn, e_parts, 1, words, 1, threads)
                r_rows, r_patience = r_plan.rows, pool.patience(r_plan)
                e_rows, e_patience = e_plan.rows, pool.patience(e_plan)
                pool.ask_ahead(r_plan, threads)  # the experts' job is too small to count
            else:  # each product alone, in chunks of the pool's size
                r_rows = e_rows = k.experts_kernels.TASK_ROWS  # the pool's CHUNK_ROWS
                r_patience = e_patience = 0
            f32, i64 = np.empty(f32n, np.float32), np.zeros(i64n, np.int64)
            k.moe_step(
                x, h, self.ffn_norm, _NO_WEIGHT if then is None else then, self.eps,
                pool._st, pool._gen, shared, pool._scratch,
                router_fn, *router_parts, bias, r_rows, r_patience,
                *experts, experts_fn, *e_parts[:2], e_rows, e_patience, _NO_OUT,
                *rule, f32, i64,
            )  # fmt: skip
            if shared:
                keep = (self, then, x, h, f32, i64)  # the weights, the call's arrays
                jobs, woken, declined = (int(c) for c in i64[:3])
                pool.posted_compiled([r_plan, e_plan], jobs, woken, declined, keep)
        finally:
            if shared:
                pool._lock.release()
        out = f32[3 * width : 4 * width].reshape(1, width)
        return out, None if then is None else f32[4 * width : 5 * width].reshape(1, width)
