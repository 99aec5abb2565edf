"""The float32 floor of an exact k-row product: why exact 8 rows cannot cost 1.5x one row here.

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/floor.py [--models smollm2
gemma3] [--rounds 7]``

The exact mode (the default) decodes each weight to float32 inside the kernel and multiplies
it in float32: one FMA per weight per activation row. So an 8-row product costs at least
the decode of every weight (paid once) plus eight FMAs per weight, where one row costs the
decode plus one. For every weight matrix of one stage holding the whole model (GGUF blocks,
one kernel thread), side by side in one run, this prints the median of:

- ``P1``, ``P8``: the exact products of all the stage's matrices times 1 and 8 rows;
- ``F8``: eight rows times as many float32 weights with no decode at all (the product
  kernel's own 4 x 4 register tile over four weight rows that stay in L1, the same shapes):
  the FMA work alone, at the core's best;

and the floor ``P1 + 7/8 F8`` (the one-row product plus the seven FMAs per weight an
8-row product adds; decode and FMA use the same vector ports, so they add up). Issue #13
asks for an 8-row forward ≤ 1.5x one row: if ``floor / P1`` is above 1.5, no exact kernel
reaches it on this CPU, and only the 8-bit-activation mode (``--dtype q8``: 64 int8 MACs
per instruction, against 16 float32 FMAs) can. The machine is shared: ``uptime`` is
printed first and last.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import models
from benchmarks.step import products
from meshnode.engine.backend import cpu_backend, limit_cpu_threads
from meshnode.engine.cpu import set_kernel_threads
from meshnode.engine.cpu.kernels import _dot4x4
from meshnode.engine.cpu.simd import wsum
from meshnode.engine.loader import load_model


@njit(cache=True)
def _fma_only(w, x, n_in, tiles, out):  # type: ignore[no-untyped-def]
    # eight activation rows times `tiles` tiles of four decoded weight rows (the same four,
    # L1-resident): the product kernel's FMAs for a matrix of 4 tiles rows, no decode
    # every lane of both tiles' sums used: summing two lanes let LLVM drop the chains of
    # the fourteen others (~1.9x the FMA rate there is, before 2026-12-01)
    s = np.float32(0.0)
    for _ in range(tiles):
        s += wsum(_dot4x4(w, x, 0, n_in)) + wsum(_dot4x4(w, x, 4, n_in))
    out[0] = s


def shapes(stage: Any) -> list[tuple[int, int]]:
    """(n_in, n_out) of every product a forward runs, the head's too."""
    w = stage.weights
    mats = [m for layer in w.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    mats.append(w.head_t if w.head_t is not None else w.embed_t)
    return [(int(m.shape[0]), int(m.shape[1])) for m in mats]


def fma_only(dims: list[tuple[int, int]]) -> Any:
    rng = np.random.default_rng(0)
    bufs = {
        n_in: (
            rng.standard_normal(4 * n_in).astype(np.float32),
            rng.standard_normal(8 * n_in).astype(np.float32),
        )
        for n_in, _ in dims
    }
    out = np.zeros(1, np.float32)

    def run() -> None:
        for n_in, n_out in dims:
            w, x = bufs[n_in]
            _fma_only(w, x, n_in, n_out // 4, out)

    return run


def measure(name: str, path: Path, rounds: int) -> None:
    model = load_model(str(path), cpu_backend("native"))
    dims = shapes(model.stage)
    runs = {"P1": products(model.stage, 1), "P8": products(model.stage, 8), "F8": fma_only(dims)}
    for run in runs.values():  # warm-up: compiled code loaded
        run()
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            began = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - began)
    ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    floor = ms["P1"] + 7 / 8 * ms["F8"]
    weights = sum(n_in * n_out for n_in, n_out in dims)
    print(
        f"{name}: {weights / 1e6:.1f}M weights, 1 thread: P1 {ms['P1']:.2f} ms, "
        f"P8 {ms['P8']:.2f} ms ({ms['P8'] / ms['P1']:.2f}x P1); F8 {ms['F8']:.2f} ms "
        f"({8 * weights / ms['F8'] / 1e6:.0f} GFMA/s); floor P1 + 7/8 F8 = {floor:.2f} ms "
        f"(**{floor / ms['P1']:.2f}x P1**)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=["smollm2", "gemma3"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print("uptime:", uptime(), flush=True)
    limit_cpu_threads(1)
    set_kernel_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for key, (name, path, why) in zip(["smollm2", "gemma3"], models(Path(tmp)), strict=True):
            if args.models and key not in args.models:
                continue
            if path is None:
                print(f"{name}: skipped ({why})")
                continue
            measure(name, path, args.rounds)
    print("uptime:", uptime())


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
