"""The NumPy references in ``meshnode.engine.ops``: right by independent formulas, and
exactly the engine's math (the stage forward rebuilt from them gives the same bits)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage, ops
from meshnode.engine.attention import Attention
from meshnode.engine.backend import CpuBackend
from meshnode.engine.cpu import dense_product as mm

RNG = np.random.default_rng(7)


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_rms_norm_matches_float64_formula() -> None:
    x, w = _f32(5, 96), _f32(96)
    want = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ops.rms_norm(np, x, w, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_add_rms_norm_is_the_add_then_the_norm_exactly() -> None:
    x, h, w = _f32(3, 64), _f32(3, 64), _f32(64)
    total, normed = ops.add_rms_norm(np, x, h, w, 1e-6)
    np.testing.assert_array_equal(total, x + h)
    np.testing.assert_array_equal(normed, ops.rms_norm(np, x + h, w, 1e-6))


def test_rotate_half_is_a_rotation_of_pairs_i_and_i_plus_half() -> None:
    inv_freq = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    x = _f32(3, 4, 16)  # [heads, S, D]
    cos, sin = ops.rope_cos_sin(np, inv_freq, 5, 4)
    got = ops.rotate_half(np, x, cos, sin)
    angle = np.arange(5, 9)[:, None] * inv_freq.astype(np.float64)[None, :]  # [S, D/2]
    z = (x[..., :8] + 1j * x[..., 8:]) * np.exp(1j * angle)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), atol=1e-5)


def test_silu_mul_matches_formula_and_stays_finite() -> None:
    gate_up = _f32(4, 64) * 4
    gate_up[0, 0] = -1e4  # e^-x would overflow without the clamp
    got = ops.silu_mul(np, gate_up)
    g, u = gate_up[:, :32].astype(np.float64), gate_up[:, 32:].astype(np.float64)
    np.testing.assert_allclose(got, g / (1 + np.exp(-np.maximum(g, -80))) * u, rtol=1e-5)
    assert np.isfinite(got).all()


def test_softmax_rows_sum_to_one_and_minus_inf_is_zero() -> None:
    x = _f32(3, 10)
    x[1, 4:] = -np.inf
    p = ops.softmax(np, x)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    assert (p[1, 4:] == 0).all()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows", "t"), [(4, 2, 1, 9), (6, 2, 3, 7), (2, 2, 4, 4)]
)
def test_attention_matches_a_loop_over_heads_and_rows(
    heads: int, kv_heads: int, rows: int, t: int
) -> None:
    d = 8
    q, keys, values = _f32(heads, rows, d), _f32(kv_heads, t, d), _f32(kv_heads, t, d)
    got = ops.attention(np, q, keys, values, d**-0.5)
    for h in range(heads):
        kv = h // (heads // kv_heads)  # grouped-query: consecutive heads share a K/V head
        for i in range(rows):
            seen = t - rows + i + 1  # row i sits at position t - rows + i
            s = keys[kv, :seen].astype(np.float64) @ q[h, i] * d**-0.5
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ values[kv, :seen]
            np.testing.assert_allclose(got[h, i], want, rtol=1e-5, atol=1e-6)


@dataclass(frozen=True)
class _ReferenceAttention(CpuBackend):
    """The float32 CPU backend with the NumPy reference's attention (:class:`Attention`)
    where the backend takes the compiled kernel (``KernelAttention``, tested against the
    reference in ``test_cpu_attention.py``)."""

    def attention(self, config: ModelConfig, start: int, end: int) -> Attention:
        return Attention(self.xp, config, start, end)


def test_stage_forward_is_the_references_composed(tiny_gguf: Callable[[str], Path]) -> None:
    """The references are the engine's own expressions: rebuilt from them, bit for bit
    (with float32 weights, the matrices the references multiply, through the float32
    backend's product, whose order is fixed by the segment's rows: ``dense_product``;
    the attention the reference's, :class:`Attention`, where the float32 backend's is the
    compiled kernel)."""
    source = open_source(tiny_gguf("Q8_0"))
    c = ModelConfig.from_hf(source.config)
    backend = _ReferenceAttention("float32")
    stage = Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=backend)
    ids = np.array([1, 60, 61, 62, 259, 70])
    got = stage.forward(ids, 0, stage.new_cache(16))

    w = stage.weights
    assert w.embed_t is not None
    assert w.norm is not None
    n = len(ids)
    inv_freq = np.asarray(c.rope_inv_freq(), dtype=np.float32)
    cos, sin = ops.rope_cos_sin(np, inv_freq, 0, n)
    x = w.embed_t[:, ids].T  # [S, E]
    for layer in w.layers:
        y = ops.rms_norm(np, x, layer.attn_norm, c.rms_norm_eps)
        qkv = mm(y, layer.wqkv)
        q = qkv[:, : c.q_size].reshape(n, c.num_heads, c.head_dim).transpose(1, 0, 2)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].reshape(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].reshape(n, c.num_kv_heads, c.head_dim)
        q = ops.rotate_half(np, q, cos, sin)
        k = ops.rotate_half(np, k.transpose(1, 0, 2), cos, sin)
        out = ops.attention(np, q, k, v.transpose(1, 0, 2), float(1.0 / np.sqrt(c.head_dim)))
        x = x + mm(out.transpose(1, 0, 2).reshape(n, c.q_size), layer.wo)
        y = ops.rms_norm(np, x, layer.ffn_norm, c.rms_norm_eps)
        x = x + mm(ops.silu_mul(np, mm(y, layer.w_gate_up)), layer.w_down)
    logits = mm(ops.rms_norm(np, x, w.norm, c.rms_norm_eps), w.embed_t)
    np.testing.assert_array_equal(got, logits)
