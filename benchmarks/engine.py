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
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from meshnode.engine.backend import cpu_backend
from meshnode.engine.loader import load_model
from meshnode.engine.model import GEMV_MAX_ROWS, Stage
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


KS = [2, 4, 8, 16]


def decode_section(stage: Stage, context: list[int], threads: list[int], steps: int) -> None:
    """Decode tokens/s and the fraction of the copy-bandwidth roofline it reaches."""
    per_token = weight_bytes_per_token(stage.weights)
    print("\n## decode (one token per forward, 128-token context)\n")
    print("| threads | tokens/s | weight GB/s | copy GB/s | fraction of roofline |")
    print("|---:|---:|---:|---:|---:|")
    for n in threads:
        with threadpool_limits(n):
            bw = memory_bandwidth()
            rate = max(decode_rate(stage, context, steps) for _ in range(2))
        print(
            f"| {n} | {rate:.1f} | {per_token * rate / 1e9:.1f} | {bw / 1e9:.1f} "
            f"| {per_token * rate / bw:.0%} |"
        )


def prefill_section(stage: Stage, ids: list[int], threads: list[int]) -> None:
    """Prefill tokens/s with all rows' logits and with ``out_rows=1``."""
    print(f"\n## prefill ({len(ids)}-token prompt)\n")
    print("| threads | out_rows | ms | tokens/s | saving of out_rows=1 |")
    print("|---:|---|---:|---:|---:|")
    for n in threads:
        with threadpool_limits(n):
            times: dict[int | None, float] = {None: float("inf"), 1: float("inf")}
            for rows in (None, 1, None, 1):  # interleaved, best of each
                times[rows] = min(times[rows], prefill_time(stage, ids, rows, 1))
        for rows in (None, 1):
            saving = 1 - times[1] / times[None] if rows == 1 else 0.0
            print(
                f"| {n} | {rows or 'all'} | {times[rows] * 1e3:.0f} "
                f"| {len(ids) / times[rows]:.0f} | {saving:.1%} |"
            )


def k_rows(stage: Stage, context: list[int], threads: list[int], reps: int) -> list[str]:
    """Table rows (kernels, layout, threads, 1-token ms, k ratios) for this process's BLAS.

    Variants: weights ``[in, out]`` (the engine's layout) with the engine's row-by-row
    sgemv for up to ``GEMV_MAX_ROWS`` rows, the same with sgemm for every k, and weights
    ``[out, in]`` with sgemm for every k.
    """
    out_in = Stage(
        stage.config,
        _relayout(stage.weights, "out_in"),
        stage.start,
        stage.end,
        embed=True,
        head=True,
    )
    variants = [
        (f"[in,out], gemv up to {GEMV_MAX_ROWS} rows", stage, GEMV_MAX_ROWS),
        ("[in,out], gemm", stage, 1),
        ("[out,in], gemm", out_in, 1),
    ]
    coretype = os.environ.get("OPENBLAS_CORETYPE", "auto")
    rows = []
    for n in threads:
        with threadpool_limits(n):
            runs: dict[str, list[dict[int, float]]] = {name: [] for name, _, _ in variants}
            for _ in range(2):  # interleave the variants so load drifts hit all alike
                for name, s, gemv_rows in variants:
                    s.gemv_max_rows = gemv_rows
                    runs[name].append(k_costs(s, context, KS, reps))
            for name, _, _ in variants:
                cost = {k: min(r[k] for r in runs[name]) for k in [1, *KS]}
                ratios = " | ".join(f"{cost[k] / cost[1]:.2f}x" for k in KS)
                rows.append(f"| {coretype} | {name} | {n} | {cost[1] * 1e3:.1f} | {ratios} |")
    stage.gemv_max_rows = GEMV_MAX_ROWS
    return rows


def k_section(args: argparse.Namespace, stage: Stage, context: list[int]) -> None:
    """k-token forward cost; each OpenBLAS core type runs in a child process (the kernel
    set is chosen when the library loads), alternating so load drifts hit all alike."""
    print("\n## k-token forward cost relative to one token (128-token context, all k logits)\n")
    print(
        "| OpenBLAS kernels | layout | threads | 1-token ms | "
        + " | ".join(f"k={k}" for k in KS)
        + " |"
    )
    print("|---|---|---:|---:|" + "---:|" * len(KS))
    if not args.coretypes:
        print("\n".join(k_rows(stage, context, args.threads, args.reps)))
        return
    child = [sys.executable, __file__, "--k-only", "--reps", str(args.reps), "--threads"]
    child += [str(n) for n in args.threads]
    if args.model:
        child += ["--model", args.model]
    for coretype in args.coretypes:
        env = dict(os.environ, OPENBLAS_CORETYPE=coretype)
        done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        print(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model reference (default alias)")
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--coretypes",
        nargs="*",
        default=[],
        help="also measure k-token costs with these OPENBLAS_CORETYPE kernel sets "
        "(e.g. SkylakeX Haswell Zen), each in a child process",
    )
    parser.add_argument("--k-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    model = load_model(args.model, cpu_backend())
    stage = model.stage
    ids = model.tokenizer.encode(PROMPT * 12)[:400]
    context = ids[:128]
    if args.k_only:
        print("\n".join(k_rows(stage, context, args.threads, args.reps)))
        return
    mib = stage.weights.nbytes() / 2**20
    print(f"model: {args.model or 'smollm2-135m'}; float32 weights in memory: {mib:.0f} MiB")
    decode_section(stage, context, args.threads, args.decode_steps)
    prefill_section(stage, ids, args.threads)
    k_section(args, stage, context)


if __name__ == "__main__":
    main()
