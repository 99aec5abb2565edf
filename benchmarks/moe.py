"""Where a real-size mixture-of-experts layer's time goes, step by step, beside the bytes
its chosen experts hold multiplied as one dense matrix.

Run: ``.venv/bin/python benchmarks/moe.py [--shapes qwen3-30b-a3b gpt-oss-20b]
[--rows 1 8] [--modes exact q8] [--repeats 30] [--threads 1] [--layers 4]``;
``--attention [--context 1024]``: one attention layer of each shape instead, and
Qwen3.5's gated attention, compiled against the NumPy path a row at a time that they took
before (:mod:`benchmarks.moe_attention`).

The layer is layer 0 of the real-size random GGUF (:mod:`benchmarks.realsize_moe_gguf`,
``--layers`` deep, 4 by default as ``realsize_moe.py --layers 4`` writes it, cached in
``~/.cache/meshnode/realsize/``: Qwen3-30B-A3B's Q4_K/Q6_K experts, gpt-oss-20b's MXFP4
experts with biases and its clamped SwiGLU), loaded as a stage loads it
(:func:`meshnode.engine.moe_weights.load_moe`: the compiled experts). For r decode
rows (one segment each), medians of the thread CPU time of ``--repeats`` calls of each
step, taken in turn (robust on a busy machine):

- ``router``: ``x @ router`` (plus gpt-oss's bias);
- ``route``: softmax and top-k in NumPy (:func:`meshnode.engine.moe.route`);
- ``group``: the rows grouped by expert in NumPy (:func:`meshnode.engine.cpu.experts.group`);
- ``routed``: both in one compiled call, as the layer runs them
  (:func:`meshnode.engine.cpu.experts.route`: the same bits; compare with route + group);
- ``experts``: the compiled call (gathers, each chosen expert's two products and its
  activation, biases), without the sums, the same k experts every call: after the first,
  their bytes (21 MB for Qwen3-30B-A3B) sit in the last-level cache;
- ``cold``: the same call with other experts each time (every row of call i sent to experts
  ``k i`` .. ``k i + k - 1``, modulo n): their bytes come from memory, as in a decode step,
  where each layer's chosen experts were last read a whole step ago (the layer's n experts,
  340 MB for Qwen3-30B-A3B, do not fit in the cache). Every set is called once before the
  timing: the first touch of a memory-mapped page costs a page fault (for Qwen3-30B-A3B
  about as much again as the products: 6.1 against 2.9 ms a layer, one row, load 6);
- ``sums``: each row's weighted sum of its k experts;
- ``layer``: the whole ``moe_mlp``, and ``other`` = layer - the steps it runs (router,
  routed, experts, sums);
- ``dense``: the k experts' bytes of one row as one gate/up and one down product
  (what the products alone cost, one read of the same bytes);
- ``experts c/w``, ``cold c/w``, ``dense c/w``: their CPU cycles a weight read (at
  :data:`GHZ`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode_packaging.sources import RawTensor, open_source

from benchmarks import moe_attention
from benchmarks.realsize_moe_gguf import cached_gguf
from meshnode.engine import ModelConfig
from meshnode.engine.backend import cpu_backend
from meshnode.engine.cpu import experts, set_kernel_threads
from meshnode.engine.moe import moe_mlp, route
from meshnode.engine.moe_weights import ExpertWeights, MoeWeights, expert_slice, load_moe, matrix

GHZ = 2.5  # this machine's clock (lscpu: Xeon @ 2.50GHz), for cycles a weight
STEPS = ("router", "route", "group", "routed", "experts", "cold", "sums", "layer", "dense")


def _timed(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def _dense(source: Any, k: int) -> ExpertWeights:
    """Experts 0..k-1 of layer 0 as one gate/up matrix ``[E, k 2 I]`` and one down
    matrix ``[k I, E]`` (the same bytes, one product each; their rows' blocks joined)."""
    names = source.tensor_names()
    x = "layers.0.mlp.experts."
    halves = ["gate_up"] if f"{x}gate_up_proj.weight" in names else ["gate", "up"]
    gate_up = [
        expert_slice(source.tensor(f"{x}{h}_proj.weight"), e) for h in halves for e in range(k)
    ]
    down = [expert_slice(source.tensor(f"{x}down_proj.weight"), e) for e in range(k)]
    return ExpertWeights(_join(gate_up, axis=0), _join(down, axis=1))


def _join(parts: list[RawTensor], axis: int) -> Any:
    """Slices ``[out, in]`` of one format joined along ``out`` (axis 0) or ``in`` (1:
    each row's blocks one after another) as one block matrix (a copy)."""
    out, n_in = parts[0].shape
    rows = [np.asarray(p.data).reshape(p.shape[0], -1) for p in parts]
    data = np.concatenate(rows, axis=axis)
    shape = (sum(p.shape[0] for p in parts), n_in) if axis == 0 else (out, n_in * len(parts))
    return matrix([RawTensor("dense", parts[0].dtype, shape, data.reshape(-1))], True)


def profile(shape: str, layers: int, mode: str, rows: int, repeats: int) -> dict[str, float]:
    """Median ms of each step for ``rows`` decode rows."""
    source = open_source(str(cached_gguf(shape, layers)))
    config = ModelConfig.from_hf(source.config)
    assert config.moe is not None
    c = config.moe
    backend = cpu_backend("q8" if mode == "q8" else "native")
    w: MoeWeights = load_moe(source, c, "layers.0.", blocks=True)
    layer = w.stacked
    assert layer is not None, "the compiled experts do not take this layer"
    dense = _dense(source, c.top_k)
    x = np.random.default_rng(rows).standard_normal((rows, config.hidden_size)).astype(np.float32)
    x *= 0.5
    sizes = [1] * rows
    logits = backend.linear(x, w.router, sizes)
    if w.router_bias is not None:
        logits = logits + w.router_bias
    picks, weights = (np.ascontiguousarray(a) for a in route(np, logits, c))
    chosen, starts, order = experts.group(picks)
    q8 = mode == "q8"
    compiled = experts._compiled()
    gu, dn = layer.gate_up, layer.down
    kernel = compiled.experts_kernel(
        (*gu.fmts, int(q8 and gu.q8())), (*dn.fmts, int(q8 and dn.q8()))
    )
    act = (layer.gate_up_bias, layer.down_bias, layer.kind, layer.alpha, layer.limit)
    ys = np.empty((rows * c.top_k, config.hidden_size), np.float32)
    out = np.empty_like(x)

    rule = (c.routing == "topk_softmax", c.norm_topk_prob)
    base = np.arange(rows * c.top_k).reshape(rows, c.top_k)  # [r, k]
    sets = [
        experts.group((base + c.top_k * i) % c.num_experts) for i in range(c.num_experts // c.top_k)
    ]
    turn = itertools.count()

    def cold() -> None:
        ch, st, od = sets[next(turn) % len(sets)]
        kernel(*gu.raws, *dn.raws, *act, x, ch, st, od, c.top_k, ys)

    def router() -> None:
        r = backend.linear(x, w.router, sizes)
        if w.router_bias is not None:
            r + w.router_bias

    steps: dict[str, Callable[[], Any]] = {
        "router": router,
        "route": lambda: route(np, logits, c),
        "group": lambda: experts.group(picks),
        "routed": lambda: experts.route(logits, c.top_k, *rule),
        "experts": lambda: kernel(*gu.raws, *dn.raws, *act, x, chosen, starts, order, c.top_k, ys),
        "sums": lambda: compiled.sums(ys, picks, weights, out),
        "layer": lambda: moe_mlp(backend, c, w, x, sizes),
        "dense": lambda: backend.linear(
            backend.glu(backend.linear(x, dense.gate_up), "silu"), dense.down
        ),
    }
    for fn in steps.values():
        fn()  # compiled and warm
    for _ in sets:  # every set's pages mapped: a first touch costs a page fault
        cold()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            times[name].append(_timed(fn))
    times["cold"] = [_timed(cold) for _ in range(repeats)]  # apart: it evicts the others
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    med["other"] = med["layer"] - sum(med[k] for k in ("router", "routed", "experts", "sums"))
    per_expert = 3 * config.hidden_size * c.expert_size  # weights of gate, up and down
    cold_held = min(c.num_experts, rows * c.top_k)
    for k, held in (("experts", chosen.size), ("cold", cold_held), ("dense", c.top_k)):
        med[f"{k} c/w"] = med[k] * 1e-3 * GHZ * 1e9 / (held * per_expert)
    return med


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--modes", nargs="+", default=["exact", "q8"], choices=["exact", "q8"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4, help="the cached file's depth")
    parser.add_argument("--attention", action="store_true", help="time attention instead")
    parser.add_argument("--context", type=int, default=1024, help="with --attention")
    args = parser.parse_args()
    set_kernel_threads(args.threads)
    if args.attention:
        for shape in args.shapes:
            moe_attention.run(shape, args.layers, args.context, args.repeats)
        moe_attention.gated(args.context, args.repeats)
        return
    cols = (*STEPS[:-1], "other", "dense", "experts c/w", "cold c/w", "dense c/w")
    print(f"median thread CPU ms per call, {args.threads} kernel thread(s), layer 0; c/w:")
    print(f"cycles a weight the chosen experts hold, at {GHZ} GHz")
    print(f"{'shape':<14} {'mode':<6} {'rows':>4} " + " ".join(f"{k:>11}" for k in cols))
    for shape in args.shapes:
        for mode in args.modes:
            for rows in args.rows:
                m = profile(shape, args.layers, mode, rows, args.repeats)
                cells = " ".join(f"{m[k]:>11.3f}" for k in cols)
                print(f"{shape:<14} {mode:<6} {rows:>4} {cells}", flush=True)


if __name__ == "__main__":
    main()
