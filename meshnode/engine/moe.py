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

Exactness: a row's logits, choices, expert outputs and sum depend on that row alone, the
same bits in any batch, verify window or thread count. The order of a row's terms is fixed
by expert number, and each product takes the path the row's *segment* (its sequence's
rows in this pass, ``sizes``) would take alone, as the dense layers' do (issue 35): a row
of a segment of at most :data:`~meshnode.engine.cpu.MAX_KERNEL_ROWS` rows (decode,
verify) goes through the kernels, however many rows of the batch chose its expert (the
compiled experts, or at most that many rows a product); a row of a longer one (prefill)
through BLAS, at least that many rows plus one a product (zero rows added). The 8-bit
kernels compute a row alone whatever the count, so ``--dtype q8`` gives every row to the
compiled experts.
Every product goes through ``backend.linear`` and the SwiGLU through ``backend.glu``, so
another backend gets this layer through the same code.

Shapes: r rows, E hidden, n experts, k experts per token, I an expert's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from meshnode.engine import ops
from meshnode.engine.cpu import MAX_KERNEL_ROWS, experts
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


def expert_mlp(
    backend: Any, config: MoeConfig, w: ExpertWeights, x: Any, sizes: Sequence[int] | None = None
) -> Any:
    """One expert's gated MLP of rows ``x`` ``[r, E]`` -> ``[r, E]`` (``sizes``: the
    segments' row counts, as :meth:`Backend.linear` takes them)."""
    gate_up = backend.linear(x, w.gate_up, sizes)  # [r, 2 I]
    if w.gate_up_bias is not None:
        gate_up = gate_up + w.gate_up_bias
    if config.glu == "clamped_swiglu":
        alpha, limit = config.swiglu_alpha, config.swiglu_limit
        act = backend.clamped_glu(gate_up, alpha, limit)  # [r, I]
    else:
        act = backend.glu(gate_up, "silu")  # [r, I]
    out = backend.linear(act, w.down, sizes)  # [r, E]
    return out if w.down_bias is None else out + w.down_bias


def moe_mlp(
    backend: Any, config: MoeConfig, w: MoeWeights, x: Any, sizes: Sequence[int] | None = None
) -> Any:
    """The layer's feed-forward output ``[r, E]`` for its normed input rows ``x``
    ``[r, E]`` (``backend``: the stage's :class:`~meshnode.engine.backend.Backend`;
    ``sizes``: the row counts of the batch's segments in ``x``, in order, one segment
    without: each row's products take the path its segment would take alone)."""
    xp = backend.xp
    sizes = [x.shape[0]] if sizes is None else list(sizes)
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"segments of {sum(sizes)} rows for x of {x.shape[0]}")
    logits = backend.linear(x, w.router, sizes)  # [r, n]
    if w.router_bias is not None:
        logits = logits + w.router_bias
    routes = None
    compiled = _compiled_experts(backend, w)
    q8 = backend.weights_dtype == "q8"
    if compiled:  # softmax, top-k and grouping in one compiled call
        routes = experts.route(logits, config.top_k, *_rule(config))
        picks, weights = routes.picks, routes.weights  # [r, k], [r, k]
        if q8 or max(sizes, default=0) <= MAX_KERNEL_ROWS:
            # every row through the compiled experts (the 8-bit kernels take any rows,
            # one row as many): the path below with no row long, without its Python
            # (about 60 us a layer of a decode step, Qwen3-30B-A3B's shape)
            assert w.stacked is not None
            out = w.stacked(x, picks, weights, q8, routes)
            return out if w.shared is None else _shared(backend, config, w, x, sizes, out)
    else:
        chosen, weights = route(xp, logits, config)  # [r, k], [r, k]
        picks = np.asarray(backend.to_numpy(chosen))
    long = np.repeat([s > MAX_KERNEL_ROWS for s in sizes], sizes)  # rows BLAS multiplies
    if q8 and compiled:
        long[:] = False  # the 8-bit kernels take any rows, one row as many
    if not long.any():
        out = _kernel_rows(backend, config, w, x, picks, weights, routes)
    elif long.all():
        out = _experts(backend, config, w, x, picks, weights, long=True)
    else:
        out = xp.empty(x.shape, dtype=xp.float32)  # [r, E]
        few = ~long
        out[few] = _kernel_rows(backend, config, w, x[few], picks[few], weights[few])
        out[long] = _experts(backend, config, w, x[long], picks[long], weights[long], long=True)
    return out if w.shared is None else _shared(backend, config, w, x, sizes, out)


