"""Long (prefill) products of the exact mode side by side, in GFLOP/s: the compiled GEMM
(:mod:`meshnode.engine.cpu.gemm`, one order per sum, no BLAS), the decoded tiles through
sgemm (:func:`.tiles.product_tile`: exact only where this BLAS's rows are independent,
:func:`.tiles.rows_independent`) and the few-row kernels over every row (the AVX2
fallback before the GEMM), issue 29.

Run: ``nice .venv/bin/python benchmarks/gemm_products.py [--rows 64 256 512]
[--shapes Q4_K:2048x2048 Q6_K:8192x2048] [--paths gemm sgemm kernels] [--rounds 3]
[--tiles 384x2048 64x14336]``

A shape ``FMT:INxOUT`` is a matrix of ``OUT`` rows of ``IN`` weights. One thread, no
pool: each product runs its tiles one after another in this thread, timed by its CPU
time (``time.thread_time``: another process on the core does not count); the paths
alternate within each round, and the table shows the best round of each (the figure
least disturbed by other load). FLOPs are ``2 x rows x IN x OUT``; the decode is part of
every path's time. Random blocks (finite scales): only the timings mean anything.

It prints first this core's FMA peak (:func:`peak`: independent chains of sixteen-lane
FMAs in registers, the best of five runs' wall time), and ``--tiles ROWSxK`` times
:func:`meshnode.engine.cpu.gemm.product` alone on float32 tiles of those shapes (what a
decoded tile costs, no decode), as GFLOP/s and a share of that peak: the 1B shape's
tiles are 384 x 2048 (q/k/v), 256 x 2048 (the output), 512 x 2048 (gate/up) and 128 x
8192 (down); the 8B shape's 256 x 4096 and 64 x 14336 (down).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.exact_kernels import random_raw

PATHS = ("gemm", "sgemm", "kernels")


def products(dtype: str, raw: np.ndarray, n_in: int) -> dict[str, Callable[..., None]]:
    """Each path's ``fn(x, out)``: ``out = x @ raw's rows``, serially in this thread."""
    from meshnode.engine.cpu import gemm, tiles
    from meshnode.engine.cpu.formats import FORMATS
    from meshnode.engine.cpu.matrix import DENSE_TILE_BYTES, GEMM_TILE_BYTES, kernels

    fid = FORMATS[dtype].kernel_id
    parts = [(fid, raw)]
    bounds = tiles.tiles(raw.shape[0], n_in, DENSE_TILE_BYTES)
    gemm_bounds = tiles.tiles(raw.shape[0], n_in, GEMM_TILE_BYTES)
    empty = np.empty((0, 0), np.uint8)
    product = kernels().product_kernel(fid, fid, fid)

    def by_gemm(x: np.ndarray, out: np.ndarray) -> None:
        panels = gemm.packed(x)
        for lo, hi in gemm_bounds:
            tiles.gemm_tile(parts, panels, x.shape[0], out, lo, hi)

    def by_sgemm(x: np.ndarray, out: np.ndarray) -> None:
        for lo, hi in bounds:
            tiles.product_tile(parts, x, out, lo, hi)

    def by_kernels(x: np.ndarray, out: np.ndarray) -> None:
        product(raw, empty, empty, x.reshape(-1), out)

    return {"gemm": by_gemm, "sgemm": by_sgemm, "kernels": by_kernels}


def peak() -> float:
    """GFLOP/s of this core's FMA pipes (two a multiply-add): :func:`.realsize.fma_peak`
    at one thread."""
    from benchmarks.realsize import fma_peak

    return 2 * fma_peak(1)


def time_tiles(shapes: list[str], rows: int, rounds: int, top: float) -> None:
    """:func:`.gemm.product` alone on float32 tiles ``NxK``, ``rows`` activation rows."""
    from meshnode.engine.cpu import gemm

    rng = np.random.default_rng(1)
    for shape in shapes:
        n_w, n_in = map(int, shape.split("x"))
        xp = gemm.packed(rng.standard_normal((rows, n_in)).astype(np.float32))
        w = rng.standard_normal(n_w * n_in).astype(np.float32)
        out = np.empty((rows, n_w), np.float32)
        gemm.product(xp, rows, w, n_in, 1, n_w, out, 0)
        best = np.inf
        for _ in range(rounds):
            began = time.thread_time()
            gemm.product(xp, rows, w, n_in, 1, n_w, out, 0)
            best = min(best, time.thread_time() - began)
        gflops = 2 * rows * n_in * n_w / best / 1e9
        print(f"tile {shape:<12} {rows:>5} rows {gflops:9.1f} GFLOP/s, {gflops / top:.0%} of peak")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["Q4_K:2048x2048", "Q6_K:8192x2048"])
    p.add_argument("--rows", nargs="+", type=int, default=[64, 256, 512])
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiles", nargs="*", default=[], help="float32 tiles NxK, gemm.product alone")
    args = p.parse_args()
    from meshnode.engine.cpu import tiles

    tiles.single_threaded_blas()
    rng = np.random.default_rng(0)
    print(f"load: {os.getloadavg()}, rows independent: {tiles.rows_independent()}", flush=True)
    top = peak()
    print(f"FMA peak of this core: {top:.1f} GFLOP/s", flush=True)
    for rows in args.rows if args.tiles else []:
        time_tiles(args.tiles, rows, max(3, args.rounds), top)
    print(f"{'shape':<16} {'rows':>5} " + " ".join(f"{n:>9}" for n in args.paths) + "  GFLOP/s")
    for shape in args.shapes:
        dtype, dims = shape.split(":")
        n_in, n_out = map(int, dims.split("x"))
        fns = products(dtype, random_raw(dtype, n_out, rng, n_in), n_in)
        for rows in args.rows:
            x = rng.standard_normal((rows, n_in)).astype(np.float32)
            out = np.empty((rows, n_out), np.float32)
            best = dict.fromkeys(args.paths, np.inf)
            for name in args.paths:
                fns[name](x, out)  # compiled, warm
            for _ in range(args.rounds):
                for name in args.paths:
                    start = time.thread_time()
                    fns[name](x, out)
                    best[name] = min(best[name], time.thread_time() - start)
            flops = 2 * rows * n_in * n_out / 1e9
            cells = " ".join(f"{flops / best[n]:9.1f}" for n in args.paths)
            print(f"{shape:<16} {rows:>5} {cells}", flush=True)
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
