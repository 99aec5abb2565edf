"""Where one decode token of a real-size mixture-of-experts model goes, part by part.

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/moe_token.py [--shapes
gpt-oss-20b] [--layers 4] [--modes q8 exact] [--repeats 20] [--context 16] [--streams 1]
[--llama-tok-s 12.3] [--threads 1] [--all-cores] [--tree DIR]``

The model is the real-size random GGUF of :mod:`benchmarks.realsize_moe_gguf` (cached in
``~/.cache/meshnode/realsize/``, ``--layers`` deep), loaded as ``realsize_moe.py`` loads
it, on one kernel thread. After a ``--context``-token prompt, one token is decoded again
and again at the same position (the cache rolled back to it by ``start_pos``; ``--streams
N``: N sequences, each its own prompt, one row each a step, as ``realsize_moe.py``'s 8
streams), with a timer around each part of the forward, in this thread's CPU time (robust on a busy
machine; one kernel thread, so every product runs in this thread). Medians over
``--repeats`` tokens, in ms per token, of:

- each product by matrix: ``qkv`` and ``o`` (attention, all layers together), ``router``,
  ``head``; ``experts``: the compiled experts (gathers, each chosen expert's two products,
  its biases and clamped SwiGLU), ``route``: softmax, top-k and grouping, ``sums``
  included in ``experts``;
- ``attention``: RoPE, the KV cache, attention with sinks; ``bias``: the attention's bias
  adds (``Backend.add``); ``norm``: norms and residual adds; ``embed``;
- ``other``: the forward less the parts (Python between the calls).

Beside each product: the bytes it reads a token (the experts: the chosen ones' bytes,
from the routes the token took) and the GB/s it reaches; and the whole token's GB/s
against llama.cpp's at ``--llama-tok-s`` (its decode tok/s on the same file at one thread,
from ``realsize_moe.py``; the lead's idle run of session 24 by default), which reads the
same bytes a token.

``--threads 2`` (or more) times the parts on that many kernel threads: each part's wall
time (``time.perf_counter``, the caller's view) and the process's CPU time in it (every
thread's, the helpers' spinning included), their ratio the cores a part kept busy; and
the hand-offs a token makes: products the kernel pool (:mod:`.pool`) took (``posted``),
of them posted to a sleeping helper (``woken``), left serial (``declined``), and the tile
threads' jobs (:func:`.matrix.share`: the experts' split). A part whose wall time does
not fall from one thread to two is where the second thread is lost. ``--tree DIR``
imports meshnode from another checkout (an older commit, ``git archive``), to time both
side by side in alternating runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]
if "--tree" in sys.argv:  # before meshnode is imported
    TREE = Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()
    sys.path[:0] = [str(TREE), str(TREE / "protocol"), str(TREE / "packaging")]
sys.path.insert(0 if "--tree" not in sys.argv else 3, str(HERE))

from benchmarks.engine import uptime  # noqa: E402
from benchmarks.realsize_moe_gguf import cached_gguf  # noqa: E402

CLOCK = time.thread_time  # one thread: this thread's CPU time (robust under load)
WALL = time.perf_counter  # several: the caller's wall time per part
PRODUCTS = ("qkv", "o", "router", "experts", "head")
PARTS = (*PRODUCTS, "route", "attention", "bias", "norm", "embed")


class Timers:
    """Timers set around the parts of one stage's forward (on the instance, the backend
    and the engine modules this process imported)."""

    def __init__(self, stage: Any) -> None:
        from meshnode.engine import moe
        from meshnode.engine.cpu import experts

        self.spent: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)  # process CPU per part (threads > 1)
        self.clock = CLOCK
        self.expert_bytes = 0
        names: dict[int, str] = {}
        for layer in stage.weights.layers:
            names[id(layer.wqkv)], names[id(layer.wo)] = "qkv", "o"
            names[id(layer.moe.router)] = "router"
        head = stage.weights.head_t if stage.weights.head_t is not None else stage.weights.embed_t
        names[id(head)] = "head"
        backend, spent = stage.backend, self.spent
        timed = self._timed

        class TimedBackend:
            def __getattr__(self, name: str) -> Any:
                return getattr(backend, name)

            def linear(self, x: Any, w: Any, sizes: Any = None) -> Any:
                return timed(names.get(id(w), "linear?"), backend.linear, x, w, sizes)

            def add(self, x: Any, b: Any) -> Any:
                return timed("bias", backend.add, x, b)

            def rms_norm(self, *args: Any) -> Any:
                return timed("norm", backend.rms_norm, *args)

            def add_rms_norm(self, *args: Any) -> Any:
                return timed("norm", backend.add_rms_norm, *args)

            def embed_rows(self, *args: Any) -> Any:
                return timed("embed", backend.embed_rows, *args)

        proxy = TimedBackend()
        stage.backend = stage._mixer.backend = proxy
        attention = stage._mixer.attention

        class TimedAttention:
            def prepare(self, segs: Any) -> Any:
                return timed("attention", attention.prepare, segs)

            def keep_rows(self, *args: Any) -> Any:
                return attention.keep_rows(*args)

            def __call__(self, *args: Any) -> Any:
                return timed("attention", attention, *args)

        stage._mixer.attention = TimedAttention()
        route, call = experts.route, experts.ExpertLayer.__call__
        moe.experts.route = lambda *a: timed("route", route, *a)  # type: ignore[attr-defined]
        layer_bytes = self._chosen_bytes

        def experts_call(layer: Any, x: Any, picks: Any, *rest: Any) -> Any:
            layer_bytes(layer, picks)
            return timed("experts", call, layer, x, picks, *rest)

        experts.ExpertLayer.__call__ = experts_call  # type: ignore[method-assign,assignment]
        spent.clear()

    def _timed(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        cpu, began = time.process_time(), self.clock()
        out = fn(*args)
        self.spent[part] += self.clock() - began
        self.cpu[part] += time.process_time() - cpu
        return out

    def _chosen_bytes(self, layer: Any, picks: Any) -> None:
        for e in np.unique(picks):
            for raw in (*layer.gate_up.raws, *layer.down.raws):
                if raw.shape[0] > e:
                    self.expert_bytes += int(raw[e].nbytes)


def product_bytes(stage: Any) -> dict[str, int]:
    """Bytes each product but the experts' reads a token (every layer's together)."""
    w = stage.weights
    head = w.head_t if w.head_t is not None else w.embed_t
    return {
        "qkv": sum(layer.wqkv.nbytes for layer in w.layers),
        "o": sum(layer.wo.nbytes for layer in w.layers),
        "router": sum(layer.moe.router.nbytes for layer in w.layers),
        "head": head.nbytes,
    }


def profile(shape: str, layers: int, mode: str, args: argparse.Namespace) -> None:
    import meshnode
    from benchmarks.engine import MeshnodeRunner
    from meshnode.engine.cpu import matrix
    from meshnode.engine.model import BatchRow

    runner = MeshnodeRunner(str(cached_gguf(shape, layers)), mode, args.threads)
    stage = runner.stage
    rows = []  # --streams sequences, one new row each a step, at the same position
    for i in range(args.streams):
        ids = np.random.default_rng(1 + i).integers(100, 40000, args.context)
        cache = stage.new_cache(args.context + 2)
        stage.forward(ids, 0, cache, out_rows=1)
        rows.append(BatchRow(np.array([7 + i]), args.context, cache, 1))

    def step() -> None:
        stage.forward_batch(rows)

    for _ in range(2):  # warm: compiled, pages touched
        step()
    timers = Timers(stage)
    clock = timers.clock = CLOCK if args.threads == 1 else WALL
    pool, tiles = matrix._pool(), matrix._tile_threads()
    if args.all_cores:  # the gauge would leave products serial on a busy machine
        pool.gauge.free = lambda: float(args.threads)
    totals, parts, moved, cpus, handed = [], [], [], [], []
    for _ in range(args.repeats):
        timers.spent.clear()
        timers.cpu.clear()
        timers.expert_bytes = 0
        counts = (pool.posted, pool.woken, pool.declined, tiles.posted, *_chunks(pool))
        cpu, began = time.process_time(), clock()
        step()
        totals.append(clock() - began)
        cpus.append((dict(timers.cpu), time.process_time() - cpu))
        parts.append(dict(timers.spent))
        moved.append(timers.expert_bytes)
        after = (pool.posted, pool.woken, pool.declined, tiles.posted, *_chunks(pool))
        handed.append([b - a for a, b in zip(counts, after, strict=True)])
    med = {p: 1e3 * statistics.median(t.get(p, 0.0) for t in parts) for p in PARTS}
    total = 1e3 * statistics.median(totals)
    med["other"] = total - sum(med.values())
    busy = {p: 1e3 * statistics.median(c[0].get(p, 0.0) for c in cpus) for p in PARTS}
    busy["other"] = 1e3 * statistics.median(c[1] for c in cpus) - sum(busy.values())
    sizes = {**product_bytes(stage), "experts": int(statistics.median(moved))}
    every = sum(sizes.values())
    where = Path(meshnode.__file__).parent
    print(f"\n{shape} {layers} layers, {mode}, {args.threads} threads, ", end="")
    print(f"{args.streams} streams, meshnode {where}")
    print(f"token {total:.2f} ms ({1e3 / total:.2f} tok/s), {every / 1e6:.0f} MB read,")
    print(f"  {every / total / 1e6:.2f} GB/s; llama.cpp {args.llama_tok_s} tok/s: ", end="")
    print(f"{1e3 / args.llama_tok_s:.1f} ms, {every * args.llama_tok_s / 1e9:.2f} GB/s")
    if args.threads > 1:
        posted, woken, declined, shared, caller, helpers, redone, waited = (
            statistics.median(h[i] for h in handed) for i in range(8)
        )
        print(f"hand-offs a token: pool posted {posted:g} (woken {woken:g}, declined ", end="")
        print(
            f"{declined:g}), tile-thread jobs {shared:g}; the pool's chunks run by the caller ",
            end="",
        )
        print(
            f"{caller:g}, by helpers {helpers:g}, redone by the caller {redone:g} (a helper ",
            end="",
        )
        print(f"held them past its patience), the caller's wait for helpers {waited:.0f} us")
    wide = args.threads > 1
    print(f"{'part':<10} {'ms':>8} {'share':>6} {'MB':>7} {'GB/s':>6}", end="")
    print(f" {'CPU ms':>8} {'cores':>5}" if wide else "")
    for part in (*PARTS, "other"):
        cells = f"{part:<10} {med[part]:>8.2f} {med[part] / total:>6.1%}"
        if part in sizes:
            gbs = sizes[part] / med[part] / 1e6 if med[part] > 0 else float("nan")
            cells += f" {sizes[part] / 1e6:>7.1f} {gbs:>6.2f}"
        elif wide:
            cells += " " * 14
        if wide:
            cores = busy[part] / med[part] if med[part] > 0 else float("nan")
            cells += f" {busy[part]:>8.2f} {cores:>5.2f}"
        print(cells, flush=True)


def _chunks(pool: Any) -> tuple[float, float, float, float]:
    """The pool's chunks so far run by the caller and by the helpers, those the caller
    redid (a helper held them past the caller's patience) and its wait for helpers (µs)."""
    c = pool.counts()
    return c["caller"], c["helpers"], float(pool.redone), c["waited_us"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["gpt-oss-20b"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["q8", "exact"], choices=["q8", "exact"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument(
        "--streams", type=int, default=1, help="sequences a step, one row each (8: 8 streams)"
    )
    parser.add_argument("--llama-tok-s", type=float, default=12.3)
    parser.add_argument("--threads", type=int, default=1, help="kernel threads (wall time)")
    parser.add_argument(
        "--all-cores",
        action="store_true",
        help="the kernel threads take every product as on an idle machine (the gauge of "
        "free cores overridden): where the parts' hand-offs go on a busy one",
    )
    parser.add_argument("--tree", help="import meshnode from this checkout")
    args = parser.parse_args()
    print(uptime(), flush=True)
    for shape in args.shapes:
        for mode in args.modes:
            profile(shape, args.layers, {"q8": "q8", "exact": "blocks"}[mode], args)
    print(uptime())


if __name__ == "__main__":
    main()
