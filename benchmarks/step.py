"""Where a batched decode step's time goes: one sequence's step against eight's (issue 16).

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/step.py [--context 128]
[--threads 1 2] [--rounds 15]``

One stage holds SmolLM2-135M with its weights in their GGUF blocks (the CPU default).
Eight sequences are prefilled to ``--context`` positions; then decode steps of 1 and of 8
of them (one row each, one ``Stage.forward_batch``) run in alternating rounds, at each
``--threads`` count in turn (kernel threads; BLAS stays at one), beside the weight
products alone (every matrix of the stage times 1 and 8 activation rows, as the step
multiplies them). For 1 and 8 rows it prints the median step, the products alone, and
the step cut by part (timers around the stage's own methods, in the same steps):
products (``Stage._linear``, the head's too), attention (RoPE, the KV cache, softmax:
``KernelAttention``), the MLP's activation (``Backend.glu``), the residual adds and norms,
and the rest (embedding, Python between the calls). The goal is an 8-sequence step of at
most 2x a one-sequence step (8 streams >= 4x one stream's tokens/s): whatever is not
products is what a batch adds beyond the products' own 8-row cost.

The machine is shared: ``uptime`` is printed first and last; compare ratios. On a busy
machine ``--clock thread`` times with this thread's CPU time instead of the wall clock
(meaningful at ``--threads 1`` only: the pool's other threads are not counted).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode.engine import ops
from meshnode.engine.backend import cpu_backend, limit_cpu_threads
from meshnode.engine.cpu import set_kernel_threads
from meshnode.engine.loader import load_model
from meshnode.engine.model import BatchRow, Stage
from tests.conftest import smollm2_gguf_path

PARTS = ("products", "attention", "activation", "add+norm")
CLOCK = time.perf_counter  # or time.thread_time (--clock thread)


class Parts:
    """Time spent in each part of the stage's forward (wrappers set on the instance)."""

    def __init__(self, stage: Stage) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self._wrap(stage, "_linear", "products")
        self._wrap(stage, "_rms_norm", "add+norm")
        if hasattr(stage, "_add_norm"):  # (a tree before it: the adds count as the rest)
            self._wrap(stage, "_add_norm", "add+norm")
        attention = stage._attention_of
        spent = self.spent

        class Timed:
            def prepare(self, segs: Any) -> Any:
                began = CLOCK()
                plan = attention.prepare(segs)
                spent["attention"] += CLOCK() - began
                return plan

            def __call__(self, *args: Any) -> Any:
                began = CLOCK()
                out = attention(*args)
                spent["attention"] += CLOCK() - began
                return out

        stage._attention_of = Timed()  # type: ignore[assignment]

        def reference(gate_up: Any, activation: str) -> Any:
            if activation == "gelu_tanh":
                return ops.gelu_tanh_mul(np, gate_up)
            return ops.silu_mul(np, gate_up)

        glu = getattr(stage.backend, "glu", reference)  # (a tree before Backend.glu)

        def mlp(w: Any, x: Any) -> Any:
            gate_up = stage._linear(x, w.w_gate_up)
            began = CLOCK()
            act = glu(gate_up, stage.config.arch.activation)
            spent["activation"] += CLOCK() - began
            return stage._linear(act, w.w_down)

        stage._mlp = mlp  # type: ignore[method-assign]

    def _wrap(self, stage: Stage, name: str, part: str) -> None:
        inner = getattr(stage, name)

        def timed(*args: Any) -> Any:
            began = CLOCK()
            out = inner(*args)
            self.spent[part] += CLOCK() - began
            return out

        setattr(stage, name, timed)


def products(stage: Stage, rows: int) -> Callable[[], None]:
    """Every weight product of a forward (the head's too) times ``rows`` activation rows."""
    w = stage.weights
    mats = [m for layer in w.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    mats.append(w.head_t if w.head_t is not None else w.embed_t)
    xs = [np.ones((rows, m.shape[0]), np.float32) for m in mats]

    def run() -> None:
        for x, m in zip(xs, mats, strict=True):
            stage.backend.linear(x, m)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    print("uptime:", uptime(), flush=True)
    limit = limit_cpu_threads(1)  # BLAS at one thread; kernel threads set per run below
    model = load_model(str(smollm2_gguf_path()), cpu_backend("native"))
    stage = model.stage
    rng = np.random.default_rng(0)
    caches = []
    for _ in range(8):
        cache = stage.new_cache(args.context + 8)
        stage.forward(rng.integers(0, 1000, args.context), 0, cache, out_rows=1)
        caches.append(cache)

    def step(n: int) -> None:
        rows = [BatchRow(np.array([7 + i]), args.context, caches[i], 1) for i in range(n)]
        stage.forward_batch(rows)

    parts = Parts(stage)
    runs: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    cut: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    alone = {n: products(stage, n) for n in (1, 8)}
    for threads in args.threads:  # warm-up: compiled code loaded, the pool started
        set_kernel_threads(threads)
        for n in (1, 8):
            step(n)
            alone[n]()
    for _ in range(args.rounds):
        for threads in args.threads:
            set_kernel_threads(threads)
            for n in (1, 8):
                parts.spent.clear()
                began = CLOCK()
                step(n)
                runs[threads, "step", n].append(CLOCK() - began)
                for part, seconds in parts.spent.items():
                    cut[threads, n][part] += seconds
                began = CLOCK()
                alone[n]()
                runs[threads, "products", n].append(CLOCK() - began)
    for threads in args.threads:
        ms = {
            (k, n): statistics.median(runs[threads, k, n]) * 1e3
            for k in ("step", "products")
            for n in (1, 8)
        }
        print(
            f"threads {threads}, context {args.context}, {args.clock} clock: "
            f"step 1 row {ms['step', 1]:.2f} ms, "
            f"8 rows {ms['step', 8]:.2f} ms ({ms['step', 8] / ms['step', 1]:.2f}x); products "
            f"alone 1 row {ms['products', 1]:.2f} ms, 8 rows {ms['products', 8]:.2f} ms "
            f"({ms['products', 8] / ms['products', 1]:.2f}x)",
            flush=True,
        )
        for n in (1, 8):
            total = sum(runs[threads, "step", n]) * 1e3 / args.rounds
            spent = {p: cut[threads, n][p] * 1e3 / args.rounds for p in PARTS}
            shares = ", ".join(f"{p} {spent[p]:.2f}" for p in PARTS)
            rest = total - sum(spent.values())
            print(f"  {n} rows, mean step {total:.2f} ms: {shares}, rest {rest:.2f} ms")
    print("uptime:", uptime(), "threads handle:", type(limit).__name__)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
