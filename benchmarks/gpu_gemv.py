"""The CUDA matrix-vector kernel alone, on the Llama-3.1-8B shape's matrices (issue 33).

A decode step on the GPU is mostly this kernel reading every weight once: the issue's goal
(decode on the 8B shape at >= 60 % of a device-to-device copy's bandwidth) cannot be met
unless the kernel alone comes close. For each weight format kept on the device and each
matrix of one 8B layer (the fused QKV, O, the fused gate and up, down) and the head, one
row (decode) and 8 rows (8 streams batched), one line: device microseconds per call
(CUDA events over back-to-back launches after a warm-up), the weight bytes read per
second, and that against a copy measured in the same run. A last line per format and row
count sums one layer's four matrices, what a decode step reads 32 times.

Beside the engine's kernel (``w4``: a warp per output feature, four a block), the same
run times variants compiled from the same source, so a lease on a GPU can pick the best
in one call: ``w2`` and ``w8`` (two or eight warps a block, ``-DMN_GEMV_WARPS``), and
``block64``, the layout the first H200 run measured (a block of 64 threads per output
feature, summed through shared memory; it decodes with today's vector loads). The ratio
column is the engine's kernel's speed over ``block64``'s.

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
from meshnode.engine.cuda import kernels
from meshnode.engine.cuda.device import DeviceMatrix, kernels_for
from meshnode.engine.cuda.formats import CPP_NAME, Format, row_bytes

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
# warps a block of each variant compiled beside the engine's (its own, w4, is kernels_for's)
WIDTHS = {"w2": 2, "w8": 8}
# The first H200 run's layout: a block of 64 threads per output feature, each thread a
# unit at a time, the block's sum through shared memory (kernels.block_sum).
BLOCK64 = r"""
template <typename F>
__global__ void gemv_block64(
    const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
    int rows, int in, int out) {
    __shared__ float red[MN_BLOCK];
    const i64 o = blockIdx.x;
    const u8* row = w + o * F::row_bytes(in);
    for (int r0 = 0; r0 < rows; r0 += MN_MAX_ROWS) {
        const int group = rows - r0 < MN_MAX_ROWS ? rows - r0 : MN_MAX_ROWS;
        const float* xg = x + (i64)r0 * in;
        float acc[MN_MAX_ROWS];
        for (int r = 0; r < MN_MAX_ROWS; ++r) acc[r] = 0.0f;
        for (int u = threadIdx.x; u < in / MN_UNIT; u += blockDim.x) {
            float wu[MN_UNIT];
            unit<F>(row, u, wu);
#pragma unroll
            for (int r = 0; r < MN_MAX_ROWS; ++r) {
                if (r < group) {
                    const float* xr = xg + (i64)r * in + (i64)u * MN_UNIT;
                    float s = 0.0f;
                    for (int j = 0; j < MN_UNIT; ++j) s += wu[j] * xr[j];
                    acc[r] += s;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < MN_MAX_ROWS; ++r) {
            if (r < group) {
                const float total = block_sum(acc[r], red);
                if (threadIdx.x == 0) y[(i64)(r0 + r) * out + o] = total;
            }
        }
    }
}
"""
VARIANTS = ("w4", *WIDTHS, "block64")


class Variants:
    """Launchers ``name -> (w, x, y)`` of every variant's gemv."""

    def __init__(self, cp: Any) -> None:
        self._cp = cp
        fmts = list(CPP_NAME.values())
        self._modules: dict[str, Any] = {
            name: cp.RawModule(
                code=kernels.SOURCE,
                options=(f"-DMN_GEMV_WARPS={warps}",),
                name_expressions=[f"gemv<{f}, {r}>" for f in fmts for r in kernels.GEMV_ROWS],
            )
            for name, warps in WIDTHS.items()
        }
        self._modules["block64"] = cp.RawModule(
            code=kernels.SOURCE + BLOCK64, name_expressions=[f"gemv_block64<{f}>" for f in fmts]
        )

    def launch(self, name: str, w: DeviceMatrix, x: Any, y: Any) -> None:
        """One gemv of variant ``name`` (the engine's own for ``w4``)."""
        if name == "w4":
            kernels_for(self._cp).gemv(w, x, y)
            return
        rows, cpp = x.shape[0], CPP_NAME[w.fmt]
        args = (w.data, x, y, np.int32(rows), np.int32(w.in_features), np.int32(w.out_features))
        if name == "block64":
            fn = self._modules[name].get_function(f"gemv_block64<{cpp}>")
            fn((w.out_features,), (64,), args)
            return
        warps = WIDTHS[name]
        fn = self._modules[name].get_function(f"gemv<{cpp}, {kernels.gemv_rows(rows)}>")
        fn((-(-w.out_features // warps),), (32 * warps,), args)


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


def time_gemv(
    cp: Any, variants: Variants, name: str, w: DeviceMatrix, x: Any, reps: int
) -> tuple[float, Any]:
    """Device seconds of one gemv of variant ``name`` of ``x`` against ``w``, and its
    output."""
    y = cp.empty((x.shape[0], w.out_features), cp.float32)
    for _ in range(3):
        variants.launch(name, w, x, y)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        variants.launch(name, w, x, y)
    end.record()
    end.synchronize()
    return float(cp.cuda.get_elapsed_time(start, end)) / 1e3 / reps, y


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


def _line(
    fmt: str, matrix: str, shape: str, rows: int, seconds: dict[str, float], nbytes: int, bw: float
) -> str:
    """One row of the table: each variant's microseconds, w4's rate and ratio."""
    rate = nbytes / seconds["w4"]
    us = " | ".join(f"{seconds[v] * 1e6:.1f}" for v in VARIANTS)
    ratio = seconds["block64"] / seconds["w4"]
    return (
        f"| {fmt} | {matrix} | {shape} | {rows} | {us} | {rate / 1e9:.0f} |"
        f" {100 * rate / bw:.0f} % | {ratio:.2f} |"
    )


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
    variants = Variants(cp)
    print(f"device: {backend.describe()}; copy bandwidth {bw / 1e9:.0f} GB/s")
    cells = " | ".join(f"{v} us" for v in VARIANTS)
    print(f"| format | matrix | out x in | rows | {cells} | w4 GB/s | w4 % copy | w4 / block64 |")
    print("|---" * (8 + len(VARIANTS) - 1) + "|")
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
            layer = dict.fromkeys(VARIANTS, 0.0)
            layer_bytes = 0
            for name, w in mats.items():
                x = cp.asarray(rng.standard_normal((rows, w.in_features), np.float32))
                seconds: dict[str, float] = {}
                ref = None
                for v in VARIANTS:
                    seconds[v], y = time_gemv(cp, variants, v, w, x, args.reps)
                    if ref is None:
                        ref = y
                    elif not bool(cp.allclose(y, ref, rtol=1e-3, atol=1e-3)):
                        raise RuntimeError(f"{v} differs from w4 on {fmt} {name}")
                if name in LAYER:
                    layer_bytes += w.nbytes
                    layer = {v: layer[v] + seconds[v] for v in VARIANTS}
                shape = f"{w.out_features}x{w.in_features}"
                print(_line(fmt, name, shape, rows, seconds, w.nbytes, bw))
            print(_line(fmt, "one layer", "-", rows, layer, layer_bytes, bw))
        del mats
    return 0


if __name__ == "__main__":
    sys.exit(main())
