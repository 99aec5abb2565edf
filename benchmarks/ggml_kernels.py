"""Cycles per weight of meshnode's one-row 8-bit-activation products (``--dtype q8``
decode) beside llama.cpp's own kernels on the same blocks: ggml's ``vec_dot`` for Q4_K,
Q6_K and Q8_0, in cache and streamed, side by side in alternating rounds (issues 29, 31).

Run: ``nice .venv/bin/python benchmarks/ggml_kernels.py [--cases Q6_K:2048x6144 ...]
[--rounds 3] [--stream-mib 192] [--ghz 2.5] [--llama-bin DIR]``

ggml's kernels are reached through a small C shim (``benchmarks/ggml_kernels.c``), compiled
at run time with ``cc`` (``$CC``) against the ``libggml-cpu.so`` and ``libggml-base.so`` of
a llama.cpp build: the folder from ``--llama-bin``, ``$LLAMA_BIN`` or the lead's build (as
:mod:`benchmarks.realsize`; to build it: ``cmake -B build -DGGML_NATIVE=ON && cmake --build
build -j2 --target llama-bench`` in the ``vendor/llama.cpp`` of the ``llama-cpp-python``
sdist; the libraries land in ``build/bin``). Without a compiler or the libraries only
meshnode's column is printed. meshnode itself never needs a compiler.

Each call multiplies one activation row (2048 values by default) by a matrix of random
blocks with finite scales, the activations quantized inside the call on both sides
(meshnode's 32-value q8 blocks; ggml's ``quantize_row_q8_K`` / ``q8_0``), in this thread
(no pool): ``time.thread_time`` (another process on the same core does not count), per
weight, at the nominal clock ``--ghz``. "cache": the same matrix again and again (the
default shapes fit the L3); "stream": copies filling ``--stream-mib`` MiB, one after the
other, as a decode step streams its weights (GB/s of weight bytes beside it). The median
over the matrices of a round, the least over the rounds; the two engines alternate, and
which goes first alternates by round. The default cases: the Q6_K token head of the
Qwen3-30B-A3B benchmark shape cut to 6144 rows (its 49k vocabulary x 2048), and Q4_K and
Q8_0 matrices of 1536 rows. Printed beside: the relative difference of the two engines'
outputs (both quantize the activations, in different blocks: about 1e-2).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.exact_kernels import random_raw
from benchmarks.realsize import llama_bin

SHIM = Path(__file__).with_name("ggml_kernels.c")
# The shim's format codes
_FMT = {"Q4_K": 4, "Q6_K": 6, "Q8_0": 8}


def build_shim(folder: Path | None, into: Path) -> ctypes.CDLL | None:
    """The shim compiled against the llama.cpp build in ``folder`` and loaded, or None
    (with the reason printed) where there is no build or no C compiler."""
    if folder is None or not (folder / "libggml-cpu.so").exists():
        print("ggml: skipped (no libggml-cpu.so: --llama-bin DIR or $LLAMA_BIN; see --help)")
        return None
    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if cc is None:
        print("ggml: skipped (no C compiler: $CC, cc or gcc)")
        return None
    lib = into / "ggml_shim.so"
    cmd = [cc, "-O2", "-shared", "-fPIC", str(SHIM), "-o", str(lib), f"-L{folder}",
           "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{folder}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        print(f"ggml: skipped ({' '.join(cmd)}: {done.stderr.strip()[-500:]})")
        return None
    shim = ctypes.CDLL(str(lib))
    shim.shim_init()
    shim.shim_rows.restype = ctypes.c_int
    return shim


def _case(text: str) -> tuple[str, int, int]:
    # "Q6_K:2048x6144" -> ("Q6_K", 2048, 6144)
    name, shape = text.split(":")
    n_in, rows = shape.lower().split("x")
    if name not in _FMT:
        raise argparse.ArgumentTypeError(f"{name}: one of {', '.join(_FMT)}")
    return name, int(n_in), int(rows)


def run_case(
    name: str, n_in: int, rows: int, shim: ctypes.CDLL | None, args: argparse.Namespace
) -> None:
    """Times one case, both engines, and prints a line per engine and place."""
    from meshnode.engine.cpu import q8
    from meshnode.engine.cpu.formats import FORMATS

    rng = np.random.default_rng(0)
    fmt = FORMATS[name].kernel_id
    product = q8._kernels().product_kernel(fmt, fmt, fmt)
    one = random_raw(name, rows, rng, n_in)
    copies = [one] + [
        random_raw(name, rows, rng, n_in)
        for _ in range(max(1, (args.stream_mib << 20) // one.nbytes) - 1)
    ]
    x = rng.standard_normal(n_in).astype(np.float32)
    ours, theirs = np.empty((1, rows), np.float32), np.empty(rows, np.float32)
    y = np.empty(292 * (n_in // 256) + 64, np.uint8)
    empty = one[:0]
    ptr = ctypes.c_void_p

    def call(who: str, w: np.ndarray) -> None:
        if who == "meshnode":
            product(w, empty, empty, x, ours)
        else:
            assert shim is not None
            shim.shim_rows(
                _FMT[name], n_in, rows, w.ctypes.data_as(ptr), w.shape[1],
                x.ctypes.data_as(ptr), y.ctypes.data_as(ptr), theirs.ctypes.data_as(ptr),
            )  # fmt: skip

    engines = ["meshnode"] + (["ggml"] if shim is not None else [])
    for who in engines:  # compile, and the outputs to compare
        call(who, one)
    times: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for who in engines if rnd % 2 == 0 else engines[::-1]:
            for where, mats in (("cache", [one] * args.repeat), ("stream", copies)):
                ts = []
                for w in mats:
                    start = time.thread_time()
                    call(who, w)
                    ts.append(time.thread_time() - start)
                times.setdefault((who, where), []).append(statistics.median(ts))
    weights = n_in * rows
    for where in ("cache", "stream"):
        for who in engines:
            ts = times[(who, where)]
            t = min(ts)
            rounds = " ".join(f"{v * 1e3:.3f}" for v in ts)
            print(
                f"{name} {n_in}x{rows} {where:6} {who:8}: {t * 1e3:7.3f} ms "
                f"{t * args.ghz * 1e9 / weights:.3f} cycles/weight "
                f"{one.nbytes / t / 1e9:5.2f} GB/s  (rounds, ms: {rounds})",
                flush=True,
            )
        if shim is not None:
            a, b = (min(times[(who, where)]) for who in engines)
            print(f"{name} {n_in}x{rows} {where:6} meshnode / ggml time: {a / b:.3f}")
    if shim is not None:
        rel = float(np.abs(ours[0] - theirs).max() / np.abs(theirs).max())
        print(f"{name} {n_in}x{rows} outputs' largest difference / largest |output|: {rel:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        type=_case,
        nargs="+",
        default=[_case(c) for c in ("Q6_K:2048x6144", "Q4_K:2048x1536", "Q8_0:2048x1536")],
        help="FORMAT:N_INxROWS (formats: Q4_K, Q6_K, Q8_0)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=20, help="in-cache calls a round")
    parser.add_argument("--stream-mib", type=int, default=192)
    parser.add_argument("--ghz", type=float, default=2.5)
    parser.add_argument("--llama-bin", help="folder of llama.cpp's libggml-cpu.so")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shim: Any = build_shim(llama_bin(args.llama_bin), Path(tmp))
        for name, n_in, rows in args.cases:
            run_case(name, n_in, rows, shim, args)


if __name__ == "__main__":
    main()
