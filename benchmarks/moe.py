"""Mixture-of-experts feed-forward cost: the routed experts against a dense MLP of the
same bytes read.

Run: ``.venv/bin/python benchmarks/moe.py [--experts 16] [--repeats 30] [--format Q8_0]``

One Qwen3-30B-A3B-shaped MoE feed-forward (hidden 2048, expert ffn 768, top-8) in GGUF
blocks (``--format``: Q8_0 or Q4_0, what gguf-py can quantize), one kernel thread. A
decode row reads its 8 experts whatever the number of experts, so ``--experts`` (default
16, not 128) only keeps the memory small. Side by side, alternating, medians of the
thread CPU time of ``--repeats`` calls (robust on a busy machine):

- ``moe_mlp`` on r rows (router, top-k, one product per chosen expert, weighted sum);
- a dense SwiGLU of ffn ``8 x 768`` (the bytes one row's experts hold), on the same rows.

With 1 row the two read the same bytes: the ratio is the cost of routing and of eight
products instead of one. With more rows the experts chosen by the rows differ, so MoE
reads more experts (up to all of them) and the ratio grows with what it reads.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode_packaging.sources import RawTensor

from meshnode.engine.backend import cpu_backend
from meshnode.engine.cpu import set_kernel_threads
from meshnode.engine.moe import expert_mlp, moe_mlp
from meshnode.engine.moe_config import MoeConfig
from meshnode.engine.moe_weights import ExpertWeights, MoeWeights, expert_slice, matrix

HIDDEN, EXPERT_FFN, TOP_K = 2048, 768, 8


def _blocks(rng: np.random.Generator, fmt: str, rows: int, cols: int, n: int = 1) -> RawTensor:
    """Random weights ``[n, rows, cols]`` (``[rows, cols]`` when n is 1) in ``fmt``."""
    w = (rng.standard_normal((n * rows, cols)) * 0.02).astype(np.float32)
    data = np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])).reshape(-1)
    shape = (n, rows, cols) if n > 1 else (rows, cols)
    return RawTensor("w", fmt, shape, data)


def _layers(experts: int, fmt: str) -> tuple[MoeWeights, ExpertWeights]:
    rng = np.random.default_rng(0)
    gate, up = (_blocks(rng, fmt, EXPERT_FFN, HIDDEN, experts) for _ in range(2))
    down = _blocks(rng, fmt, HIDDEN, EXPERT_FFN, experts)
    routed = tuple(
        ExpertWeights(
            matrix([expert_slice(gate, e), expert_slice(up, e)], True),
            matrix([expert_slice(down, e)], True),
        )
        for e in range(experts)
    )
    moe = MoeWeights(matrix([_blocks(rng, fmt, experts, HIDDEN)], True), None, routed)
    ffn = TOP_K * EXPERT_FFN
    dense = ExpertWeights(
        matrix([_blocks(rng, fmt, ffn, HIDDEN), _blocks(rng, fmt, ffn, HIDDEN)], True),
        matrix([_blocks(rng, fmt, HIDDEN, ffn)], True),
    )
    return moe, dense


def _median_ms(calls: list[float]) -> float:
    return 1e3 * statistics.median(calls)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--format", default="Q8_0", choices=["Q8_0", "Q4_0"])
    args = parser.parse_args()
    set_kernel_threads(1)
    moe, dense = _layers(args.experts, args.format)
    config = MoeConfig(args.experts, TOP_K, EXPERT_FFN, (True,), norm_topk_prob=True)
    backend = cpu_backend("native")
    print(f"{args.format}, {args.experts} experts, top-{TOP_K}, one kernel thread (ms)")
    print("rows  moe     dense   ratio")
    for rows in (1, 2, 4, 8):
        x = np.random.default_rng(rows).standard_normal((rows, HIDDEN)).astype(np.float32)
        routed = functools.partial(moe_mlp, backend, config, moe, x)
        plain = functools.partial(expert_mlp, backend, config, dense, x)
        routed(), plain()  # compiled and warm
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.repeats):
            times[0].append(_timed(routed))
            times[1].append(_timed(plain))
        a, b = _median_ms(times[0]), _median_ms(times[1])
        print(f"{rows:<5} {a:<7.2f} {b:<7.2f} {a / b:.2f}")


if __name__ == "__main__":
    main()
