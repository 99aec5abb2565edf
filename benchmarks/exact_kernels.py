"""Cycles per weight of the exact-mode (float32-activation) block products, per format: one
activation row and eight, with the weights in cache and streamed from memory (issue 29).

Run: ``nice .venv/bin/python benchmarks/exact_kernels.py [--formats Q4_K Q6_K ...]
[--rounds 5] [--stat min] [--baseline DIR]``

Each product is :func:`.kernels.product_kernel`'s, called in this thread (no pool), so the
figure is this thread's CPU time (``time.thread_time``: another process on the same core
does not count) per weight, at the machine's nominal clock (``--ghz``, 2.5 by default).
"In cache": one matrix of 256 x 2048 weights, multiplied again and again (the L2 holds it);
"stream": matrices of ``--stream-mib`` MiB in all (past the L3), multiplied in turn.

``--baseline DIR`` runs this same script with ``DIR`` (another checkout, e.g. ``git
archive da66669 | tar -x -C /tmp/base``) first on the path, in alternating rounds with
this tree, each in its own process and its own numba cache; it prints both trees' median
(or, ``--stat min``, the least of the rounds: the figure least disturbed by other load)
and the ratio. The weights are random blocks (finite scales): only the timings mean
anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

N_IN = 2048
CACHE_ROWS = 256
FORMATS = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q4_1", "F32"]
# Byte offsets of the float16 scales in a block, as tests/engine/test_cpu_kernels.py
_F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def random_raw(dtype: str, n_out: int, rng: np.random.Generator, n_in: int = N_IN) -> np.ndarray:
    """``[n_out, row bytes]`` of random blocks of ``dtype`` with finite scales, rows of
    ``n_in`` values."""
    from meshnode.engine.cpu.formats import FORMATS as ALL

    if dtype == "F32":
        return rng.standard_normal((n_out, n_in)).astype(np.float32).view(np.uint8)
    fmt = ALL[dtype]
    blocks = rng.integers(0, 256, (n_out * n_in // fmt.block_size, fmt.type_size), np.uint8)
    for off in _F16_FIELDS.get(dtype, ()):
        scale = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_out, -1)


def measure(
    formats: list[str], rows: list[int], stream_mib: int, seconds: float
) -> dict[str, float]:
    """``{"FMT k cache|stream": seconds per weight}`` in this process."""
    from meshnode.engine.cpu.formats import FORMATS as ALL
    from meshnode.engine.cpu.matrix import kernels

    rng = np.random.default_rng(0)
    empty = np.empty((0, 0), np.uint8)
    got: dict[str, float] = {}
    for dtype in formats:
        product = kernels().product_kernel(ALL[dtype].kernel_id, 0, 0)
        small = random_raw(dtype, CACHE_ROWS, rng)
        row_bytes = small.shape[1]
        n_stream = max(1, (stream_mib << 20) // (row_bytes * 4096))
        big = [random_raw(dtype, 4096, rng) for _ in range(n_stream)]
        for k in rows:
            x = rng.standard_normal(k * N_IN).astype(np.float32)
            for where, mats in (("cache", [small]), ("stream", big)):
                out = np.empty((k, mats[0].shape[0]), np.float32)
                product(mats[0], empty, empty, x, out)  # compiled, warm
                weights, spent, start = 0, 0.0, time.monotonic()
                while time.monotonic() - start < seconds:
                    t0 = time.thread_time()
                    for m in mats:
                        product(m, empty, empty, x, out)
                    spent += time.thread_time() - t0
                    weights += sum(m.shape[0] for m in mats) * N_IN
                got[f"{dtype} {k} {where}"] = spent / weights
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.5, help="per figure per round")
    p.add_argument("--stream-mib", type=int, default=96)
    p.add_argument("--ghz", type=float, default=2.5)
    p.add_argument("--stat", choices=["median", "min"], default="median", help="over rounds")
    p.add_argument("--baseline", type=Path, help="another checkout to time alternately")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        got = measure(args.formats, args.rows, args.stream_mib, args.seconds)
        print(json.dumps(got))
        return
    here = Path(__file__).resolve().parents[1]
    trees = {"new": here} | ({"old": args.baseline.resolve()} if args.baseline else {})
    caches = {name: tempfile.mkdtemp(prefix=f"exact-kernels-{name}-") for name in trees}
    print(f"load: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, NUMBA_CACHE_DIR=caches[name])
            paths = (str(tree / part) for part in ("", "protocol", "packaging"))
            env["PYTHONPATH"] = os.pathsep.join(paths)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--formats",
                   *args.formats, "--rows", *map(str, args.rows), "--seconds",
                   str(args.seconds), "--stream-mib", str(args.stream_mib)]  # fmt: skip
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[name].append(json.loads(done.stdout.splitlines()[-1]))
    report(results, args.ghz, args.stat)
    print(f"load: {os.getloadavg()}")


def report(results: dict[str, list[dict[str, float]]], ghz: float, stat: str) -> None:
    pick = np.min if stat == "min" else np.median

    def figure(name: str, key: str) -> float:
        return float(pick([r[key] for r in results[name]])) * ghz * 1e9

    keys = list(results["new"][0])
    label = f"cycles/weight ({stat})"
    head = f"{label} " + "  ".join(f"{n:>6}" for n in results)
    print(head + ("   old/new" if "old" in results else ""))
    for key in keys:
        cells = [figure(n, key) for n in results]
        line = f"{key:<{len(label)}} " + "  ".join(f"{c:6.3f}" for c in cells)
        if "old" in results:
            line += f"   {cells[1] / cells[0]:6.2f}x"
        print(line)


if __name__ == "__main__":
    main()
