"""Where a forward's time goes at 1 and 8 rows: eight sequences' decode step against one
sequence's (issue 16), and a window of 8 new rows of one sequence against 1 (issue 13).

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/step.py [--context 128 512]
[--threads 1 2] [--rounds 15] [--dtype native|q8] [--kv-dtype auto|f32|f16 ...] [--window]
[--compare OLD.py]``

One stage holds SmolLM2-135M with its weights in their GGUF blocks (``--dtype``: the CPU
default ``native``, or ``q8``), its sequences' KV caches of each ``--kv-dtype`` (several:
each its own set of sequences, timed in the same rounds, with f16 / f32 ratios). Eight
sequences are prefilled to each ``--context``; then decode steps of 1 and of 8 of them
(one row each, one ``Stage.forward_batch``) run in alternating rounds, at each
``--threads`` count in turn (kernel threads; BLAS stays at one), beside the weight
products alone (every matrix of the stage times 1 and 8 activation rows, as the step
multiplies them). ``--window`` adds forwards of a window of 1 and 8 new
rows of one more sequence after the context (all rows' logits: what
``benchmarks/engine.py``'s k-row table and speculative verify windows run).

For each, it prints the median forward, and the forward cut by part (timers around the
stage's own methods, in the same forwards): products (``Backend.linear``, the head's too),
attention (RoPE, the KV cache, softmax: ``KernelAttention``, its ``prepare`` included), the
MLP's activation (``Backend.glu``), the residual adds and norms, and the rest (embedding,
Python between the calls). Goals: an 8-sequence step of at most 2x a one-sequence step
(8 streams >= 4x one stream's tokens/s) and an 8-row window of at most 1.5x a 1-row one.

``--compare OLD.py`` times another copy of ``meshnode/engine/cpu/attention.py`` beside the
tree's in the same rounds (``git show 529c38f:meshnode/engine/cpu/attention.py > /tmp/old.py``),
with the routing of that time (:func:`old_routing`): every line is printed for "new" and
"old", with old/new ratios of the attention. It also
prints the floor of the 8-sequence step's KV reads: a plain streaming read of as many
bytes of KV cache (all layers' keys and values of the 8 sequences) at each thread count.

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
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode.engine import attention as engine_attention
from meshnode.engine.backend import cpu_backend, limit_cpu_threads
from meshnode.engine.cpu import set_kernel_threads
from meshnode.engine.kv_cache import KV_DTYPES, resolve_kv_dtype
from meshnode.engine.loader import load_model
from meshnode.engine.model import BatchRow, Stage
from tests.conftest import smollm2_gguf_path

PARTS = ("products", "attention", "activation", "add+norm")
CLOCK = time.perf_counter  # or time.thread_time (--clock thread)
ROWS = (1, 8)
# Bytes read to push the KV out of the caches before a cold floor read (2x the L3 here).
EVICT = 512 * 2**20


class Parts:
    """Time spent in each part of the stage's forward (wrappers set on the instance)."""

    def __init__(self, stage: Stage) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self._wrap(stage, "_rms_norm", "add+norm")
        self._wrap(stage, "_add_norm", "add+norm")
        mixer: Any = stage._mixer  # the dense attention mixer: its attention and backend
        attention = mixer.attention
        spent = self.spent

        class Timed:
            def prepare(self, segs: Any) -> Any:
                began = CLOCK()
                plan = attention.prepare(segs)
                spent["attention"] += CLOCK() - began
                return plan

            def keep_rows(self, *args: Any) -> Any:
                return attention.keep_rows(*args)

            def __call__(self, *args: Any) -> Any:
                began = CLOCK()
                out = attention(*args)
                spent["attention"] += CLOCK() - began
                return out

        inner = stage.backend

        class TimedBackend:
            """The stage's backend, its products and activation timed."""

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def linear(self, x: Any, w: Any) -> Any:
                began = CLOCK()
                out = inner.linear(x, w)
                spent["products"] += CLOCK() - began
                return out

            def glu(self, gate_up: Any, activation: str) -> Any:
                began = CLOCK()
                out = inner.glu(gate_up, activation)
                spent["activation"] += CLOCK() - began
                return out

        mixer.attention = Timed()
        stage.backend = mixer.backend = TimedBackend()  # type: ignore[assignment]

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


