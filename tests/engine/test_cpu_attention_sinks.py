"""The compiled attention kernel's two MoE-family variants (issue 31): gpt-oss's learned
per-head sinks (one more logit in each query's softmax, with no value) and Qwen3.5's
gated attention, whose queries and keys come normed and rotated
(``engine.attention.rotated_attention``: no QK-norm or RoPE in the kernel).

Against the NumPy reference (``engine.ops.attention``) within the kernel suite's
tolerance; exact where the contract is exact: a verify window's rows are the bits of the
same rows decoded one at a time, on one thread or shared with the kernel threads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshnode.engine import ops
from meshnode.engine.attention import KERNEL_MAX_ROWS, rotated_attention
from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.pool import CoreGauge, KernelPool
from meshnode.engine.kv_cache import KVCache
from tests.engine.test_cpu_attention import (
    ATOL,
    CONTEXT,
    KV,
    KV_IDS,
    LAYERS,
    SHAPES,
    Shape,
    Twin,
    _atol,
    _config,
    _norms,
    _qkv,
    _window_rows,
)

# gpt-oss's attention: 64 heads of 64 over 8 KV heads, every other layer a sliding
# window of 128; here its grouping (8) and head size, a narrow window.
GPT_OSS = Shape(16, 2, 64, False, 6)
SINK_SHAPES = [GPT_OSS, SHAPES[0], SHAPES[1]]


def _sinks(heads: int, rng: np.random.Generator) -> np.ndarray:
    """Sink logits of the scores' order (gpt-oss's are learned, about -1 .. 3), one large
    enough to take most of a row's weight."""
    sinks = rng.uniform(-1.0, 3.0, heads).astype(np.float32)
    sinks[0] = 8.0
    return sinks


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize("shape", SINK_SHAPES, ids=str)
def test_sinks_match_the_reference_in_decode_verify_and_prefill(shape: Shape, dtype: type) -> None:
    """Prefills (short through the kernel, long through the reference), then a batch of
    a decode row, a verify window and a new prefill, the last layer keeping some rows:
    the kernel's softmax with the sink term agrees with the reference's, and differs
    from attention without sinks (the term is not dropped)."""
    c = _config(shape)
    rng = np.random.default_rng(41)
    norms, sinks = _norms(c, shape.qk_norm, rng), _sinks(c.num_heads, rng)
    twin, plain = Twin(c, 3, dtype), Twin(c, 3, dtype)
    lengths = [12, KERNEL_MAX_ROWS + 9, 3]
    qkvs = [_qkv(c, n, rng) for n in lengths]
    got, want = twin.run([(i, 0, n) for i, n in enumerate(lengths)], qkvs, norms, sinks=sinks)
    np.testing.assert_allclose(got, want, atol=_atol(dtype))
    plain.run([(i, 0, n) for i, n in enumerate(lengths)], qkvs, norms)
    qkvs = [_qkv(c, 1, rng), _qkv(c, 5, rng), _qkv(c, 14, rng)]
    parts = [(0, 12, 1), (1, KERNEL_MAX_ROWS + 9, 2), (2, 3, 9)]
    got, want = twin.run(parts, qkvs, norms, last=True, sinks=sinks)
    np.testing.assert_allclose(got, want, atol=_atol(dtype))
    without = plain.run(parts, qkvs, norms, last=True)[0]
    assert np.abs(got - without).max() > 100 * _atol(dtype)
    twin.check_caches()


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize(("prompt", "rows", "kept"), [(3, 5, 5), (40, 16, 16), (150, 16, 3)])
def test_a_windows_rows_with_sinks_are_the_bits_of_one_row_at_a_time(
    prompt: int, rows: int, kept: int, dtype: type
) -> None:
    """gpt-oss's verify window (grouped queries, a sliding window narrower than the rows)
    gives the bits of its rows decoded one forward at a time."""
    c = _config(GPT_OSS)
    rng = np.random.default_rng(43)
    norms, sinks = _norms(c, False, rng), _sinks(c.num_heads, rng)
    first, window = _qkv(c, prompt, rng), _qkv(c, rows, rng)
    together = _window_rows(c, norms, first, window, kept, True, dtype, sinks)
    alone = _window_rows(c, norms, first, window, kept, False, dtype, sinks)
    assert together.shape == (kept, c.q_size)
    np.testing.assert_array_equal(together, alone)


def _pool_of_four(monkeypatch: pytest.MonkeyPatch) -> KernelPool:
    pool = KernelPool(CoreGauge(Path("/nonexistent/stat"), cpus=set(range(4))))  # all free
    monkeypatch.setattr(matrix, "_pool", lambda: pool)
    return pool