def _shared(
    backend: Any, config: MoeConfig, w: MoeWeights, x: Any, sizes: Sequence[int], out: Any
) -> Any:
    """``out`` (the routed experts' sum ``[r, E]``) plus the shared expert of ``x`` times
    ``sigmoid(x @ shared_gate)``."""
    assert w.shared is not None
    shared = expert_mlp(backend, config, w.shared, x, sizes)  # [r, E]
    return out + _sigmoid(backend.xp, backend.linear(x, w.shared_gate, sizes)) * shared


def _compiled_experts(backend: Any, w: MoeWeights) -> bool:
    """Whether the chosen experts go through one compiled call
    (:class:`~meshnode.engine.cpu.experts.ExpertLayer`: the same bits as
    :func:`_experts` through the kernels): experts in GGUF blocks on the CPU."""
    return w.stacked is not None and bool(backend.cpu_blocks)


def _rule(config: MoeConfig) -> tuple[bool, bool]:
    """The routing rule as :func:`.cpu.experts.route` takes it: gpt-oss's top-k then
    softmax, and whether the k weights are divided by their sum."""
    return config.routing == "topk_softmax", config.norm_topk_prob


def _kernel_rows(
    backend: Any,
    config: MoeConfig,
    w: MoeWeights,
    x: Any,
    picks: np.ndarray,
    weights: Any,
    routes: experts.Routes | None = None,
) -> Any:
    """The routed experts' weighted sum for rows of short segments, each row through the
    kernels (one compiled call, or an expert at a time at most
    :data:`MAX_KERNEL_ROWS` rows a product): a row's bits are those it has alone.
    ``routes``: the rows' grouping, where the compiled routing made it for all of them."""
    if _compiled_experts(backend, w):
        assert w.stacked is not None
        return w.stacked(x, picks, weights, backend.weights_dtype == "q8", routes)
    return _experts(backend, config, w, x, picks, weights, long=False)


def _experts(
    backend: Any,
    config: MoeConfig,
    w: MoeWeights,
    x: Any,
    picks: Any,
    weights: Any,
    *,
    long: bool,
) -> Any:
    """The routed experts' weighted sum, an expert at a time through the backend: rows of
    long segments (``long``) through BLAS, at least ``MAX_KERNEL_ROWS + 1`` rows a product
    (zero rows added: fewer would take the kernels, or BLAS's small-matrix code), else
    through the kernels, at most ``MAX_KERNEL_ROWS`` rows a product."""
    xp = backend.xp
    out = xp.zeros(x.shape, dtype=xp.float32)  # [r, E]
    for e in np.unique(picks):  # ascending: each row adds its experts in expert order
        rows, slots = np.nonzero(picks == e)  # the rows that chose e, and in which slot
        expert = w.experts[int(e)]
        if long:
            y = _padded(backend, config, expert, x[rows])  # [r_e, E]
        else:
            step = MAX_KERNEL_ROWS
            parts = [x[rows[i : i + step]] for i in range(0, rows.size, step)]
            ys = [expert_mlp(backend, config, expert, part) for part in parts]
            y = ys[0] if len(ys) == 1 else xp.concatenate(ys)  # [r_e, E]
        out[rows] += y * weights[rows, slots][:, None]
    return out


def _padded(backend: Any, config: MoeConfig, expert: ExpertWeights, x: Any) -> Any:
    """``expert_mlp`` of ``x`` ``[r, E]`` as BLAS multiplies more than
    :data:`MAX_KERNEL_ROWS` rows, however few ``r`` is (zero rows added, then dropped)."""
    xp, r = backend.xp, x.shape[0]
    if r <= MAX_KERNEL_ROWS:
        zeros = xp.zeros((MAX_KERNEL_ROWS + 1 - r, x.shape[1]), dtype=xp.float32)
        x = xp.concatenate([x, zeros])
    return expert_mlp(backend, config, expert, x)[:r]


def _sigmoid(xp: Any, x: Any) -> Any:
    """``1 / (1 + e^-x)``, as torch computes it (clamped as SiLU is: finite in float32)."""
    return xp.float32(1.0) / (xp.float32(1.0) + xp.exp(-xp.maximum(x, ops.SILU_CLAMP)))
