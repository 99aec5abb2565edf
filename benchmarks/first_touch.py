"""The first tokens of a freshly loaded stage, with its weights' pages faulted in at load
(``MADV_POPULATE_READ``, :func:`meshnode.engine.readahead.populate_weights`) or left to
fault in at first use, side by side (issue 31).

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/first_touch.py [--shapes
qwen3-30b-a3b 1b] [--modes q8 exact] [--rounds 3] [--prompt 16] [--tokens 8] [--threads 1]
[--hugepage]``

The models are the real-size random GGUFs of the speed benchmarks, cached in
``~/.cache/meshnode/realsize/``: Qwen3-30B-A3B cut to 4 layers
(:mod:`benchmarks.realsize_moe_gguf`: 128 experts of which a token reads 8) and the
whole Llama-3.2-1B (:mod:`benchmarks.realsize_gguf`, Q4_K_M). Each mode runs in its own
process, which first compiles (or loads) its kernels on a stage of its own; then each
round opens the file again, a new map with empty page tables, once per variant, in turn
(``mapped``: as a stage loaded before; ``populated``: faulted in at load; with
``--hugepage`` also ``populated+thp``: ``MADV_HUGEPAGE`` on the map first), and times a
prefill of ``--prompt`` tokens, the first decode token, and the next ``--tokens`` - 1;
then the same again on the same stage (``warm``: every page they read is mapped).

The page cache is not dropped (it cannot be, fairly, on a shared machine): the file's
pages stay cached between runs, and what a fresh map costs is its own minor faults, one
per 4 KiB page or fault-around window first touched. Columns: seconds of the load and of
the populate (and its MiB), ms of each step, and the process's minor faults in it
(``getrusage().ru_minflt``, the kernel threads' included); ``pmd MiB``: the map's
``FilePmdMapped`` in ``/proc/self/smaps`` after the run (pages mapped 2 MiB at a time).
Medians over rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import uptime

MODES = {"q8": "q8", "exact": "native"}  # meshnode's --dtype
STEPS = ("prefill", "token 1", "tokens 2+")
VARIANTS = ("mapped", "populated")
MADV_HUGEPAGE = 14  # Linux's value (Python's mmap.MADV_HUGEPAGE where it is offered)


def model_path(shape: str) -> Path:
    """The shape's cached real-size GGUF, written first if it is not there."""
    if shape == "1b":
        from benchmarks.realsize_gguf import cached_gguf

        return cached_gguf("1b", "q4_k_m")
    from benchmarks.realsize_moe_gguf import cached_gguf as cached_moe

    return cached_moe(shape, 4)


