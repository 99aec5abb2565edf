"""Where an 8-stream (or one-row) decode step goes at 1 and 2 kernel threads, on a
real-size shape (issue 29: decode and 8 streams at 2 threads against llama.cpp).

Run: ``OPENBLAS_NUM_THREADS=1 nice .venv/bin/python benchmarks/streams_step.py [--shape 1b]
[--layers N | --gguf PATH] [--dtype q8|native] [--streams 8] [--threads 1 2] [--rounds 5]
[--steps 4]
[--patience-us P ...] [--spin-us S ...] [--ahead-kib A ...] [--chunk-orders]``

One stage holds the whole random-weight GGUF of ``--shape`` (``benchmarks/realsize_gguf.py``,
Q4_K_M mix; ``--layers`` cuts its depth), or the GGUF at ``--gguf`` (e.g. a mixture of
experts' written by ``benchmarks/realsize_moe.py``: its experts' products count as "other
product"). ``--streams`` sequences (8: as
``benchmarks/realsize.py``'s 8 streams; 1, alias ``--rows 1``: its one-row decode) are
prefilled with 16 tokens each, then ``--steps`` decode steps of them
(one row each, one ``Stage.forward_batch``) run at each ``--threads`` count in turn, in
alternating rounds, with every kernel thread taken (the pool's core gauge off, as
``--every-core-free``). For every part of the step (each weight product by matrix: q/k/v,
output, gate/up, down, the head; attention; the SwiGLU; the residual adds and norms; the
rest: embedding, the batch's Python, argmax), medians over rounds of its wall time, the
calling thread's CPU time and the kernel helper threads' CPU time, per step, in ms; and
for 2 threads against 1 the wall's speed-up and the CPU time both threads spent against
the one thread's (1.00: no work added by sharing; more: spinning, waiting, or cores
slowing each other). The pool's counts per step tell how many products were shared, how
many it declined (a helper still held a chunk of the last one), how many chunks the
caller computed again (a helper held them past the pool's patience) and how many it posted
while a helper slept (waking it); and the threads' scheduling (``/proc``'s schedstat and
context switches): the helpers' sleeps (voluntary switches), and the time the caller and
the helpers waited runnable for a core (preempted: other processes).
``--patience-us`` times the pool's patience (how long the caller waits for a helper's
chunk before computing it itself) and ``--spin-us`` the helpers' spin (how long a helper
waits for the next product before it sleeps) at each of these values, each pair a setup of
its own in the same rounds (at each thread count above one); ``--ahead-kib`` likewise the
bytes an idle helper asks for ahead of the product expected next (:data:`.pool.AHEAD_BYTES`;
0: none).

``--serial`` times instead one thread's CPU a step, whole and with every weight product
stubbed (a copy of its first output): what is left is the part of the step a second
kernel thread does not share.

``--chunk-orders`` times instead, on this thread alone (its CPU time, the best of
``--rounds``), each product kind's one-row products over every layer three ways: whole (the
serial kernel), by the pool's chunks for two threads in order, and those chunks in turns
(the even ones, then the odd ones: one thread's share when two threads take chunks in
turns, each of its chunks starting where its weights were not asked for yet). The chunks
are called from Python here (~1-2 µs a call, which the pool's compiled calls do not
pay): compare the two chunked columns with each other, not with the whole product.

The machine is shared: ``uptime`` is printed first and last; read ratios, and CPU times
(less disturbed by other processes than walls).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import uptime
from benchmarks.realsize_gguf import SHAPES, cached_gguf

PROMPT = 16


class Setup(NamedTuple):
    """A measured configuration: kernel threads, the pool's patience and its helpers' spin
    in µs (None: the pool's own, a few of the job's chunk times, and
    :data:`.pool.SPIN_MICROSECONDS`)."""

    threads: int
    patience: float | None
    spin: float | None
    ahead: int | None = None  # KiB a helper asks for ahead (None: .pool.AHEAD_BYTES)

    def __str__(self) -> str:
        patience = "" if self.patience is None else f" {self.patience:g} us"
        ahead = "" if self.ahead is None else f" ahead {self.ahead}K"
        spin = "" if self.spin is None else f" spin {self.spin:g}"
        return f"{self.threads}t{patience}{spin}{ahead}"


# the pool's counts (KernelPool.counts) printed per step: the split and the hand-offs
HAND_OFFS: tuple[str, ...] = ("chunks", "caller", "helpers", "waited_us", "start_us", "starts")
HAND_OFFS += ("woken_start_us", "woken_starts")
PARTS = ("qkv", "out", "gate_up", "down", "head", "attention", "glu", "add+norm")


def helpers() -> list[threading.Thread]:
    """The kernel pool's helper threads started so far."""
    return [t for t in threading.enumerate() if t.name.startswith("meshnode-kernel-")]


