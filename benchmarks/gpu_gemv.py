"""The CUDA matrix-vector kernel alone, on the Llama-3.1-8B shape's matrices (issue 33).

A decode step on the GPU is mostly this kernel reading every weight once: the issue's goal
(decode on the 8B shape at >= 60 % of a device-to-device copy's bandwidth) cannot be met
unless the kernel alone comes close. For each weight format kept on the device and each
matrix of one 8B layer (the fused QKV, O, the fused gate and up, down) and the head, one
row (decode) and 8 rows (8 streams batched), one line: device microseconds per call
(CUDA events over back-to-back launches after a warm-up), the weight bytes read per
second, and that against a copy measured in the same run. A last line per format and row
count sums one layer's four matrices, what a decode step reads 32 times.

Run on the GPU machine (``scripts/gpu-check.sh`` does, before the whole-model benchmark):
``python3 benchmarks/gpu_gemv.py`` (``--formats f16,q8_0``, ``--rows 1``, ``--reps N``).
Weights are random (finite float16 scales): only the timings mean anything.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, cast, get_args

import numpy as np

from meshnode.engine.backend import BackendError, select_backend
from meshnode.engine.cuda.device import DeviceMatrix, kernels_for
from meshnode.engine.cuda.formats import Format, row_bytes

# (name, out, in) of one Llama-3.1-8B layer's matrices as the CUDA stage holds them (Q, K
# and V fused; gate and up fused), and the head (the embedding's size)
SHAPES: list[tuple[str, int, int]] = [
    ("qkv", 4096 + 2 * 1024, 4096),
    ("o", 4096, 4096),
    ("gate_up", 2 * 14336, 4096),
    ("down", 4096, 14336),
    ("head", 128256, 4096),
]
LAYER = ("qkv", "o", "gate_up", "down")
FORMATS: tuple[Format, ...] = ("f16", "q8_0", "q4_k")


def random_rows(fmt: Format, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    """``out`` rows of random bytes in ``fmt`` whose float16 scales are finite."""
    width = row_bytes(fmt, inp)
    rows = rng.integers(0, 256, (out, width), dtype=np.uint8)
    half = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if fmt == "f16":  # every value a small finite float16
        rows = rng.standard_normal((out, inp), dtype=np.float32).astype(np.float16)
        return rows.view(np.uint8).reshape(out, width)
    if fmt == "q8_0":
        blocks = rows.reshape(out, -1, 34)
        blocks[..., 0:2] = half
    elif fmt == "q4_k":
        blocks = rows.reshape(out, -1, 144)
        blocks[..., 0:2] = half  # d
        blocks[..., 2:4] = half  # dmin
    return rows


def time_gemv(cp: Any, w: DeviceMatrix, rows: int, reps: int) -> float:
    """Device seconds of one ``gemv`` of ``rows`` rows against ``w``."""
    k = kernels_for(cp)
    x = cp.asarray(np.random.default_rng(1).standard_normal((rows, w.in_features), np.float32))
    y = cp.empty((rows, w.out_features), cp.float32)
    for _ in range(3):
        k.gemv(w, x, y)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        k.gemv(w, x, y)
    end.record()
    end.synchronize()
    if not bool(cp.isfinite(y).all()):
        raise RuntimeError(f"gemv {w.fmt} {w.out_features}x{w.in_features}: non-finite output")
    return float(cp.cuda.get_elapsed_time(start, end)) / 1e3 / reps


def copy_bandwidth(cp: Any, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    cp.copyto(dst, src)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        cp.copyto(dst, src)
    end.record()
    end.synchronize()
    return 2 * nbytes * reps / (float(cp.cuda.get_elapsed_time(start, end)) / 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS), help="f16, q8_0 and/or q4_k")
    parser.add_argument("--rows", default="1,8", help="activation rows of a call: 1,8")
    parser.add_argument("--reps", type=int, default=20, help="timed launches of each")
    args = parser.parse_args(argv)
    try:
        backend = select_backend("cuda", "float16")
    except BackendError as exc:
        print(f"benchmarks/gpu_gemv.py: needs a CUDA device ({exc})")
        return 2
    cp = backend.xp
    bw = copy_bandwidth(cp)
    print(f"device: {backend.describe()}; copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| format | matrix | out x in | rows | us / call | GB/s | % copy |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name_ in args.formats.split(","):
        if name_ not in get_args(Format):
            parser.error(f"unknown format {name_!r}")
        fmt = cast(Format, name_)
        mats = {
            name: DeviceMatrix(cp.asarray(random_rows(fmt, out, inp, rng)), fmt, out, inp)
            for name, out, inp in SHAPES
        }
        for rows in (int(r) for r in args.rows.split(",")):
            layer_bytes = layer_seconds = 0.0
            for name, w in mats.items():
                seconds = time_gemv(cp, w, rows, args.reps)
                rate = w.nbytes / seconds
                if name in LAYER:
                    layer_bytes, layer_seconds = layer_bytes + w.nbytes, layer_seconds + seconds
                shape = f"{w.out_features}x{w.in_features}"
                print(
                    f"| {fmt} | {name} | {shape} | {rows} | {seconds * 1e6:.1f} |"
                    f" {rate / 1e9:.0f} | {100 * rate / bw:.0f} % |"
                )
            rate = layer_bytes / layer_seconds
            print(
                f"| {fmt} | one layer | - | {rows} | {layer_seconds * 1e6:.1f} |"
                f" {rate / 1e9:.0f} | {100 * rate / bw:.0f} % |"
            )
        del mats
    return 0


if __name__ == "__main__":
    sys.exit(main())
