"""One decode row through the gpt-oss-20b shape's products, streamed from memory: MXFP4
experts and Q8_0 attention/head matrices, 8-bit activations (``--dtype q8``) and exact.

Run: ``OPENBLAS_NUM_THREADS=1 nice .venv/bin/python benchmarks/mxfp4_products.py
[--formats MXFP4 Q8_0] [--modes q8 exact] [--n-in 2880] [--out-rows 2880]
[--rows 1] [--stream-mib 256] [--rounds 5] [--compare DIR] [--tree DIR]``

Each product (one activation row, ``--n-in`` inputs, ``--out-rows`` outputs, the
product kernel called in this thread: no pool) runs over copies of its matrix filling
``--stream-mib`` (past the L3), one after the other, as a decode step streams its
weights: the figure is this thread's CPU time per copy (``time.thread_time``: another
process on the same core does not count), the median and the best over copies and
``--rounds``, and the weight bytes' GB/s at the best. The weights are random blocks with
finite scales (MXFP4: E8M0 bytes 118-127, Q8_0: float16 scales below 0.05); only the
timings mean anything. ``--tree DIR`` imports meshnode from another checkout (``git
archive`` of an older commit). ``--compare DIR`` runs this driver ``--rounds`` times in
alternating subprocesses, this checkout's and DIR's, one round each, so that both meet
the same load; each line is one round's result.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]
if "--tree" in sys.argv:  # before meshnode is imported
    TREE = Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()
    sys.path[:0] = [str(TREE), str(TREE / "protocol"), str(TREE / "packaging")]


def random_blocks(dtype: str, rows: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, row bytes]`` of random ``dtype`` blocks with finite, model-like scales."""
    from meshnode.engine.cpu.formats import FORMATS

    fmt = FORMATS[dtype]
    blocks = rng.integers(0, 256, (rows * n_in // fmt.block_size, fmt.type_size), np.uint8)
    if dtype == "MXFP4":
        blocks[:, 0] = rng.integers(118, 128, len(blocks), np.uint8)
    elif dtype == "Q8_0":
        scale = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, 0:2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def run(args: argparse.Namespace) -> None:
    import meshnode
    from meshnode.engine.cpu import q8
    from meshnode.engine.cpu.formats import FORMATS
    from meshnode.engine.cpu.matrix import kernels

    rng = np.random.default_rng(0)
    x = rng.standard_normal(args.rows * args.n_in).astype(np.float32)
    out = np.empty((args.rows, args.out_rows), np.float32)
    where = Path(meshnode.__file__).parent.parent
    for dtype in args.formats:
        fmt = FORMATS[dtype].kernel_id
        one = random_blocks(dtype, args.out_rows, args.n_in, rng)
        copies = [one] + [
            random_blocks(dtype, args.out_rows, args.n_in, rng)
            for _ in range(max(1, (args.stream_mib << 20) // one.nbytes) - 1)
        ]
        empty = one[:0]
        for mode in args.modes:
            module = q8._kernels() if mode == "q8" else kernels()
            product = module.product_kernel(fmt, fmt, fmt)
            product(one, empty, empty, x, out)  # compiled
            times = []
            for _ in range(args.rounds):
                for c in copies:
                    t0 = time.thread_time()
                    product(c, empty, empty, x, out)
                    times.append(time.thread_time() - t0)
            best, med = min(times), statistics.median(times)
            weights = args.n_in * args.out_rows
            print(
                f"{where.name:<14} {dtype:<6} {mode:<5} {args.rows} rows "
                f"{args.n_in}x{args.out_rows}: "
                f"median {1e3 * med:7.3f} ms  best {1e3 * best:7.3f} ms  "
                f"{one.nbytes / best / 1e9:5.2f} GB/s (best)  "
                f"{one.nbytes / med / 1e9:5.2f} (median)  "
                f"{best * args.ghz * 1e9 / weights:5.3f} cycles a weight (best, "
                f"{args.ghz} GHz)",
                flush=True,
            )


def compare(args: argparse.Namespace, argv: list[str]) -> None:
    """Alternate one-round subprocesses of this checkout and ``--compare``'s."""
    rest, skip = [], False
    for a in argv:  # drop --compare DIR and --rounds N: each subprocess runs one round
        if skip:
            skip = False
            continue
        if a in ("--compare", "--rounds"):
            skip = True
            continue
        rest.append(a)
    me = [sys.executable, str(Path(__file__).resolve()), *rest, "--rounds", "1"]
    with open("/proc/loadavg") as f:
        print("load", f.read().strip(), flush=True)
    for _ in range(args.rounds):
        for extra in ([], ["--tree", args.compare]):
            subprocess.run([*me, *extra], check=True)
    with open("/proc/loadavg") as f:
        print("load", f.read().strip(), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["MXFP4", "Q8_0"])
    p.add_argument("--modes", nargs="+", default=["q8", "exact"], choices=["q8", "exact"])
    p.add_argument("--n-in", type=int, default=2880)
    p.add_argument("--out-rows", type=int, default=2880)
    p.add_argument("--rows", type=int, default=1, help="activation rows a product")
    p.add_argument("--ghz", type=float, default=2.45, help="the clock, for cycles a weight")
    p.add_argument("--stream-mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compare", help="another checkout to alternate with, one round each")
    p.add_argument("--tree", help="import meshnode from this checkout")
    args = p.parse_args()
    if args.compare:
        compare(args, sys.argv[1:])
        return
    if not args.tree:
        sys.path[:0] = [str(HERE), str(HERE / "protocol"), str(HERE / "packaging")]
    run(args)


if __name__ == "__main__":
    main()