def test_sinks_shared_with_the_kernel_threads_are_bit_identical_to_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight sequences (decode rows, windows of 8 and 16) over ~200 positions on 1, 2 and
    4 threads: the same outputs bit for bit, and the pool took the calls."""
    c = _config(GPT_OSS)
    rng = np.random.default_rng(47)
    norms, sinks = _norms(c, False, rng), _sinks(c.num_heads, rng)
    prompts = [_qkv(c, 190 + 3 * i, rng) for i in range(8)]
    sizes = [{2: 8, 5: KERNEL_MAX_ROWS}.get(i, 1) for i in range(8)]
    steps = [_qkv(c, n, rng) for n in sizes]
    pool = _pool_of_four(monkeypatch)
    outs = []
    for threads in (1, 2, 4):
        monkeypatch.setattr(matrix, "_threads", threads)
        twin = Twin(c, 8, np.float32)
        twin.run([(i, 0, len(p)) for i, p in enumerate(prompts)], prompts, norms, sinks=sinks)
        parts = [(i, len(p), n) for i, (p, n) in enumerate(zip(prompts, sizes, strict=True))]
        before = pool.posted
        outs.append(twin.run(parts, steps, norms, last=True, sinks=sinks)[0])
        assert (pool.posted > before) == (threads > 1)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


# Qwen3.5's full-attention layers: 16 heads of 256 over 2 KV heads (here narrower)
GATED = Shape(8, 2, 32, False, None)


def _rotated(n: int, rng: np.random.Generator) -> np.ndarray:
    """``[S, (H + 2 Hkv) D]``: queries and keys as the caller hands them, rotated."""
    return _qkv(_config(GATED), n, rng)


def _split(qkv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q ``[H, S, D]``, k and v ``[Hkv, S, D]`` of a rotated ``qkv``."""
    s, d = GATED, GATED.head_dim
    q = qkv[:, : s.heads * d].reshape(len(qkv), s.heads, d).transpose(1, 0, 2)
    kv = qkv[:, s.heads * d :].reshape(len(qkv), 2, s.kv_heads, d)
    return q, kv[:, 0].transpose(1, 0, 2), kv[:, 1].transpose(1, 0, 2)


def _cache() -> KVCache:
    return KVCache(np, LAYERS, GATED.kv_heads, GATED.head_dim, CONTEXT)


def test_rotated_attention_matches_the_reference_and_fills_the_cache() -> None:
    """A prompt of 12 rows, a window of 5 keeping 3 and a decode row through the kernel
    at layer 1: the reference's attention over the same keys, which the cache holds as
    given (no norm, no rotation)."""
    rng = np.random.default_rng(53)
    cache, start = _cache(), 0
    keys = np.zeros((GATED.kv_heads, 0, GATED.head_dim), np.float32)
    values = keys
    for n, rows in [(12, 12), (5, 3), (1, 1)]:
        qkv = _rotated(n, rng)
        got = rotated_attention(qkv, start, rows, cache, 1, GATED.heads, 0.125)
        q, k, v = _split(qkv)
        keys, values = np.concatenate([keys, k], 1), np.concatenate([values, v], 1)
        want = ops.attention(np, q[:, n - rows :], keys, values, 0.125)  # [H, r, D]
        assert got.shape == (rows, GATED.heads * GATED.head_dim)
        np.testing.assert_allclose(got, want.transpose(1, 0, 2).reshape(rows, -1), atol=ATOL)
        start += n
        cache.length = start
    np.testing.assert_array_equal(cache.k[1, :, :start], keys)
    np.testing.assert_array_equal(cache.v[1, :, :start], values)
    assert not cache.k[0].any()  # the other layer untouched


@pytest.mark.parametrize("threads", [1, 2])
def test_rotated_attentions_window_is_its_decode_steps_bits(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16-row window after 200 positions, at once and a row at a time, on one thread
    and shared with the kernel threads: the same bits."""
    _pool_of_four(monkeypatch)
    monkeypatch.setattr(matrix, "_threads", threads)
    rng = np.random.default_rng(59)
    prompt, window = _rotated(200, rng), _rotated(KERNEL_MAX_ROWS, rng)
    runs = []
    for at_once in (True, False):
        cache = _cache()
        cache.k[0, :, :200], cache.v[0, :, :200] = _split(prompt)[1:]
        if at_once:
            runs.append(rotated_attention(window, 200, len(window), cache, 0, GATED.heads, 0.2))
            continue
        rows = [
            rotated_attention(window[i : i + 1], 200 + i, 1, cache, 0, GATED.heads, 0.2)
            for i in range(len(window))
        ]
        runs.append(np.concatenate(rows))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_rotated_attention_refuses_a_full_cache_before_writing() -> None:
    cache = KVCache(np, LAYERS, GATED.kv_heads, GATED.head_dim, 8)
    with pytest.raises(ValueError, match="KV cache full"):
        rotated_attention(_rotated(3, np.random.default_rng(1)), 6, 1, cache, 0, GATED.heads, 0.1)
    assert not cache.k.any()