def helper_clocks() -> list[int]:
    """CPU-time clocks of the kernel pool's helper threads started so far."""
    return [time.pthread_getcpuclockid(t.ident) for t in helpers() if t.ident is not None]


def sched(tids: list[int]) -> tuple[float, float, float]:
    """Summed over threads ``tids`` of this process: ms waited runnable for a core
    (``schedstat``), voluntary context switches (sleeps, blocking) and involuntary ones
    (preemptions); zeros without ``/proc``."""
    waited = voluntary = involuntary = 0.0
    for tid in tids:
        task = Path(f"/proc/self/task/{tid}")
        try:
            waited += int((task / "schedstat").read_text().split()[1]) / 1e6
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    involuntary += int(line.split()[1])
        except OSError:
            continue
    return waited, voluntary, involuntary


class Clocks:
    """Wall, this thread's CPU and the helpers' CPU time, read together."""

    def __init__(self) -> None:
        self.helpers: list[int] = []

    def now(self) -> tuple[float, float, float]:
        helpers = sum(time.clock_gettime(c) for c in self.helpers)
        return time.perf_counter(), time.thread_time(), helpers


class Parts:
    """Each part's (wall, caller CPU, helpers' CPU) seconds, from timers set on the stage."""

    def __init__(self, stage: Any, clocks: Clocks) -> None:
        self.spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        self.clocks = clocks
        w = stage.weights
        self.names: dict[int, str] = {}
        for layer in w.layers:
            kinds = (("qkv", "wqkv"), ("out", "wo"), ("gate_up", "w_gate_up"), ("down", "w_down"))
            for name, attr in kinds:
                if getattr(layer, attr, None) is not None:  # experts' layers: no dense MLP
                    self.names[id(getattr(layer, attr))] = name
        self.names[id(w.head_t if w.head_t is not None else w.embed_t)] = "head"
        inner, attention, parts = stage.backend, stage._mixer.attention, self

        class TimedBackend:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def linear(self, x: Any, m: Any, sizes: Any = None) -> Any:
                with parts.part(parts.names.get(id(m), "other product")):
                    return inner.linear(x, m, sizes)

            def glu(self, gate_up: Any, activation: str) -> Any:
                with parts.part("glu"):
                    return inner.glu(gate_up, activation)

            def add_rms_norm(self, *args: Any) -> Any:
                with parts.part("add+norm"):
                    return inner.add_rms_norm(*args)

            def rms_norm(self, *args: Any) -> Any:
                with parts.part("add+norm"):
                    return inner.rms_norm(*args)

        class TimedAttention:
            def prepare(self, segs: Any) -> Any:
                with parts.part("attention"):
                    return attention.prepare(segs)

            def keep_rows(self, *args: Any) -> Any:
                return attention.keep_rows(*args)

            def __call__(self, *args: Any) -> Any:
                with parts.part("attention"):
                    return attention(*args)

        stage._mixer.attention = TimedAttention()
        stage.backend = stage._mixer.backend = TimedBackend()

    def part(self, name: str) -> _Timer:
        return _Timer(self, name)


class _Timer:
    def __init__(self, parts: Parts, name: str) -> None:
        self.parts, self.name = parts, name

    def __enter__(self) -> None:
        self.began = self.parts.clocks.now()

    def __exit__(self, *exc: object) -> None:
        end = self.parts.clocks.now()
        spent = self.parts.spent[self.name]
        for i in range(3):
            spent[i] += end[i] - self.began[i]