def kernel_modules(compare: str | None) -> dict[str, ModuleType]:
    """The attention kernels to time: the tree's ("new"), and ``compare``'s ("old")."""
    modules = {"new": engine_attention._kernels()}
    if compare:
        # compiled afresh, not cached: numba's cache cannot reload a module made this way
        source = Path(compare).read_text().replace("cache=True", "cache=False")
        old = ModuleType("old_cpu_attention")
        old.__file__ = compare
        sys.modules[old.__name__] = old
        exec(compile(source, compare, "exec"), old.__dict__)
        modules["old"] = old
    return modules


NEW_ROUTING = engine_attention._for_kernel


def old_routing(rows: int, end: int) -> bool:
    """Which segments the kernel took before it shared a window's keys between its rows
    (main at 529c38f): up to 16 rows while rows x positions <= 1024, else BLAS."""
    return rows == 1 or (rows <= 16 and rows * end <= 1024)


def use_kernel(module: ModuleType) -> None:
    """Make ``KernelAttention`` call ``module``'s kernel, routed as that kernel was."""
    engine_attention._kernels = lambda: module  # type: ignore[assignment]
    old = module.__name__ == "old_cpu_attention"
    engine_attention._for_kernel = old_routing if old else NEW_ROUTING


def forwards(stage: Stage, context: int, window: bool, kv: str) -> dict[str, Callable[[], Any]]:
    """The timed forwards at ``context``: "batch N" (N sequences, one row each) and with
    ``window`` "window N" (N new rows of one sequence, all their logits), over caches of
    KV dtype ``kv``."""
    stage.kv_dtype = resolve_kv_dtype(kv, stage.backend.weights_dtype)
    rng = np.random.default_rng(0)
    caches = []
    for _ in range(9 if window else 8):
        cache = stage.new_cache(context + 9)
        stage.forward(rng.integers(0, 1000, context), 0, cache, out_rows=1)
        caches.append(cache)
    runs: dict[str, Callable[[], Any]] = {}
    for n in ROWS:
        rows = [BatchRow(np.array([7 + i]), context, caches[i], 1) for i in range(n)]
        runs[f"batch {n}"] = partial(stage.forward_batch, rows)
    if window:
        for n in ROWS:
            runs[f"window {n}"] = partial(stage.forward, np.arange(7, 7 + n), context, caches[8])
    return runs


