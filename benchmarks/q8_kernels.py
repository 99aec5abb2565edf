"""Cycles per weight and activation row of the 8-bit-activation products (``--dtype q8``),
per format and number of rows: one row (decode), a few (8 streams, verify windows), and
the tiles of a prefill (issue 29).

Run: ``nice .venv/bin/python benchmarks/q8_kernels.py [--formats Q4_K Q6_K]
[--rows 1 8 64 512] [--out-rows 1024] [--rounds 5] [--ghz 2.5] [--stream-mib N]``

Each product is :func:`.q8_kernels.product_kernel`'s (tiled from ``TILE_MIN_ROWS`` rows,
as :func:`.q8.q8_product` chooses), called in this thread (no pool), so the figure is
this thread's CPU time (``time.thread_time``: another process on the same core does not
count) per weight and row, at the machine's nominal clock, the best of ``--rounds``. The
weights (``--out-rows`` x 2048, random blocks with finite scales) stay in the L2/L3: only
the timings mean anything. Also printed: each kernel's first call (its compile, with an
empty numba cache, in CPU seconds). ``--stream-mib N`` also times the products over
copies of the matrix filling N MiB (far past the L3), one after the other, as a decode
step streams its weights from memory: the best of each product's time over the copies
and rounds, per weight and row (the GB/s of weight bytes beside it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.exact_kernels import N_IN, random_raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--out-rows", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ghz", type=float, default=2.5)
    parser.add_argument("--stream-mib", type=int, default=0)
    args = parser.parse_args()

    from meshnode.engine.cpu import q8
    from meshnode.engine.cpu.formats import FORMATS

    kernels = q8._kernels()
    rng = np.random.default_rng(0)
    for name in args.formats:
        fmt = FORMATS[name].kernel_id
        w = random_raw(name, args.out_rows, rng)
        for k in args.rows:
            product = kernels.product_kernel(fmt, fmt, fmt, k >= kernels.TILE_MIN_ROWS)
            x = rng.standard_normal(k * N_IN).astype(np.float32)
            out = np.empty((k, args.out_rows), np.float32)
            start = time.process_time()
            product(w, w[:0], w[:0], x, out)
            first = time.process_time() - start
            reps, best = max(1, 2048 // k), float("inf")
            for _ in range(args.rounds):
                t0 = time.thread_time()
                for _ in range(reps):
                    product(w, w[:0], w[:0], x, out)
                best = min(best, (time.thread_time() - t0) / reps)
            cycles = best * args.ghz * 1e9 / (k * args.out_rows * N_IN)
            print(f"{name} {k:4d} rows: {cycles:.4f} cycles/weight/row  first call {first:.1f} s")
            if args.stream_mib:
                _streamed(product, w, x, out, args)


def _streamed(product: Any, w: np.ndarray, x: np.ndarray, out: np.ndarray, args: Any) -> None:
    """The product over copies of ``w`` filling ``--stream-mib``, each from memory."""
    copies = [w.copy() for _ in range(max(2, (args.stream_mib << 20) // w.nbytes))]
    best = float("inf")
    for _ in range(args.rounds):
        for c in copies:
            t0 = time.thread_time()
            product(c, c[:0], c[:0], x, out)
            best = min(best, time.thread_time() - t0)
    k = out.shape[0]
    cycles = best * args.ghz * 1e9 / (k * w.shape[0] * N_IN)
    print(f"  streamed: {cycles:.4f} cycles/weight/row, {w.nbytes / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
