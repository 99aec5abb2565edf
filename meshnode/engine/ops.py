"""The decoder's array operations, written once through ``xp`` (NumPy or CuPy).

These are the engine's CPU math (``model.Stage`` calls them) and, at the same time, the
references the CUDA kernels in :mod:`meshnode.engine.cuda` are tested against: a kernel
is correct when it matches the function of the same name here within the tolerance its
test states. Keep them the plain expressions they are: the NumPy path's golden parity is
exact, so changing an expression here changes every logit.

Shapes: S rows, E hidden size, H query heads, Hkv key/value heads, G = H / Hkv, D head
dim, T positions in the cache (cached + new), I intermediate size, r query rows.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "add_rms_norm",
    "attention",
    "clamped_swiglu_mul",
    "gelu_tanh_mul",
    "rms_norm",
    "rope_cos_sin",
    "rotate_half",
    "silu_mul",
    "softmax",
]

# SiLU's e^-x is evaluated at max(x, -80) so it stays finite in float32 (silu(-80) is
# -1e-33 either way); the CUDA kernel applies the same clamp.
SILU_CLAMP = -80.0


def rms_norm(xp: Any, x: Any, weight: Any, eps: float) -> Any:
    """RMSNorm over the last axis: ``weight * x / sqrt(mean(x^2) + eps)``."""
    var = xp.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / xp.sqrt(var + xp.float32(eps)))


def add_rms_norm(xp: Any, x: Any, h: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """The residual add and the next norm: ``(x + h, rms_norm(x + h))``."""
    x = x + h
    return x, rms_norm(xp, x, weight, eps)


def rope_cos_sin(xp: Any, inv_freq: Any, start: int, n: int) -> tuple[Any, Any]:
    """cos and sin ``[S, D]`` for positions ``start .. start + n - 1`` (``inv_freq`` ``[D/2]``)."""
    pos = xp.arange(start, start + n, dtype=xp.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [S, D/2]
    emb = xp.concatenate([freqs, freqs], axis=-1)  # [S, D]
    return xp.cos(emb), xp.sin(emb)


def rotate_half(xp: Any, x: Any, cos: Any, sin: Any) -> Any:
    """RoPE, "rotate half" layout: pairs are (i, i + D/2). ``x`` is ``[heads, S, D]``."""
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def silu_mul(xp: Any, gate_up: Any) -> Any:
    """SwiGLU's activation: ``silu(gate) * up`` for the fused ``[r, 2 I]`` input -> ``[r, I]``.

    SiLU as torch computes it, ``x / (1 + e^-x)``.
    """
    i = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :i], gate_up[:, i:]
    silu = gate / (1.0 + xp.exp(-xp.maximum(gate, SILU_CLAMP)))
    return silu * up


# sqrt(2 / pi), the constant of GELU's tanh approximation (torch's approximate="tanh").
GELU_TANH_C = 0.7978845608028654


def gelu_tanh_mul(xp: Any, gate_up: Any) -> Any:
    """GeGLU's activation (Gemma): ``gelu_tanh(gate) * up`` for ``[r, 2 I]`` -> ``[r, I]``.

    ``gelu_tanh(x) = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))``, as torch's
    ``gelu(approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``).
    """
    i = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :i], gate_up[:, i:]
    inner = xp.float32(GELU_TANH_C) * (gate + xp.float32(0.044715) * (gate * gate * gate))
    return xp.float32(0.5) * gate * (xp.float32(1.0) + xp.tanh(inner)) * up


def clamped_swiglu_mul(xp: Any, gate_up: Any, alpha: float, limit: float) -> Any:
    """gpt-oss's expert activation for ``[r, 2 I]`` (gate then up) -> ``[r, I]``:
    ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha g)`` (transformers' ``GptOssExperts._apply_gate``;
    the sigmoid as torch's, ``1 / (1 + e^-x)``)."""
    i = gate_up.shape[-1] // 2
    lim = xp.float32(limit)
    gate = xp.minimum(gate_up[:, :i], lim)
    up = xp.clip(gate_up[:, i:], -lim, lim)
    z = gate * xp.float32(alpha)
    glu = gate * (xp.float32(1.0) / (xp.float32(1.0) + xp.exp(-xp.maximum(z, SILU_CLAMP))))
    return (up + xp.float32(1.0)) * glu


def softmax(xp: Any, x: Any) -> Any:
    """Softmax over the last axis (``-inf`` entries get probability 0)."""
    e = xp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(
    xp: Any,
    q: Any,
    keys: Any,
    values: Any,
    scale: float,
    window: int | None = None,
    sinks: Any | None = None,
) -> Any:
    """Causal grouped-query attention of the newest ``r`` positions over ``T`` cached ones.

    ``q`` is ``[H, r, D]`` (RoPE applied), ``keys``/``values`` are ``[Hkv, T, D]`` (the
    cache up to and including the new positions). Query row i sits at position
    ``p = T - r + i`` and sees keys ``0 .. p``; with a sliding ``window`` only the last
    ``window`` of them, ``p - window < key <= p`` (transformers' sliding-window mask,
    llama.cpp's ``n_swa``). Keys no row can see are not read. ``sinks`` ``[H]`` (gpt-oss)
    are one more logit per head in each row's softmax, with no value: they only take a
    share of the probability (transformers' ``eager_attention_forward`` for gpt-oss).
    Returns ``[H, r, D]``.
    """
    heads, rows, dim = q.shape
    kv_heads, t = keys.shape[0], keys.shape[1]
    lo = 0 if window is None else max(0, t - rows - window + 1)
    keys, values = keys[:, lo:], values[:, lo:]  # [Hkv, T', D]: what some row may see
    group = heads // kv_heads
    q = q.reshape(kv_heads, group * rows, dim)  # [Hkv, G r, D]
    scores = (q @ keys.transpose(0, 2, 1)) * scale  # [Hkv, G r, T']
    scores = scores.reshape(kv_heads, group, rows, t - lo)  # [Hkv, G, r, T']
    q_pos = xp.arange(t - rows, t)[:, None]
    k_pos = xp.arange(lo, t)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    scores = xp.where(visible, scores, -xp.inf)
    if sinks is not None:  # [Hkv, G, r, T' + 1]: the sink as the last column
        sink = xp.broadcast_to(sinks.reshape(kv_heads, group, 1, 1), (*scores.shape[:3], 1))
        scores = softmax(xp, xp.concatenate([scores, sink.astype(scores.dtype)], axis=-1))
        probs = xp.ascontiguousarray(scores[..., :-1]).reshape(kv_heads, group * rows, t - lo)
        return (probs @ values).reshape(heads, rows, dim)  # [H, r, D]
    probs = softmax(xp, scores).reshape(kv_heads, group * rows, t - lo)
    return (probs @ values).reshape(heads, rows, dim)  # [H, r, D]


def attention_by_rows(
    xp: Any,
    q: Any,
    keys: Any,
    values: Any,
    scale: float,
    window: int | None = None,
    sinks: Any | None = None,
) -> Any:
    """:func:`attention`, one query row at a time: row i is a one-row call over the keys
    it sees (``0 .. T - r + i``), its query copied alone (C order), so its bits are those
    of a decode step at its position whatever rows share the call (the batched call's
    products are BLAS's, whose sums take another order for another row count). Same
    shapes as :func:`attention`."""
    rows, t = q.shape[1], keys.shape[1]
    if rows == 1:
        return attention(xp, q, keys, values, scale, window, sinks)
    outs = []
    for i in range(rows):
        end = t - rows + i + 1  # row i sits at position end - 1
        one = xp.ascontiguousarray(q[:, i : i + 1])  # [H, 1, D]
        outs.append(attention(xp, one, keys[:, :end], values[:, :end], scale, window, sinks))
    return xp.concatenate(outs, axis=1)  # [H, r, D]
