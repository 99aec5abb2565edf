"""The serial Python between a decode step's weight products: in place against warm.

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/glue.py [--shapes qwen3-30b-a3b
1b] [--layers 4] [--modes q8 exact] [--threads 1 2] [--seconds 6]``

Between two weight products a decode step runs Python and small compiled calls that no
kernel thread shares: the residual add and the next norm (``add_rms_norm``), a mixture of
experts' routing (``route``: softmax, top-k and grouping), each layer's attention over the
cache (``attention``). Each is timed where the forward makes it ("in place": right after a
product has streamed megabytes of weights through the caches), with a thin
``perf_counter_ns`` wrapper; then ``add_rms_norm`` and ``route`` are called again with the
arguments of their last call in place, in a loop ("warm": their code and data in the
caches), in the same process. The ratio is what cold caches cost that serial time; the
in-place time a token, against the token's, is the share a second kernel thread cannot
halve (``attention`` is timed in place only: it writes the cache). Also the token's mean
time, the weight products' in it (every ``Backend.linear`` and the experts' calls, their
Python included) and what runs between them. A mixture-of-experts layer whose feed-forward
half of a one-row step is one compiled call (``cpu.moe_step``: its add and norm, router,
routing, experts and sums inside) shows that call as ``moe_step``, counted with what runs
between the products (its two products are not timed apart).

The models are the real-size random GGUFs of :mod:`benchmarks.realsize_moe_gguf`
(``qwen3-30b-a3b``, ``gpt-oss-20b``) and :mod:`benchmarks.realsize_gguf` (``1b``,
``8b``, the Q4_K_M mix), ``--layers`` deep, cached in ``~/.cache/meshnode/realsize/``;
after a 16-token prompt one token is decoded again and again at the same position (the
cache rolled back to it), for ``--seconds`` a variant.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import realsize_gguf, realsize_moe_gguf
from benchmarks.engine import MeshnodeRunner, uptime
from benchmarks.realsize import prompt_ids

CONTEXT = 16  # prompt tokens before the decoded one
WARM_CALLS = 300  # calls a warm median is taken over
MODES = {"q8": "q8", "exact": "blocks"}  # this driver's names -> MeshnodeRunner's
WIDTHS = (7, 11, 8, 6, 10, 6)  # the table's columns after the call's name


def model_path(shape: str, layers: int) -> Path:
    """The cached real-size GGUF of ``shape``, ``layers`` deep."""
    if shape in realsize_moe_gguf.SHAPES:
        return realsize_moe_gguf.cached_gguf(shape, layers)
    return realsize_gguf.cached_gguf(shape, "q4_k_m", layers)


class Glue:
    """Thin timers around a stage's serial calls, each keeping its in-place times (ns)
    and the arguments of its last call."""

    def __init__(self, stage: Any) -> None:
        from meshnode.engine.cpu import experts, moe_step, pool

        self.times: dict[str, list[int]] = defaultdict(list)
        self.last: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
        backend = stage.backend
        norm = backend.add_rms_norm
        self._restore: list[Callable[[], None]] = []

        def add_rms_norm(*args: Any) -> Any:
            return self._timed("add_rms_norm", norm, args)

        # on the instance (a frozen dataclass), shadowing the class's method
        object.__setattr__(backend, "add_rms_norm", add_rms_norm)
        self._restore.append(lambda: object.__delattr__(backend, "add_rms_norm"))
        # every weight product (the experts' call with its Python): their time, summed
        self.products_ns = 0
        object.__setattr__(backend, "linear", self._summed(backend.linear, "products_ns"))
        self._restore.append(lambda: object.__delattr__(backend, "linear"))
        # inside them, the kernel pool's compiled calls (the post, with the caller's chunks
        # and its wait for the helpers'; the caller's chunks after waking a helper)
        self.pool_ns = 0
        for name in ("_post", "_work"):
            compiled = getattr(pool, name)
            setattr(pool, name, self._summed(compiled, "pool_ns"))
            self._restore.append(functools.partial(setattr, pool, name, compiled))
        layer_call = experts.ExpertLayer.__call__
        timed_experts = self._summed(layer_call, "products_ns")
        experts.ExpertLayer.__call__ = timed_experts  # type: ignore[method-assign]
        self._restore.append(lambda: setattr(experts.ExpertLayer, "__call__", layer_call))
        route = experts.route  # engine.moe calls it through the module

        def timed_route(*args: Any) -> Any:
            return self._timed("route", route, args)

        experts.route = timed_route  # type: ignore[assignment]
        self._restore.append(lambda: setattr(experts, "route", route))
        # a MoE layer's feed-forward half of a one-row step in one call (Backend.moe_step:
        # its add and norm, products, routing and sums inside): timed whole, in place
        step_call = moe_step.MoeStep.__call__

        def timed_step(*args: Any) -> Any:
            return self._timed("moe_step", step_call, args, keep=False)

        moe_step.MoeStep.__call__ = timed_step  # type: ignore[method-assign,assignment]
        self._restore.append(lambda: setattr(moe_step.MoeStep, "__call__", step_call))
        mixer = stage._mixer
        attention = mixer.attention
        timed = self._timed

        class TimedAttention:
            def prepare(self, segs: Any) -> Any:
                return attention.prepare(segs)

            def keep_rows(self, *args: Any) -> Any:
                return attention.keep_rows(*args)

            def __call__(self, *args: Any) -> Any:
                return timed("attention", attention, args, keep=False)

        mixer.attention = TimedAttention()
        self._restore.append(lambda: setattr(mixer, "attention", attention))

    def _summed(self, fn: Callable[..., Any], total: str) -> Callable[..., Any]:
        """``fn`` with its time added to the attribute ``total`` (ns) at each call."""

        def timed(*args: Any) -> Any:
            began = time.perf_counter_ns()
            out = fn(*args)
            setattr(self, total, getattr(self, total) + time.perf_counter_ns() - began)
            return out

        return timed

    def _timed(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], keep: bool = True
    ) -> Any:
        began = time.perf_counter_ns()
        out = fn(*args)
        self.times[name].append(time.perf_counter_ns() - began)
        if keep:
            self.last[name] = (fn, args)
        return out

    def warm(self, name: str) -> float:
        """The median ns of ``name``'s last in-place call made again, :data:`WARM_CALLS`
        times in a row."""
        fn, args = self.last[name]
        ns = []
        for _ in range(WARM_CALLS):
            began = time.perf_counter_ns()
            fn(*args)
            ns.append(time.perf_counter_ns() - began)
        return statistics.median(ns)

    def restore(self) -> None:
        for undo in self._restore:
            undo()


def measure(shape: str, layers: int, mode: str, threads: int, seconds: float) -> None:
    """One variant's decode loop, then its table."""
    runner = MeshnodeRunner(str(model_path(shape, layers)), MODES[mode], threads)
    stage = runner.stage
    cache = stage.new_cache(CONTEXT + 2)
    stage.forward(prompt_ids(CONTEXT, 1), 0, cache, out_rows=1)
    token = np.array([7])
    for _ in range(3):  # warm: compiled, pages touched, the pool's threads started
        stage.forward(token, CONTEXT, cache)
    glue = Glue(stage)
    steps: list[float] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        t = time.perf_counter_ns()
        stage.forward(token, CONTEXT, cache)
        steps.append(time.perf_counter_ns() - t)
    step_ns = statistics.median(steps)
    mean_ns, products_ns = statistics.fmean(steps), glue.products_ns / len(steps)
    pool_ns = glue.pool_ns / len(steps)
    print(f"\n{shape} {layers} layers, {mode}, {threads} threads: token {step_ns / 1e6:.2f} ms")
    between = mean_ns - products_ns
    print(f"means a token: {mean_ns / 1e6:.2f} ms, the weight products {products_ns / 1e6:.2f} ms, "
          f"between them {between / 1e6:.2f} ms ({between / mean_ns:.1%})")  # fmt: skip
    if pool_ns:  # the products shared with the kernel threads (none at one thread)
        rest = products_ns - pool_ns
        print(f"in the products: the pool's compiled calls {pool_ns / 1e6:.2f} ms, the rest "
              f"{rest / 1e6:.2f} ms ({rest / mean_ns:.1%}: their Python, the activations' "
              "quantizing, any product not shared)")  # fmt: skip
    _row("call", ("a token", "in place us", "warm us", "ratio", "ms a token", "share"))
    total = 0.0
    for name, ns in sorted(glue.times.items()):
        calls = len(ns) / len(steps)
        place = statistics.median(ns)
        warm = glue.warm(name) if name in glue.last else float("nan")
        per_token = place * calls
        total += per_token
        ratio = f"{place / warm:.2f}"
        cells = (f"{calls:.1f}", f"{place / 1e3:.1f}", f"{warm / 1e3:.1f}", ratio)
        _row(name, (*cells, f"{per_token / 1e6:.3f}", f"{per_token / step_ns:.1%}"))
    _row("these calls", ("", "", "", "", f"{total / 1e6:.3f}", f"{total / step_ns:.1%}"))
    glue.restore()


def _row(name: str, cells: tuple[str, ...]) -> None:
    print(f"{name:<13} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, WIDTHS, strict=True)))


def main() -> None:
    shapes = sorted(realsize_moe_gguf.SHAPES) + sorted(realsize_gguf.SHAPES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b"], choices=shapes)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["q8"], choices=list(MODES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=6.0, help="decode time a variant")
    args = parser.parse_args()
    print(uptime(), flush=True)
    for shape in args.shapes:
        for mode in args.modes:
            for threads in args.threads:
                measure(shape, args.layers, mode, threads, args.seconds)
    print(uptime())


if __name__ == "__main__":
    main()