def chunk_orders(stage: Any, rounds: int) -> None:
    """One thread's CPU time for each product kind's one-row products over every layer:
    whole, by the pool's two-thread chunks in order, and in turns (``--chunk-orders``)."""
    import ctypes

    from meshnode.engine.cpu import pool, q8

    kernels = q8._kernels()
    w = stage.weights
    kinds = {"qkv": "wqkv", "out": "wo", "gate_up": "w_gate_up", "down": "w_down"}
    chunk_fn = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
    print("| product (all layers) | whole, ms CPU | chunks in order | in turns | turns / order |")
    print("|---|---:|---:|---:|---:|")
    for name, attr in kinds.items():
        ms = [getattr(layer, attr) for layer in w.layers]
        x = np.random.default_rng(0).standard_normal(ms[0].n_in).astype(np.float32)
        q = kernels.quantized(x, 1)
        scratch = np.zeros((1, 7 * ms[0].n_in), np.float32)
        jobs = []
        for m in ms:
            out = np.empty((1, m.n_out), np.float32)
            rows = pool.chunk_rows(m.n_out, m.n_in, 1, 2)
            (a, b, c), st = m._raws, np.zeros(pool.WORDS, np.int64)
            counts = [(p.shape[0] + rows - 1) // rows for p in (a, b, c)]
            fields = {pool.A: a, pool.B: b, pool.C: c}
            for at, part in fields.items():  # address, rows, row bytes
                st[at : at + 3] = part.ctypes.data, part.shape[0], part.shape[1]
            st[[pool.K, pool.N_OUT, pool.X, pool.N_IN, pool.OUT]] = (
                *(1, m.n_out, q.ctypes.data, m.n_in, out.ctypes.data),
            )
            st[[pool.SCRATCH, pool.STRIDE, pool.CA, pool.CB, pool.ROWS]] = (
                *(scratch.ctypes.data, scratch.shape[1], counts[0], counts[1], rows),
            )
            fn = chunk_fn(kernels.chunk_kernel(*m._fmts, False))
            jobs.append((m, out, st, fn, sum(counts)))

        best = [float("inf")] * 3
        for _ in range(rounds):
            for i, order in enumerate(("whole", "in order", "in turns")):
                began = time.thread_time()
                _run_in(order, jobs, kernels, x)
                best[i] = min(best[i], (time.thread_time() - began) * 1e3)
        cells = " | ".join(f"{b:.2f}" for b in best)
        print(f"| {name} | {cells} | {best[2] / best[1]:.3f} |")


def serial(stage: Any, args: argparse.Namespace) -> None:
    """One thread's CPU a decode step (``--streams`` rows), whole and with every weight
    product stubbed (a copy of its first output returned: the step's attention, norms,
    SwiGLU, embedding, argmax and Python, which a second kernel thread does not share),
    alternating, medians of ``--rounds`` of ``--steps`` steps (``--serial``)."""
    from meshnode.engine.backend import CpuBackend
    from meshnode.engine.cpu import set_kernel_threads

    set_kernel_threads(1)
    real = CpuBackend.linear
    outs: dict[tuple[int, int], Any] = {}

    def stub(self: Any, x: Any, w: Any, sizes: Any = None) -> Any:
        key = (id(w), x.shape[0])
        if key not in outs:
            outs[key] = real(self, x, w, sizes)
        return outs[key].copy()

    rng = np.random.default_rng(10)
    spent: dict[str, list[float]] = {"whole": [], "products stubbed": []}
    for _ in range(args.rounds + 1):  # the first round warms up, not counted
        for name in spent:
            CpuBackend.linear = real if name == "whole" else stub  # type: ignore[method-assign]
            caches = [stage.new_cache(PROMPT + args.steps + 1) for _ in range(args.streams)]
            for cache in caches:
                stage.forward(rng.integers(100, 40000, PROMPT), 0, cache, out_rows=1)
            began = time.thread_time()
            _decode(stage, caches, args.steps)
            spent[name].append((time.thread_time() - began) / args.steps * 1e3)
    CpuBackend.linear = real  # type: ignore[method-assign]
    for name, times in spent.items():
        counted = times[1:]
        print(
            f"{name}: {statistics.median(counted):.2f} ms CPU a step (median of "
            f"{len(counted)}; {', '.join(f'{t:.2f}' for t in counted)})"
        )


def _run_in(order: str, jobs: list[Any], kernels: Any, x: np.ndarray) -> None:
    """Every product of ``jobs`` (matrix, output, the pool's words, chunk function,
    chunks) whole, or by its chunks ``in order`` or ``in turns``."""
    for m, out, st, fn, n in jobs:
        if order == "whole":
            kernels.product_kernel(*m._fmts, False)(*m._raws, x, out)
            continue
        for ch in range(n) if order == "in order" else [*range(0, n, 2), *range(1, n, 2)]:
            fn(st.ctypes.data, 0, ch)


def run(args: argparse.Namespace) -> None:
    from meshnode.engine.backend import cpu_backend, limit_cpu_threads
    from meshnode.engine.cpu import matrix, set_kernel_threads
    from meshnode.engine.cpu.pool import AHEAD_BYTES, CoreGauge
    from meshnode.engine.loader import load_model

    model_path = args.gguf or cached_gguf(args.shape, "q4_k_m", args.layers)
    limit = limit_cpu_threads(max(args.threads))
    stage = load_model(str(model_path), cpu_backend(args.dtype)).stage
    pool = matrix._pool()
    pool._gauge = CoreGauge(Path("/nonexistent/stat"))  # every thread asked for
    if args.chunk_orders:
        chunk_orders(stage, args.rounds)
        return
    if args.serial:
        serial(stage, args)
        return
    rng = np.random.default_rng(10)
    caches = [stage.new_cache(PROMPT + args.steps + 1) for _ in range(args.streams)]
    for cache in caches:
        stage.forward(rng.integers(100, 40000, PROMPT), 0, cache, out_rows=1)
    clocks = Clocks()
    parts = Parts(stage, clocks)

    caller = [threading.get_native_id()]

    def counts() -> tuple[float, ...]:
        mine = [t.native_id for t in helpers() if t.native_id is not None]
        waited, _, preempted = sched(caller)
        c = pool.counts()
        return (
            pool.posted,
            pool.declined,
            pool.crowded,
            pool.redone,
            pool.woken,
            *sched(mine),
            waited,
            preempted,
            *(c[k] for k in HAND_OFFS),
        )

    def steps() -> tuple[dict[str, list[float]], tuple[float, ...]]:
        parts.spent.clear()
        before = counts()
        began = clocks.now()
        _decode(stage, caches, args.steps)
        end = clocks.now()
        spent = {name: [t / args.steps * 1e3 for t in v] for name, v in parts.spent.items()}
        total = [(end[i] - began[i]) / args.steps * 1e3 for i in range(3)]
        spent["rest"] = [total[i] - sum(v[i] for v in spent.values()) for i in range(3)]
        spent["step"] = total
        now = counts()
        return spent, tuple((b - a) / args.steps for a, b in zip(before, now, strict=True))

    setups = [Setup(t, None, None) for t in args.threads if t == 1]
    setups += [
        Setup(t, p, s, a)
        for t in args.threads
        if t > 1
        for p in args.patience_us or [None]
        for s in args.spin_us or [None]
        for a in args.ahead_kib or [None]
    ]

    def use(setup: Setup) -> None:
        set_kernel_threads(setup.threads)
        pool.set_waits(setup.patience, setup.spin)
        pool.set_ahead(AHEAD_BYTES if setup.ahead is None else setup.ahead << 10)

    for setup in setups:  # warm-up: kernels compiled or loaded, helpers started
        use(setup)
        clocks.helpers = helper_clocks()
        steps()
    clocks.helpers = helper_clocks()
    results: dict[Setup, list[dict[str, list[float]]]] = defaultdict(list)
    posted: dict[Setup, tuple[float, ...]] = {}
    for r in range(args.rounds):
        for setup in setups:
            use(setup)
            spent, posted[setup] = steps()
            results[setup].append(spent)
        print(f"round {r + 1}/{args.rounds} {uptime()}", file=sys.stderr, flush=True)
    report(results, posted, args)
    del limit


def report(
    results: dict[Setup, list[dict[str, list[float]]]],
    posted: dict[Setup, tuple[float, ...]],
    args: Any,
) -> None:
    """Medians per part: wall, caller CPU, helpers' CPU (ms a step); each setup against the
    first (one thread)."""

    def med(setup: Setup, part: str, i: int) -> float:
        return statistics.median(r.get(part, [0.0] * 3)[i] for r in results[setup])

    names = [*PARTS, "other product", "rest", "step"]
    names = [n for n in names if any(n in r for rs in results.values() for r in rs)]
    layers = args.layers or SHAPES[args.shape].layers
    model = Path(args.gguf).name if args.gguf else f"{args.shape} ({layers} layers)"
    print(f"\n{model}, {args.dtype}, {args.streams} streams, medians of")
    print(f"{args.rounds} rounds of {args.steps} steps, ms a step")
    for setup in results:
        shared, declined, crowded, redone, woken, waited, sleeps, preempted, c_waited, c_pre = (
            posted[setup][:10]
        )
        hand = dict(zip(HAND_OFFS, posted[setup][10:], strict=True))
        print(
            f"{setup}, per step (last round): products and attention calls shared {shared:g}, "
            f"declined (a helper late) {declined:g}, left to the caller by the core gauge "
            f"{crowded:g}, posted to a sleeping helper {woken:g}; "
            f"chunks redone by the caller {redone:g}; helpers: {sleeps:g} sleeps, "
            f"{preempted:g} preempted, {waited:.2f} ms waiting for a core; caller: "
            f"{c_pre:g} preempted, {c_waited:.2f} ms waiting for a core"
        )
        if setup.threads > 1:
            starts, woken_starts = hand["starts"], hand["woken_starts"]
            print(
                f"  hand-offs: {hand['chunks']:g} chunks a step, the caller ran "
                f"{hand['caller']:g}, helpers {hand['helpers']:g}; the caller waited "
                f"{hand['waited_us']:.0f} us a step for helpers' last chunks; "
                f"post -> a spinning helper's first chunk "
                f"{hand['start_us'] / max(1, starts):.1f} us ({starts:g} jobs), a woken one's "
                f"{hand['woken_start_us'] / max(1, woken_starts):.1f} us ({woken_starts:g} jobs)"
            )
    one = next(iter(results))
    head = ["part"] + [f"{s} wall / caller CPU / helpers' CPU" for s in results]
    head += [f"{s}: speed-up, CPU / {one} CPU" for s in results if s != one]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for name in names:
        cells = [name]
        for s in results:
            cells.append(" / ".join(f"{med(s, name, i):.2f}" for i in range(3)))
        for s in results:
            if s == one:
                continue
            speed = med(one, name, 0) / max(1e-9, med(s, name, 0))
            cpu = (med(s, name, 1) + med(s, name, 2)) / max(1e-9, med(one, name, 1))
            cells.append(f"{speed:.2f}x, {cpu:.2f}")
        print("| " + " | ".join(cells) + " |")


def _decode(stage: Any, caches: list[Any], steps: int) -> None:
    """``steps`` greedy decode steps of every cache's stream, one row each, in one batch."""
    from meshnode.engine.model import BatchRow

    last = [7 + i for i in range(len(caches))]
    for step in range(steps):
        pairs = zip(last, caches, strict=True)
        rows = [BatchRow(np.array([t]), PROMPT + step, c, 1) for t, c in pairs]
        last = [int(np.argmax(o[-1])) for o in stage.forward_batch(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="cut the model to its first N layers")
    parser.add_argument("--gguf", help="this GGUF instead of --shape's (e.g. realsize_moe's)")
    parser.add_argument("--dtype", default="q8", choices=["q8", "native"])
    parser.add_argument(
        "--streams", "--rows", type=int, default=8, help="sequences a step (1: one-row decode)"
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="decode steps per measurement")
    parser.add_argument(
        "--patience-us", type=float, nargs="+", help="the pool's patience to try (> 1 thread)"
    )
    parser.add_argument(
        "--spin-us", type=float, nargs="+", help="the helpers' spin to try (> 1 thread)"
    )
    parser.add_argument(
        "--ahead-kib",
        type=int,
        nargs="+",
        help="the bytes an idle helper asks for ahead of the next product, KiB (> 1 thread)",
    )
    parser.add_argument(
        "--serial",
        action="store_true",
        help="one thread's CPU a step, whole and with the weight products stubbed",
    )
    parser.add_argument(
        "--chunk-orders",
        action="store_true",
        help="one thread: the products whole, by two threads' chunks in order, in turns",
    )
    args = parser.parse_args()
    print("uptime:", uptime(), flush=True)
    run(args)
    print("uptime:", uptime(), flush=True)


if __name__ == "__main__":
    main()