# -- the worker: one mode, one process -----------------------------------------------------


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """``fn()``, its seconds and the process's minor faults in it."""
    faults, began = _faults(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - began, _faults() - faults


def _stage(path: Path, dtype: str) -> Any:
    from meshnode_packaging.sources import open_source

    from meshnode.engine.backend import cpu_backend
    from meshnode.engine.config import ModelConfig
    from meshnode.engine.model import Stage

    source = open_source(path)
    config = ModelConfig.from_hf(source.config)
    backend = cpu_backend(dtype)  # type: ignore[arg-type]
    return Stage(config, source, 0, config.num_layers, embed=True, head=True, backend=backend)


def _generate(stage: Any, prompt: np.ndarray, tokens: int) -> dict[str, Any]:
    """ms and minor faults of the prefill, the first decode token and the rest (per token)."""
    cache = stage.new_cache(prompt.size + tokens + 1)
    logits, prefill_s, prefill_f = _timed(lambda: stage.forward(prompt, 0, cache, out_rows=1))
    out = [int(np.argmax(logits[-1]))]

    def decode() -> None:
        logits = stage.forward(np.asarray(out[-1:]), cache.length, cache, out_rows=1)
        out.append(int(np.argmax(logits[-1])))

    _, first_s, first_f = _timed(decode)

    def rest() -> None:
        for _ in range(tokens - 1):
            decode()

    _, rest_s, rest_f = _timed(rest)
    more = max(1, tokens - 1)
    return {
        "prefill": [1e3 * prefill_s, prefill_f],
        "token 1": [1e3 * first_s, first_f],
        "tokens 2+": [1e3 * rest_s / more, rest_f / more],
        "ids": out,
    }


def _map_of(stage: Any) -> tuple[Any, int]:
    """The file map under ``stage``'s weights and its address."""
    from meshnode_packaging.gguf_file import _mapped

    from meshnode.engine.readahead import weight_arrays

    for a in weight_arrays(stage.weights):
        mapped = _mapped(a)
        if mapped is not None:
            return mapped[0], np.frombuffer(mapped[0], np.uint8).ctypes.data
    raise SystemExit("the stage's weights are not views of a file map")


def _pmd_mib(address: int) -> float:
    """``FilePmdMapped`` of the mapping at ``address`` in ``/proc/self/smaps``, MiB."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "FilePmdMapped:":
            return int(line.split()[1]) / 1024
    return float("nan")


def run_variant(path: Path, dtype: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh stage: load, populate where ``variant`` asks, the first tokens, warm."""
    from meshnode.engine.readahead import populate_weights

    stage, load_s, _ = _timed(lambda: _stage(path, dtype))
    held, address = _map_of(stage)
    if variant == "populated+thp":
        held.madvise(MADV_HUGEPAGE)
    populated = (0, 0.0, 0)
    if variant != "mapped":
        done, seconds, faults = _timed(lambda: populate_weights(stage))
        populated = (done.nbytes, seconds, faults)
    prompt = np.random.default_rng(1).integers(100, 40000, args.prompt)
    first = _generate(stage, prompt, args.tokens)
    warm = _generate(stage, prompt, args.tokens)
    result = {
        "variant": variant,
        "load s": load_s,
        "populate s": populated[1],
        "populate MiB": populated[0] / 2**20,
        "populate faults": populated[2],
        "first": first,
        "warm": warm,
        "pmd MiB": _pmd_mib(address),
    }
    return result


def worker(args: argparse.Namespace) -> None:
    """Warm the kernels up, then print one JSON line per variant per round."""
    from meshnode.engine.backend import limit_cpu_threads

    limit = limit_cpu_threads(args.threads)
    path, dtype = Path(args.model), MODES[args.worker]
    warm = _stage(path, dtype)  # kernels compiled or loaded, prefill's and decode's shapes
    prompt = np.random.default_rng(2).integers(100, 40000, args.prompt)
    for _ in range(2):
        _generate(warm, prompt, args.tokens)
    del warm
    gc.collect()
    variants = [*VARIANTS, *(["populated+thp"] if args.hugepage else [])]
    for r in range(args.rounds):
        turn = variants[r % len(variants) :] + variants[: r % len(variants)]  # alternate
        for variant in turn:
            print(json.dumps(run_variant(path, dtype, variant, args)), flush=True)
            gc.collect()  # the map went with its last view: the next variant's is fresh
    del limit


# -- the driver ------------------------------------------------------------------------------


def _median(rows: list[dict[str, Any]], *keys: str | int) -> float:
    values = []
    for row in rows:
        value: Any = row
        for key in keys:
            value = value[key]
        values.append(value)
    return float(statistics.median(values))


def report(shape: str, mode: str, rows: list[dict[str, Any]]) -> None:
    """Medians by variant, one line each."""
    print(f"\n{shape}, {mode}:")
    steps = "".join(f" | {s} ms (faults)" for s in STEPS)
    print(f"variant | load s | populate s (MiB, faults){steps} | warm{steps} | pmd MiB")
    ids = {json.dumps(row["first"]["ids"]) for row in rows}
    for variant in dict.fromkeys(row["variant"] for row in rows):
        mine = [row for row in rows if row["variant"] == variant]
        cells = [
            variant,
            f"{_median(mine, 'load s'):.2f}",
            f"{_median(mine, 'populate s'):.2f} ({_median(mine, 'populate MiB'):.0f}, "
            f"{_median(mine, 'populate faults'):.0f})",
        ]
        for part in ("first", "warm"):
            for step in STEPS:
                ms, faults = _median(mine, part, step, 0), _median(mine, part, step, 1)
                cells.append(f"{ms:.1f} ({faults:.0f})")
        cells.append(f"{_median(mine, 'pmd MiB'):.0f}")
        print(" | ".join(cells))
    if len(ids) != 1:
        print(f"!! the variants' greedy tokens differ: {sorted(ids)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "1b"])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["q8", "exact"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=8, help="decode tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hugepage", action="store_true", help="also MADV_HUGEPAGE")
    parser.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"before: {uptime()}", flush=True)
    for shape in args.shapes:
        path = model_path(shape)
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--worker", mode, "--model", str(path)]
            cmd += ["--rounds", str(args.rounds), "--prompt", str(args.prompt)]
            cmd += ["--tokens", str(args.tokens), "--threads", str(args.threads)]
            cmd += ["--hugepage"] * args.hugepage
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"{shape} {mode} failed:\n{done.stderr}")
            rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            print(f"# {shape} {mode} rows: {json.dumps(rows)}", flush=True)
            report(shape, mode, rows)
    print(f"\nafter: {uptime()}")


if __name__ == "__main__":
    main()