def stream_floor(stage: Stage, context: int, threads: list[int], rounds: int) -> None:
    """Print the time of a plain read of the 8-sequence step's KV bytes (all layers' keys
    and values of 8 caches of ``context`` positions): what the step's attention cannot go
    under, at each thread count (threads: a share of the arrays each); warm (read again
    and again: from the L3 cache, where they fit) and cold (after reading EVICT bytes of
    other memory: from DRAM)."""
    from concurrent.futures import ThreadPoolExecutor

    from numba import njit

    from meshnode.engine.cpu.simd import wadd, wload, wsum, wzero

    @njit(nogil=True, cache=True)
    def read(a):  # type: ignore[no-untyped-def]
        acc = wzero()
        for i in range(0, a.shape[0], 16):
            acc = wadd(acc, wload(a, i))
        return wsum(acc)

    c = stage.config
    size = c.num_kv_heads * context * c.head_dim
    layers = stage.end - stage.start
    arrays = [np.ones(size, np.float32) for _ in range(2 * 8 * layers)]
    other = np.ones(EVICT // 4, np.float32)
    total = sum(a.nbytes for a in arrays)
    for n in threads:
        parts = [arrays[i::n] for i in range(n)]
        with ThreadPoolExecutor(n) as ex:
            for how in ("warm", "cold"):
                times = []
                for _ in range(rounds + 1):
                    if how == "cold":
                        read(other)
                    began = time.perf_counter()
                    list(ex.map(lambda p: [read(a) for a in p], parts))
                    times.append(time.perf_counter() - began)
                ms = statistics.median(times[1:]) * 1e3
                print(
                    f"  floor (wall clock), threads {n}, {how}: {total / 2**20:.1f} MiB of KV "
                    f"read in {ms:.2f} ms ({total / ms / 1e6:.1f} GB/s)",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, nargs="+", default=[128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    parser.add_argument("--dtype", choices=["native", "q8"], default="native")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, nargs="+", default=["auto"])
    parser.add_argument("--window", action="store_true")
    parser.add_argument("--compare", metavar="OLD.py")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    print("uptime:", uptime(), flush=True)
    limit = limit_cpu_threads(1)  # BLAS at one thread; kernel threads set per run below
    model = load_model(str(smollm2_gguf_path()), cpu_backend(args.dtype))
    modules = kernel_modules(args.compare)
    for context in args.context:
        measure(model.stage, context, args, modules)
        if args.compare:
            stream_floor(model.stage, context, args.threads, args.rounds)
    print("uptime:", uptime(), "threads handle:", type(limit).__name__)


Key = tuple[int, str, str]  # (threads, kernel and KV dtype, case)


def measure(stage: Stage, context: int, args: Any, modules: dict[str, ModuleType]) -> None:
    """Time the forwards at ``context`` with each kernel module, KV dtype and thread count
    in alternating rounds; print medians of the forwards and of their parts."""
    use_kernel(modules["new"])
    kvs = list(dict.fromkeys(args.kv_dtype))
    by_kv = {kv: forwards(stage, context, args.window, kv) for kv in kvs}
    runs = by_kv[kvs[0]]
    variants = {
        name if len(kvs) == 1 else f"{name} {kv}": (module, by_kv[kv])
        for name, module in modules.items()
        for kv in kvs
    }
    parts = Parts(stage)
    alone = {n: products(stage, n) for n in ROWS}
    # per forward: its time, then each part's, in ms
    times: dict[Key, list[dict[str, float]]] = defaultdict(list)
    for threads in args.threads:  # warm-up: compiled code loaded, the pool started
        set_kernel_threads(threads)
        for module, cases in variants.values():
            use_kernel(module)
            for run in cases.values():
                run()
        for n in ROWS:
            alone[n]()
    for _ in range(args.rounds):
        for threads in args.threads:
            set_kernel_threads(threads)
            for name, (module, cases) in variants.items():
                use_kernel(module)
                for case, run in cases.items():
                    parts.spent.clear()
                    began = CLOCK()
                    run()
                    spent = {"forward": CLOCK() - began, **parts.spent}
                    times[threads, name, case].append({p: t * 1e3 for p, t in spent.items()})
            for n in ROWS:
                began = CLOCK()
                alone[n]()
                times[threads, "", f"products {n}"].append({"forward": (CLOCK() - began) * 1e3})
    use_kernel(modules["new"])
    what = f"context {context}, {args.dtype}, KV {'/'.join(kvs)}, {args.clock} clock"
    for threads in args.threads:
        report(times, threads, what, list(runs))


def report(
    times: dict[Key, list[dict[str, float]]], threads: int, what: str, cases: list[str]
) -> None:
    """Print the medians of one thread count's forwards and parts, and their ratios."""

    def median(key: Key, part: str) -> float:
        return statistics.median(t.get(part, 0.0) for t in times[key])

    one, eight = (median((threads, "", f"products {n}"), "forward") for n in ROWS)
    print(
        f"threads {threads}, {what}: products alone 1 row {one:.2f} ms, "
        f"8 rows {eight:.2f} ms ({eight / one:.2f}x); medians of the forwards and parts:",
        flush=True,
    )
    names = sorted({key[1] for key in times if key[0] == threads and key[1]}, reverse=True)
    for case in cases:
        for name in names:
            key = (threads, name, case)
            rest = statistics.median(
                t["forward"] - sum(t.get(p, 0) for p in PARTS) for t in times[key]
            )
            shares = ", ".join(f"{p} {median(key, p):.2f}" for p in PARTS)
            total = median(key, "forward")
            print(f"  {case:8} {name:3}: forward {total:.2f} ms: {shares}, rest {rest:.2f}")
    for kind in dict.fromkeys(case.split()[0] for case in cases):
        for name in names:
            f1, f8, a1, a8 = (
                median((threads, name, f"{kind} {n}"), part)
                for part in ("forward", "attention")
                for n in ROWS
            )
            line = f"  {kind} {name}: 8 / 1 forward {f8 / f1:.2f}x, attention {a8 / a1:.2f}x"
            if name == "new" and "old" in names:
                o1, o8 = (median((threads, "old", f"{kind} {n}"), "attention") for n in ROWS)
                line += f"; attention old / new: 1 row {o1 / a1:.2f}, 8 rows {o8 / a8:.2f}"
            print(line, flush=True)
        for name in names:  # float16 against float32 caches, same kernel
            if not name.endswith(" f16") or name.replace(" f16", " f32") not in names:
                continue
            f32 = name.replace(" f16", " f32")
            ratios = []
            for n in ROWS:
                for part in ("forward", "attention"):
                    case = f"{kind} {n}"
                    ratio = median((threads, name, case), part) / median((threads, f32, case), part)
                    ratios.append(f"{part} {n}: {ratio:.2f}")
            print(f"  {kind} {name.split()[0]}: f16 / f32 KV: {', '.join(ratios)}", flush=True)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
