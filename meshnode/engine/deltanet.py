"""Gated DeltaNet and gated attention math (Qwen3-Next / Qwen3.5 hybrids), through ``xp``.

A hybrid decoder interleaves linear-attention layers (Gated DeltaNet, arXiv 2412.06464)
with gated full-attention layers. This module is the pure array math of both token mixers;
``meshnode.engine.hybrid`` wires them into a stage. Conventions follow transformers'
``modeling_qwen3_5.py`` (the reference that made ``tests/golden/tiny/qwen35-hybrid-tiny``):

- **Conv**: a depthwise causal conv (kernel K = 4, no bias) over the concatenated
  ``[q; k; v]`` projection, then SiLU. Its rolling state is the last ``K - 1`` inputs.
- **Gated delta rule**, per value head h, with state ``M`` ``[Dk, Dv]``:
  ``M <- exp(g) M``; ``M <- M + k (beta (v - k^T M))^T``; ``o = q^T M``, where q and k are
  L2-normalized (``x / sqrt(sum x^2 + 1e-6)``), q is scaled by ``Dk^-1/2``,
  ``beta = sigmoid(b)`` and ``g = -exp(A_log) softplus(a + dt_bias)``. Query/key head j
  serves the value heads ``j r .. j r + r - 1`` (``r = Hv / Hk``, transformers'
  ``repeat_interleave``).
- **Gated RMSNorm** on each head's output: ``weight * rmsnorm(o) * silu(z)``.
- **Gated attention**: ``q_proj`` yields ``[query; gate]`` per head; QK-norm; RoPE on the
  first ``rotary_dim`` dims only (partial rotary); the output is multiplied by
  ``sigmoid(gate)`` before ``o_proj``.

The recurrence runs one row at a time for every row (prefill, decode and verify alike), so
a chunk of prefill and a row of decode follow the same float32 path, and the state after
any row is at hand for the snapshot ring.

Shapes: S rows, C conv channels (``2 Hk Dk + Hv Dv``), K kernel, Hk/Hv key/value heads,
Dk/Dv their head dims, H attention heads, D attention head dim, R rotary dims.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "L2NORM_EPS",
    "causal_conv",
    "decay_and_beta",
    "gated_delta_rule",
    "gated_rms_norm",
    "l2_normalize",
    "partial_rotate_half",
    "sigmoid",
    "softplus",
]

#: The epsilon of the q/k L2 norm inside the delta rule (transformers' ``l2norm`` and the
#: FLA kernels both use 1e-6, independent of the model's RMSNorm epsilon).
L2NORM_EPS = 1e-6
#: torch's softplus switches to the identity above this input (``threshold=20``): there
#: ``log1p(e^x)`` equals x in float32 anyway, and e^x would overflow further up.
SOFTPLUS_THRESHOLD = 20.0
#: e^-x is evaluated at max(x, -80) so it stays finite in float32 (as ``ops.SILU_CLAMP``).
EXP_CLAMP = -80.0


def sigmoid(xp: Any, x: Any) -> Any:
    """``1 / (1 + e^-x)``, finite for very negative x."""
    return 1.0 / (1.0 + xp.exp(-xp.maximum(x, EXP_CLAMP)))


def softplus(xp: Any, x: Any) -> Any:
    """``log(1 + e^x)``, the identity above :data:`SOFTPLUS_THRESHOLD` (as torch)."""
    safe = xp.minimum(x, SOFTPLUS_THRESHOLD)
    return xp.where(x > SOFTPLUS_THRESHOLD, x, xp.log1p(xp.exp(safe)))


def _silu(xp: Any, x: Any) -> Any:
    return x * sigmoid(xp, x)


def l2_normalize(xp: Any, x: Any, eps: float = L2NORM_EPS) -> Any:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis."""
    return x * (1.0 / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + xp.float32(eps)))


def causal_conv(xp: Any, window: Any, weight: Any) -> Any:
    """Depthwise causal conv plus SiLU over ``window`` ``[K-1+S, C]`` -> ``[S, C]``.

    ``window`` is the rolling state (the previous ``K - 1`` inputs, zeros at the start)
    followed by the S new inputs; the new state is its last ``K - 1`` rows. ``weight`` is
    ``[K, C]``: tap j multiplies the input ``K - 1 - j`` rows before the output's row.
    """
    taps = weight.shape[0]
    rows = window.shape[0] - taps + 1
    out = window[0:rows] * weight[0]
    for j in range(1, taps):
        out = out + window[j : j + rows] * weight[j]
    return _silu(xp, out)


def decay_and_beta(xp: Any, a: Any, b: Any, neg_a: Any, dt_bias: Any) -> tuple[Any, Any]:
    """The per-head log-decay ``g`` and write strength ``beta``, both ``[S, Hv]``.

    ``g = -exp(A_log) * softplus(a + dt_bias)`` (always <= 0, so the state decays) and
    ``beta = sigmoid(b)`` in (0, 1); ``neg_a`` is ``-exp(A_log)``, computed at load (a
    GGUF stores it so).
    """
    g = neg_a * softplus(xp, a + dt_bias)
    return g, sigmoid(xp, b)


def gated_delta_rule(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    state: Any,
    *,
    keep_from: int | None = None,
) -> tuple[Any, Any, list[Any]]:
    """Run the gated delta rule over S rows from ``state`` ``[Hv, Dk, Dv]``.

    ``q``, ``k`` are ``[S, Hk, Dk]`` (not yet normalized), ``v`` ``[S, Hv, Dv]``, ``g`` and
    ``beta`` ``[S, Hv]``. Returns the outputs ``[S, Hv, Dv]``, the state after the last row
    (a new array; ``state`` is not modified) and copies of the state after each row from
    ``keep_from`` on (none when None): the snapshot ring's slots.
    """
    rows, k_heads, dk = k.shape
    group = v.shape[1] // k_heads
    q = l2_normalize(xp, q) * xp.float32(dk**-0.5)
    k = l2_normalize(xp, k)
    if group > 1:  # key head j serves value heads j*group .. j*group + group - 1
        q = xp.repeat(q, group, axis=1)  # [S, Hv, Dk]
        k = xp.repeat(k, group, axis=1)
    decay = xp.exp(g)  # [S, Hv]
    out = xp.empty_like(v)
    kept: list[Any] = []
    for t in range(rows):
        state = state * decay[t][:, None, None]  # [Hv, Dk, Dv]
        kv_mem = (state * k[t][:, :, None]).sum(axis=1)  # [Hv, Dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(axis=1)
        if keep_from is not None and t >= keep_from:
            kept.append(state)  # each row's state is a fresh array: no copy needed
    return out, state, kept


def gated_rms_norm(xp: Any, x: Any, gate: Any, weight: Any, eps: float) -> Any:
    """``weight * rmsnorm(x) * silu(gate)`` over the last axis (the norm comes first)."""
    var = xp.mean(x * x, axis=-1, keepdims=True)
    normed = weight * (x * (1.0 / xp.sqrt(var + xp.float32(eps))))
    return normed * _silu(xp, gate)


def partial_rotate_half(xp: Any, x: Any, cos: Any, sin: Any) -> Any:
    """RoPE on the first R dims of ``x`` ``[heads, S, D]`` ("rotate half" over those R).

    ``cos``/``sin`` are ``[S, R]``; dims ``R ..`` pass through unchanged.
    """
    rot = cos.shape[-1]
    head, tail = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = xp.concatenate([-head[..., half:], head[..., :half]], axis=-1)
    return xp.concatenate([head * cos + rotated * sin, tail], axis=-1)
