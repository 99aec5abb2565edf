"""One attention layer of a real-size mixture-of-experts model, compiled against the path
it replaced: ``benchmarks/moe.py --attention`` (issue 31).

gpt-oss's layers (learned per-head sinks, every other one a sliding window of 128) and
Qwen3.5's gated attention layers used to run their decode and verify passes through the
NumPy reference one query row at a time (``engine.attention.reference_heads``, so that a
verify window's rows were its decode steps' bits); they now take the compiled kernel
(``engine.cpu.attention``: the sink as one more score in each row's softmax). For the
shape's attention (its config from the cached random GGUF, :mod:`.realsize_moe_gguf`: no
weights are read) over ``--context`` cached positions, with random sinks, each case is
one layer's call after the q/k/v projection, as ``model.Stage`` makes it:

- ``kernel``: ``KernelAttention`` as a stage runs it (the compiled call);
- ``by rows``: the same object through ``Attention.__call__``, a segment at a time into
  ``reference_heads`` (NumPy, a row at a time): the code before this change.

Medians of the thread CPU time (ms) of ``--repeats`` calls, the two taken in turn (robust
on a busy machine), one kernel thread. Cases: one decode row, eight sequences' decode
rows, one verify window of 8 rows; a sliding layer (0) and a full one (1).

Then Qwen3.5's gated attention (:data:`GATED`: Qwen3-Next-80B-A3B's and Qwen3.5-MoE's 16
heads / 2 KV heads of 256) for one sequence, its queries and keys rotated:
``rotated_attention`` (the kernel) against ``reference_heads`` after ``KVCache.write``
(before), a decode row and a window of 8.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from meshnode_packaging.sources import open_source

from benchmarks.realsize_moe_gguf import cached_gguf
from meshnode.engine import ModelConfig
from meshnode.engine.attention import (
    Attention,
    KernelAttention,
    Segment,
    reference_heads,
    rotated_attention,
)
from meshnode.engine.kv_cache import KVCache

# (name, sequences, rows each)
CASES = (("decode 1", 1, 1), ("decode 8", 8, 1), ("window 8", 1, 8))
# Qwen3.5's gated attention layers: query heads, KV heads, head dim
GATED = (16, 2, 256)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def profile(
    config: ModelConfig, layer: int, sequences: int, rows: int, context: int, repeats: int
) -> tuple[float, float]:
    """Median ms of the kernel's and the by-rows path's call of stage layer ``layer``."""
    rng = np.random.default_rng(rows * 10 + sequences)
    c = config
    attn = KernelAttention(np, c, 0, 2)
    segs = []
    for _ in range(sequences):
        cache = KVCache(np, 2, c.num_kv_heads, c.head_dim, context + rows)
        cache.k[:, :, :context] = rng.standard_normal(cache.k[:, :, :context].shape)
        cache.v[:, :, :context] = rng.standard_normal(cache.v[:, :, :context].shape)
        cache.length = context
        segs.append(Segment(context, rows, rows, cache))
    n = sequences * rows
    qkv = rng.standard_normal((n, c.q_size + 2 * c.kv_size)).astype(np.float32)
    sinks = rng.uniform(-1.0, 3.0, c.num_heads).astype(np.float32)
    plan = attn.prepare(segs)
    norms = (None, None)
    calls: dict[str, Callable[[], Any]] = {
        "kernel": lambda: attn(qkv, segs, plan, layer, norms, True, sinks),
        "by rows": lambda: Attention.__call__(attn, qkv, segs, plan, layer, norms, True, sinks),
    }
    got = [np.asarray(fn()) for fn in calls.values()]  # compiled and warm; the same result
    np.testing.assert_allclose(got[0], got[1], atol=1e-4)
    kernel, rows_ms = _medians(calls, repeats)
    return kernel, rows_ms


def run(shape: str, layers: int, context: int, repeats: int) -> None:
    """Print the table for ``shape`` (a :mod:`.realsize_moe_gguf` key)."""
    config = ModelConfig.from_hf(open_source(str(cached_gguf(shape, layers))).config)
    heads = f"{config.num_heads} heads / {config.num_kv_heads} KV heads of {config.head_dim}"
    print(f"{shape}: {heads}, {context} cached positions, median thread CPU ms per call")
    print(f"{'layer':<14} {'case':<9} {'kernel':>8} {'by rows':>8} {'speedup':>8}")
    for layer in (0, 1):
        window = config.window(layer)
        kind = f"{layer} (window {window})" if window else f"{layer} (full)"
        for name, sequences, rows in CASES:
            kernel, by_rows = profile(config, layer, sequences, rows, context, repeats)
            cells = f"{kernel:>8.3f} {by_rows:>8.3f} {by_rows / kernel:>7.1f}x"
            print(f"{kind:<14} {name:<9} {cells}", flush=True)


def gated(context: int, repeats: int) -> None:
    """Print the gated attention's table (:data:`GATED`, one sequence)."""
    heads, kv_heads, dim = GATED
    print(f"gated attention: {heads} heads / {kv_heads} KV heads of {dim}, {context} cached")
    print(f"{'case':<9} {'kernel':>8} {'by rows':>8} {'speedup':>8}")
    for name, rows in (("decode 1", 1), ("window 8", 8)):
        kernel, old = _gated_case(context, rows, repeats)
        print(f"{name:<9} {kernel:>8.3f} {old:>8.3f} {old / kernel:>7.1f}x", flush=True)


def _gated_case(context: int, rows: int, repeats: int) -> list[float]:
    """Median ms of ``rows`` rows' gated attention through the kernel and by rows."""
    heads, kv_heads, dim = GATED
    rng = np.random.default_rng(rows)
    cache = KVCache(np, 1, kv_heads, dim, context + rows)
    cache.k[0, :, :context] = rng.standard_normal((kv_heads, context, dim))
    cache.v[0, :, :context] = rng.standard_normal((kv_heads, context, dim))
    qkv = rng.standard_normal((rows, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    q = qkv[:, : heads * dim].reshape(rows, heads, dim).transpose(1, 0, 2)  # [H, r, D]
    kv = qkv[:, heads * dim :].reshape(rows, 2, kv_heads, dim).transpose(1, 2, 0, 3)
    scale = dim**-0.5

    def by_rows() -> Any:
        keys, values = cache.write(0, context, kv[0], kv[1])  # [Hkv, T, D]
        out = reference_heads(np, q, keys, values, scale)  # [H, r, D]
        return out.transpose(1, 0, 2).reshape(rows, heads * dim)

    calls: dict[str, Callable[[], Any]] = {
        "kernel": lambda: rotated_attention(qkv, context, rows, cache, 0, heads, scale),
        "by rows": by_rows,
    }
    got = [np.asarray(fn()) for fn in calls.values()]  # compiled and warm; the same result
    np.testing.assert_allclose(got[0], got[1], atol=1e-4)
    return _medians(calls, repeats)


def _medians(calls: dict[str, Callable[[], Any]], repeats: int) -> list[float]:
    """Median ms of each call over ``repeats`` rounds, the calls taken in turn."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(_timed(fn))
    return [1e3 * statistics.median(times[k]) for k in calls]
