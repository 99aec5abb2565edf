"""Where an exact k-row product's time goes on AVX2 (issue 29): :mod:`.narrow`'s pass whole,
its decode of the weight blocks alone, and its register tiles alone, per format.

Run: ``nice .venv/bin/python benchmarks/narrow_parts.py [--formats Q4_K Q6_K] [--rows 8]
[--rounds 7] [--ghz 2.45] [--offsets 0 16]``

Each part runs in this thread over one matrix of 256 x 2048 weights (in the L2), alternating
part by part each round; the figure is the least thread CPU time (``time.thread_time``) of
the rounds, in cycles a weight at ``--ghz`` (the nominal clock: the core's own may differ),
beside the FMA bound of the tiles (``k`` rows x one FMA a weight, eight lanes, two FMAs a
cycle: ``k / 16``). "decode" is :func:`.narrow.block_decoder`'s (the format's decoder:
Q8_0 :mod:`.q8_0_exact`'s, MXFP4 :mod:`.fp4_exact`'s where the CPU has the byte
shuffles, the others :mod:`.groups`') over every block of every pass; "tiles" the tiles
over a decoded block, again and again, with no decode; "whole" is :func:`.narrow.k_rows`,
prefetches and sums included. The weights are random blocks: only
the timings mean anything.

``--offsets`` times "whole" instead with the activations and the scratch each beginning
that many bytes into a 64-byte line (every pair): at 16 or 48, every other 32-byte load
of them straddles two lines (the cost :func:`.kernels._lined` and
:func:`.matrix._lined` avoid: NumPy's arrays are 16-byte aligned). :func:`.narrow.k_rows`
is called directly here, with the scratch as given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.exact_kernels import random_raw

N_IN, N_OUT = 2048, 256


def parts(fid: int) -> dict[str, Any]:
    """The three parts of format ``fid``'s pass, compiled (``fid`` a compile-time constant)."""
    from numba import njit, types

    from meshnode.engine.cpu.kernels import K_ROWS, _quads_any
    from meshnode.engine.cpu.narrow import BLOCK, _tiles, block_decoder

    decode_block = block_decoder(types.literal(fid))  # type: ignore[no-untyped-call]

    @njit
    def whole(raw, x, out, w):  # type: ignore[no-untyped-def]
        _quads_any(fid, 8, K_ROWS, raw, x, out, 0, raw.shape[0], 0, w, N_IN)

    @njit
    def decode(raw, x, out, w):  # type: ignore[no-untyped-def]
        for o in range(0, raw.shape[0] - 3, 4):
            for j0 in range(0, N_IN, BLOCK):
                decode_block(fid, raw, o, w, j0, BLOCK)

    @njit
    def tiles(raw, x, out, w):  # type: ignore[no-untyped-def]
        for _ in range(0, raw.shape[0] - 3, 4):
            for j0 in range(0, N_IN, BLOCK):
                _tiles(w.ctypes.data, x.ctypes.data, out.shape[0], N_IN, j0, BLOCK)

    return {"whole": whole, "decode": decode, "tiles": tiles}


def at_offset(n: int, offset: int) -> np.ndarray:
    """``n`` float32 zeros beginning ``offset`` bytes (a multiple of 4) into a 64-byte line."""
    buf = np.zeros(n + 32, np.float32)
    start = ((-(buf.ctypes.data // 4)) % 16 + offset // 4) % 16
    return buf[start : start + n]


def offsets(args: Any) -> None:
    """The whole pass at each pair of the activations' and the scratch's offsets."""
    from meshnode.engine.cpu.formats import FORMATS

    print(f"load: {os.getloadavg()}", flush=True)
    rng = np.random.default_rng(0)
    k = args.rows
    for name in args.formats:
        raw = random_raw(name, N_OUT, rng)
        whole = parts(FORMATS[name].kernel_id)["whole"]
        values = rng.standard_normal(k * N_IN).astype(np.float32)
        setups = {}
        for xo in args.offsets:
            for wo in args.offsets:
                x = at_offset(k * N_IN, xo)
                x[:] = values
                setups[f"x+{xo} scratch+{wo}"] = (x, at_offset(4 * N_IN, wo))
        out = np.zeros((k, N_OUT), np.float32)
        for x, w in setups.values():
            whole(raw, x, out, w)
        best = dict.fromkeys(setups, float("inf"))
        for _ in range(args.rounds):
            for key, (x, w) in setups.items():
                t0 = time.thread_time()
                for _ in range(args.calls):
                    whole(raw, x, out, w)
                best[key] = min(best[key], (time.thread_time() - t0) / args.calls)
        per = args.ghz * 1e9 / (N_OUT * N_IN)
        cells = "  ".join(f"{key} {s * per:.3f}" for key, s in best.items())
        print(f"{name} {k} rows, whole, cycles/weight: {cells}", flush=True)
    print(f"load: {os.getloadavg()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K"])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="calls a part a round")
    p.add_argument("--ghz", type=float, default=2.45)
    p.add_argument("--offsets", nargs="*", type=int, default=[], help="bytes into a line")
    args = p.parse_args()
    if args.offsets:
        offsets(args)
        return
    from meshnode.engine.cpu.formats import FORMATS

    print(f"load: {os.getloadavg()}", flush=True)
    rng = np.random.default_rng(0)
    k = args.rows
    for name in args.formats:
        raw = random_raw(name, N_OUT, rng)
        x = rng.standard_normal(k * N_IN).astype(np.float32)
        out = np.zeros((k, N_OUT), np.float32)
        w = np.zeros(4 * N_IN, np.float32)
        fns = parts(FORMATS[name].kernel_id)
        for fn in fns.values():  # compiled; the scratch holds a decoded block for "tiles"
            fn(raw, x, out, w)
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.rounds):
            for part, fn in fns.items():
                t0 = time.thread_time()
                for _ in range(args.calls):
                    fn(raw, x, out, w)
                best[part] = min(best[part], (time.thread_time() - t0) / args.calls)
        cells = "  ".join(
            f"{part} {s * args.ghz * 1e9 / (N_OUT * N_IN):.3f}" for part, s in best.items()
        )
        print(f"{name} {k} rows, cycles/weight: {cells}  (FMA bound {k / 16:.3f})", flush=True)
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
