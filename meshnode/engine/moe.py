"""A mixture-of-experts feed-forward layer: router, top-k, the chosen experts, their sum.

``moe_mlp`` takes the rows of a whole batch (every sequence's prefill, decode or verify
rows at once) and:

1. routes them: ``x @ router`` (plus gpt-oss's bias) gives each row one logit per expert;
   the family's rule (:data:`meshnode.engine.moe_config.Routing`) picks k experts and
   their weights;
2. groups the rows by expert: each chosen expert multiplies all the rows that chose it
   in one product per matrix (one read of its weights per step, however many rows), and
   experts no row chose are not read at all;
3. sums, per row, ``weight * expert(x)`` over its experts in ascending expert order,
   starting from zero (transformers' ``index_add_`` loop does the same); plus the shared
   expert times ``sigmoid(x @ shared_gate)`` where the model has one.

Exactness: a row's logits, choices, expert outputs and sum depend on that row alone (the
products are the backend's, which compute each row on its own in the exact mode, and
the order of a row's terms is fixed by expert number): the same bits in any batch.
Every product goes through ``backend.linear`` and the SwiGLU through ``backend.glu``, so
another backend gets this layer through the same code.

Shapes: r rows, E hidden, n experts, k experts per token, I an expert's size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshnode.engine import ops
from meshnode.engine.cpu import MAX_KERNEL_ROWS
from meshnode.engine.moe_config import MoeConfig
from meshnode.engine.moe_weights import ExpertWeights, MoeWeights

__all__ = ["expert_mlp", "moe_mlp", "route", "top_k"]


def top_k(xp: Any, scores: Any, k: int) -> Any:
    """Indices ``[r, k]`` of each row's k largest ``scores``, largest first; equal scores
    in index order (a stable sort: the choice depends on the row alone)."""
    return xp.argsort(-scores, axis=-1, kind="stable")[:, :k]


def route(xp: Any, logits: Any, config: MoeConfig) -> tuple[Any, Any]:
    """The experts ``[r, k]`` each row goes to and their weights ``[r, k]`` (float32).

    ``softmax_topk``: softmax over all ``n`` logits, the k largest probabilities kept,
    divided by their sum when ``norm_topk_prob`` (transformers' Qwen3-MoE, Mixtral and
    Qwen3.5-MoE routers); ``topk_softmax``: the k largest logits, softmax over those
    (gpt-oss's router).
    """
    if config.routing == "topk_softmax":
        chosen = top_k(xp, logits, config.top_k)
        return chosen, ops.softmax(xp, xp.take_along_axis(logits, chosen, axis=-1))
    probs = ops.softmax(xp, logits)  # [r, n]
    chosen = top_k(xp, probs, config.top_k)
    weights = xp.take_along_axis(probs, chosen, axis=-1)  # [r, k]
    if config.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return chosen, weights


def expert_mlp(backend: Any, config: MoeConfig, w: ExpertWeights, x: Any) -> Any:
    """One expert's gated MLP of rows ``x`` ``[r, E]`` -> ``[r, E]``."""
    gate_up = backend.linear(x, w.gate_up)  # [r, 2 I]
    if w.gate_up_bias is not None:
        gate_up = gate_up + w.gate_up_bias
    if config.glu == "clamped_swiglu":
        alpha, limit = config.swiglu_alpha, config.swiglu_limit
        act = ops.clamped_swiglu_mul(backend.xp, gate_up, alpha, limit)  # [r, I]
    else:
        act = backend.glu(gate_up, "silu")  # [r, I]
    out = backend.linear(act, w.down)  # [r, E]
    return out if w.down_bias is None else out + w.down_bias


def moe_mlp(backend: Any, config: MoeConfig, w: MoeWeights, x: Any) -> Any:
    """The layer's feed-forward output ``[r, E]`` for its normed input rows ``x``
    ``[r, E]`` (``backend``: the stage's :class:`~meshnode.engine.backend.Backend`)."""
    xp = backend.xp
    logits = backend.linear(x, w.router)  # [r, n]
    if w.router_bias is not None:
        logits = logits + w.router_bias
    chosen, weights = route(xp, logits, config)  # [r, k], [r, k]
    picks = np.asarray(backend.to_numpy(chosen))
    if _compiled_experts(backend, w, picks):
        assert w.stacked is not None
        out = w.stacked(x, picks, weights, backend.weights_dtype == "q8")
    else:
        out = _experts(backend, config, w, x, picks, weights)
    if w.shared is not None:
        shared = expert_mlp(backend, config, w.shared, x)  # [r, E]
        out = out + _sigmoid(xp, backend.linear(x, w.shared_gate)) * shared
    return out


def _compiled_experts(backend: Any, w: MoeWeights, picks: np.ndarray) -> bool:
    """Whether the chosen experts go through one compiled call
    (:class:`~meshnode.engine.cpu.experts.ExpertLayer`: the same bits as
    :func:`_experts`): experts in GGUF blocks on the CPU, and, in the exact mode, no
    expert given more rows than the kernels take (:class:`.BlockMatrix` multiplies more
    through BLAS, in another order)."""
    if w.stacked is None or not backend.cpu_blocks:
        return False
    if backend.weights_dtype == "q8":
        return True
    return int(np.bincount(picks.reshape(-1)).max(initial=0)) <= MAX_KERNEL_ROWS


def _experts(
    backend: Any, config: MoeConfig, w: MoeWeights, x: Any, picks: Any, weights: Any
) -> Any:
    """The routed experts' weighted sum, an expert at a time through the backend."""
    xp = backend.xp
    out = xp.zeros(x.shape, dtype=xp.float32)  # [r, E]
    for e in np.unique(picks):  # ascending: each row adds its experts in expert order
        rows, slots = np.nonzero(picks == e)  # the rows that chose e, and in which slot
        y = expert_mlp(backend, config, w.experts[int(e)], x[rows])  # [r_e, E]
        out[rows] += y * weights[rows, slots][:, None]
    return out


def _sigmoid(xp: Any, x: Any) -> Any:
    """``1 / (1 + e^-x)``, as torch computes it (clamped as SiLU is: finite in float32)."""
    return xp.float32(1.0) / (xp.float32(1.0) + xp.exp(-xp.maximum(x, ops.SILU_CLAMP)))
