"""The Gated DeltaNet math against a step-by-step NumPy reference written from the paper's
recurrence (float64, one head and one row at a time), and the conv's rolling state."""

from __future__ import annotations

import numpy as np
import pytest

from meshnode.engine import deltanet, ops


def _rng() -> np.random.Generator:
    return np.random.default_rng(7)


def _reference_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, m0: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T, o_t = S_t^T q_t,
    with q, k L2-normalized and q scaled by 1/sqrt(Dk); key head h // (Hv / Hk)."""
    rows, k_heads, dk = k.shape
    v_heads = v.shape[1]
    group = v_heads // k_heads
    out = np.zeros(v.shape)
    m = m0.astype(np.float64).copy()
    for h in range(v_heads):
        for t in range(rows):
            kt = k[t, h // group] / np.sqrt((k[t, h // group] ** 2).sum() + 1e-6)
            qt = q[t, h // group] / np.sqrt((q[t, h // group] ** 2).sum() + 1e-6) / np.sqrt(dk)
            decayed = np.exp(g[t, h]) * m[h]
            erase = np.eye(dk) - beta[t, h] * np.outer(kt, kt)
            m[h] = erase @ decayed + beta[t, h] * np.outer(kt, v[t, h])
            out[t, h] = m[h].T @ qt
    return out, m


def test_gated_delta_rule_matches_the_recurrence_written_out() -> None:
    rng = _rng()
    rows, hk, hv, dk, dv = 9, 2, 4, 8, 6
    q, k = rng.normal(size=(2, rows, hk, dk)).astype(np.float32)
    v = rng.normal(size=(rows, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, size=(rows, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(rows, hv)).astype(np.float32)
    m0 = rng.normal(size=(hv, dk, dv)).astype(np.float32)
    out, state, kept = deltanet.gated_delta_rule(np, q, k, v, g, beta, m0, keep_from=6)
    want_out, want_state = _reference_delta_rule(q, k, v, g, beta, m0)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=1e-5)
    assert len(kept) == 3
    np.testing.assert_array_equal(kept[-1], state)
    _, after_7, _ = deltanet.gated_delta_rule(np, q[:7], k[:7], v[:7], g[:7], beta[:7], m0)
    np.testing.assert_array_equal(kept[0], after_7)


def test_delta_rule_split_into_chunks_is_bit_identical() -> None:
    """Prefill in chunks, then decode row by row: the same state as one pass."""
    rng = _rng()
    rows, hk, hv, dk, dv = 12, 1, 2, 4, 4
    q, k = rng.normal(size=(2, rows, hk, dk)).astype(np.float32)
    v = rng.normal(size=(rows, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 1.0, size=(rows, hv)).astype(np.float32)
    beta = rng.uniform(size=(rows, hv)).astype(np.float32)
    m0 = np.zeros((hv, dk, dv), np.float32)
    whole, end, _ = deltanet.gated_delta_rule(np, q, k, v, g, beta, m0)
    m, parts = m0, []
    for lo, hi in ((0, 5), (5, 10), (10, 11), (11, 12)):
        part = slice(lo, hi)
        o, m, _ = deltanet.gated_delta_rule(np, q[part], k[part], v[part], g[part], beta[part], m)
        parts.append(o)
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(m, end)


def test_causal_conv_with_rolling_state_equals_the_whole_sequence() -> None:
    rng = _rng()
    taps, channels, rows = 4, 5, 10
    x = rng.normal(size=(rows, channels)).astype(np.float32)
    w = rng.normal(size=(taps, channels)).astype(np.float32)
    zero = np.zeros((taps - 1, channels), np.float32)
    whole = deltanet.causal_conv(np, np.concatenate([zero, x]), w)
    # written out: out[t] = silu(sum_j w[j] * x[t - (K - 1) + j]), x before 0 is zero
    padded = np.concatenate([zero, x]).astype(np.float64)
    pre = sum(w[j] * padded[j : j + rows] for j in range(taps))
    np.testing.assert_allclose(whole, pre / (1 + np.exp(-pre)), rtol=1e-5, atol=1e-6)
    window = np.concatenate([zero, x[:6]])
    first = deltanet.causal_conv(np, window, w)
    second = deltanet.causal_conv(np, np.concatenate([window[6:], x[6:]]), w)
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)


def test_gated_rms_norm_normalizes_first_then_gates() -> None:
    rng = _rng()
    x, z = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
    w = rng.normal(size=8).astype(np.float32)
    got = deltanet.gated_rms_norm(np, x, z, w, 1e-6)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, normed * z / (1 + np.exp(-z)), rtol=1e-5, atol=1e-6)


def test_decay_is_negative_and_beta_in_unit_interval() -> None:
    a = np.array([[-30.0, 0.0, 25.0]], np.float32)
    neg_a = np.full(3, -2.0, np.float32)  # -exp(A_log) with A_log = log 2
    g, beta = deltanet.decay_and_beta(np, a, a, neg_a, np.zeros(3, np.float32))
    assert np.all(g <= 0)
    assert np.all((beta >= 0) & (beta <= 1))
    want = -2 * np.log1p(np.exp(np.array([-30.0, 0.0, 25.0])))
    np.testing.assert_allclose(g[0], want, rtol=1e-6)


@pytest.mark.parametrize("rot", [4, 16])
def test_partial_rotary_rotates_only_the_first_dims(rot: int) -> None:
    rng = _rng()
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    inv = np.asarray([1.0 / 10000 ** (i / rot) for i in range(0, rot, 2)], np.float32)
    cos, sin = ops.rope_cos_sin(np, inv, 3, 5)
    got = deltanet.partial_rotate_half(np, x, cos, sin)
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])
    np.testing.assert_array_equal(got[..., :rot], ops.rotate_half(np, x[..., :rot], cos, sin))
