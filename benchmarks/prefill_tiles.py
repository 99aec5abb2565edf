"""The exact prefill's tile size side by side: a real-size shape's 512-token prompt with
prefill tiles of several sizes, alternating in one process.

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/prefill_tiles.py [--shape 1b]
[--layers N] [--threads 1] [--mib 4 16] [--rounds 5] [--prompt 512]``

The exact mode (``--dtype native``) multiplies a prompt's rows by decoding a weight matrix
a tile of output rows at a time into float32 (at most :data:`.matrix.DENSE_TILE_BYTES`)
and handing each tile to sgemm (or, at most :data:`.matrix.GEMM_TILE_BYTES`, to the
compiled GEMM where this BLAS rounds a row by its batch): :func:`.tiles.tiles`. Each round
prefills the same ``--prompt`` tokens once with each ``--mib`` as the tile cap (both
constants of the module, which the products read at each call), in turn, so that every
size meets the same load; a tile's size does not change a bit of the output (each
output value is the same sum, :func:`.tiles.rows_independent`).
Printed: each round's tok/s, then per size the median and best, and the median of the
per-round ratios to the first size.

The model is the random-weight GGUF of ``--shape`` in llama.cpp's Q4_K_M mix
(:mod:`benchmarks.realsize_gguf`, cached in ``~/.cache/meshnode/realsize/``; ``--layers``
cuts its depth: a prefill's time is about linear in it). Random weights only time things.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import MeshnodeRunner, uptime
from benchmarks.realsize import PREFILL, prompt_ids
from benchmarks.realsize_gguf import SHAPES, cached_gguf


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=PREFILL)
    args = parser.parse_args()

    from meshnode.engine.cpu import matrix

    model = cached_gguf(args.shape, "q4_k_m", args.layers)
    print(f"{model.name}, {args.threads} thread(s), {args.prompt}-token prompt; {uptime()}")
    runner = MeshnodeRunner(str(model), "blocks", args.threads)
    ids = list(prompt_ids(args.prompt, 2))  # realsize.py's prefill prompt
    for mib in args.mib:  # kernels compiled, pages touched, every size's scratch made
        matrix.DENSE_TILE_BYTES = matrix.GEMM_TILE_BYTES = mib << 20
        runner.generate(ids, 1)
    rates: dict[int, list[float]] = {mib: [] for mib in args.mib}
    for r in range(args.rounds):
        for mib in args.mib:
            matrix.DENSE_TILE_BYTES = matrix.GEMM_TILE_BYTES = mib << 20
            prefill_s, _, _ = runner.generate(ids, 1)
            rates[mib].append(args.prompt / prefill_s)
        print(f"round {r + 1}: " + ", ".join(f"{m} MiB {v[-1]:.1f}" for m, v in rates.items()))
    first = args.mib[0]
    for mib, v in rates.items():
        ratio = statistics.median(a / b for a, b in zip(v, rates[first], strict=True))
        print(
            f"{mib:>4} MiB tiles: median {statistics.median(v):.1f} tok/s, best {max(v):.1f}, "
            f"x{ratio:.2f} the {first} MiB tiles (median of the rounds' ratios)"
        )
    print(uptime())


if __name__ == "__main__":
    main()
