"""Engine benchmark: prefill, decode, weight-bandwidth roofline, k-token forward cost.

Run: ``.venv/bin/python benchmarks/engine.py [--model REF] [--threads N ...]``

Prints one table per section. Every figure that is compared with another is measured in
the same run, interleaved, and reported as a ratio: these machines are shared and noisy.

- memory bandwidth: a large float32 array copy, (bytes read + bytes written) / s;
- decode: tokens/s of one-token forwards, and the weight bytes each reads
  (every layer + final norm + head) × tokens/s as a fraction of that bandwidth;
- prefill: tokens/s for a ~400-token prompt, and what ``out_rows=1`` saves there;
- k-token forward (verify): cost of one forward of k tokens relative to one token, for
  each weight layout and BLAS thread count.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from meshnode.engine.backend import cpu_backend
from meshnode.engine.loader import load_model
from meshnode.engine.model import Stage
from meshnode.engine.weights import StageWeights

PROMPT = (
    "Write a detailed history of the printing press, from the first movable type in East "
    "Asia to Gutenberg's workshop in Mainz, and explain how it changed science, religion, "
    "trade and politics across Europe over the following three centuries. "
)


def best_of(fn: Callable[[], object], reps: int) -> float:
    """Smallest wall time of ``reps`` calls, in seconds (the least disturbed run)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def memory_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes/s of a large copy, counting the read and the write."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / best_of(lambda: np.copyto(dst, src), reps)


def _relayout(weights: StageWeights, layout: str) -> StageWeights:
    """The same weights as ``[out, in]`` C-contiguous (used through a transposed view)."""
    if layout == "in_out":
        return weights

    def t(a: Any) -> Any:
        return np.ascontiguousarray(a.T).T

    layers = [
        dataclasses.replace(
            w, wqkv=t(w.wqkv), wo=t(w.wo), w_gate_up=t(w.w_gate_up), w_down=t(w.w_down)
        )
        for w in weights.layers
    ]
    return dataclasses.replace(weights, layers=layers, embed_t=t(weights.embed_t))


def decode_rate(stage: Stage, context: list[int], steps: int) -> float:
    """Tokens/s of ``steps`` one-token forwards after ``context``."""
    cache = stage.new_cache(len(context) + steps + 1)
    stage.forward(np.array(context), 0, cache, out_rows=1)
    t = time.perf_counter()
    for i in range(steps):
        stage.forward(np.array([context[-1]]), len(context) + i, cache)
    return steps / (time.perf_counter() - t)


def k_costs(stage: Stage, context: list[int], ks: list[int], reps: int) -> dict[int, float]:
    """Seconds of one k-token forward (all k rows of logits), k in ``ks`` and k = 1."""
    cache = stage.new_cache(len(context) + max(ks) + 1)
    stage.forward(np.array(context), 0, cache, out_rows=1)

    def verify(k: int) -> Callable[[], object]:
        window = np.array(context[:k])
        return lambda: stage.forward(window, len(context), cache)

    return {k: best_of(verify(k), reps) for k in [1, *ks]}


def prefill_time(stage: Stage, ids: list[int], rows: int | None, reps: int) -> float:
    """Seconds of a prefill of ``ids`` returning the logits of the last ``rows`` rows."""
    cache = stage.new_cache(len(ids))
    return best_of(lambda: stage.forward(np.array(ids), 0, cache, out_rows=rows), reps)


def weight_bytes_per_token(weights: StageWeights) -> int:
    """Bytes a one-token forward reads: all layers, final norm, head (not the embedding
    row gather, which touches E of V columns)."""
    layers = sum(w.nbytes() for w in weights.layers)
    head = weights.head_t if weights.head_t is not None else weights.embed_t
    assert weights.norm is not None
    assert head is not None
    return layers + int(weights.norm.nbytes) + int(head.nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model reference (default alias)")
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    model = load_model(args.model, cpu_backend())
    stage = model.stage
    weights = stage.weights
    ids = model.tokenizer.encode(PROMPT * 12)[:400]
    context = ids[:128]
    print(
        f"model: {args.model or 'smollm2-135m'}; float32 weights in memory: "
        f"{weights.nbytes() / 2**20:.0f} MiB"
    )

    per_token = weight_bytes_per_token(weights)
    print("\n## decode (one token per forward, 128-token context)\n")
    print("| threads | tokens/s | weight GB/s | copy GB/s | fraction of roofline |")
    print("|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        with threadpool_limits(threads):
            bw = memory_bandwidth()
            rates = [decode_rate(stage, context, args.decode_steps) for _ in range(2)]
            rate = max(rates)
        print(
            f"| {threads} | {rate:.1f} | {per_token * rate / 1e9:.1f} | {bw / 1e9:.1f} "
            f"| {per_token * rate / bw:.0%} |"
        )

    print(f"\n## prefill ({len(ids)}-token prompt)\n")
    print("| threads | out_rows | ms | tokens/s | saving of out_rows=1 |")
    print("|---:|---|---:|---:|---:|")
    for threads in args.threads:
        with threadpool_limits(threads):
            times: dict[int | None, float] = {None: float("inf"), 1: float("inf")}
            for rows in (None, 1, None, 1):  # interleaved, best of each
                times[rows] = min(times[rows], prefill_time(stage, ids, rows, 1))
        for rows in (None, 1):
            saving = 1 - times[1] / times[None] if rows == 1 else 0.0
            print(
                f"| {threads} | {rows or 'all'} | {times[rows] * 1e3:.0f} "
                f"| {len(ids) / times[rows]:.0f} | {saving:.1%} |"
            )

    ks = [2, 4, 8, 16]
    print("\n## k-token forward cost relative to one token (128-token context, all k logits)\n")
    print("| layout | threads | 1-token ms | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|---:|---:|" + "---:|" * len(ks))
    layouts = {"in_out": stage}
    layouts["out_in"] = Stage(
        model.config,
        _relayout(weights, "out_in"),
        0,
        model.config.num_layers,
        embed=True,
        head=True,
    )
    for threads in args.threads:
        with threadpool_limits(threads):
            for name, s in layouts.items():
                runs = [k_costs(s, context, ks, args.reps) for _ in range(2)]
                cost = {k: min(r[k] for r in runs) for k in [1, *ks]}
                ratios = " | ".join(f"{cost[k] / cost[1]:.2f}x" for k in ks)
                print(f"| {name} | {threads} | {cost[1] * 1e3:.1f} | {ratios} |")


if __name__ == "__main__":
    main()
