"""Real-size mixture-of-experts CPU speed: meshnode beside llama.cpp on Qwen3-30B-A3B and
gpt-oss-20b shapes.

Run: ``.venv/bin/python benchmarks/realsize_moe.py [--shapes qwen3-30b-a3b gpt-oss-20b]
[--layers N] [--threads 1 2] [--modes exact q8] [--rounds 3] [--tokens 32] [--prefill 512]
[--llama-bin DIR] [--write-only]``

The models are random-weight GGUFs of the real shapes (:mod:`benchmarks.realsize_moe_gguf`:
Qwen3-30B-A3B in llama.cpp's Q4_K_M mix, gpt-oss-20b with MXFP4 experts; SmolLM2's
tokenizer; cached in ``~/.cache/meshnode/realsize/``); ``--layers`` cuts their depth (a
decode step's time is about linear in it). Random routers spread the tokens over the
experts about as trained ones do; the numbers time things only. Each meshnode mode
(``exact``: ``--dtype native``; ``q8``: 8-bit activations) at each thread count runs in its
own process; every round, at each thread count in turn, runs each once and llama.cpp once
(llama.cpp first every other round: :func:`benchmarks.realsize.paired_rounds`), so that the
drift of this shared machine's speed hits both engines alike. Medians over rounds of:

- decode: one sequence, ``--tokens`` new tokens after a 16-token prompt
  (``llama-bench -n``, tg);
- 8 streams: eight sequences decoded together, one row each per step (meshnode:
  ``Stage.forward_batch``; ``llama-batched-bench -npl 8``), aggregate tok/s;
- prefill: a ``--prefill``-token prompt (``llama-bench -p``; 0 skips it);

with the ratio to llama.cpp at the same threads. llama.cpp's binaries come from
``--llama-bin``, ``$LLAMA_BIN`` or the lead's build of the sources vendored in
``llama-cpp-python`` (the dense real-size benchmark, ``realsize.py``, says how to build
them); without them its columns are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import MeshnodeRunner, uptime
from benchmarks.realsize import (
    Worker,
    llama_bin,
    llama_round,
    paired_rounds,
    prompt_ids,
    ratio_cell,
)
from benchmarks.realsize_moe_gguf import SHAPES, cached_gguf

MODES = {"exact": "blocks", "q8": "q8"}  # benchmarks/engine.py's variants
PROMPT = 16  # tokens before decode
STREAMS = 8
KEYS = ("decode", "streams", "prefill")


# -- the worker: one meshnode mode at one thread count, one process -------------------


def _decode(runner: MeshnodeRunner, tokens: int) -> float:
    _, decode_s, _ = runner.generate(list(prompt_ids(PROMPT, 1)), tokens + 1)
    return tokens / decode_s


def _streams(runner: MeshnodeRunner, tokens: int) -> float:
    from meshnode.engine.model import BatchRow

    stage = runner.stage
    caches = [stage.new_cache(PROMPT + tokens + 1) for _ in range(STREAMS)]
    for i, cache in enumerate(caches):
        stage.forward(prompt_ids(PROMPT, 10 + i), 0, cache, out_rows=1)
    last = [7 + i for i in range(STREAMS)]
    began = time.perf_counter()
    for step in range(tokens):
        pairs = zip(last, caches, strict=True)
        rows = [BatchRow(np.array([t]), PROMPT + step, c, 1) for t, c in pairs]
        last = [int(np.argmax(o[-1])) for o in stage.forward_batch(rows)]
    return STREAMS * tokens / (time.perf_counter() - began)


def _prefill(runner: MeshnodeRunner, n: int) -> float:
    if not n:
        return float("nan")
    prefill_s, _, _ = runner.generate(list(prompt_ids(n, 2)), 1)
    return n / prefill_s


def worker(args: argparse.Namespace) -> None:
    """Load the model, then answer each ``round`` line on stdin with one JSON line."""
    runner = MeshnodeRunner(args.model, MODES[args.worker], args.threads[0])
    _decode(runner, 2)  # warm-up: kernels compiled or loaded, pages touched
    _streams(runner, 2)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        out = {"decode": _decode(runner, args.tokens), "streams": _streams(runner, args.tokens)}
        out["prefill"] = _prefill(runner, args.prefill)
        print(json.dumps(out), flush=True)


# -- the driver -----------------------------------------------------------------------


def run_model(model: Path, args: argparse.Namespace, folder: Path | None) -> None:
    extra = ["--prefill", str(args.prefill)]
    workers = [
        Worker(m, t, model, args, script=__file__, extra=extra)
        for t in args.threads
        for m in args.modes
    ]

    def llama(t: int) -> dict[str, float] | None:
        return None if folder is None else llama_round(folder, model, t, args, args.prefill)

    print(f"\n## {model.name}: start {uptime()}", flush=True)
    results = paired_rounds(workers, args.threads, args.rounds, llama)
    for w in workers:
        w.close()
    report(model, results)
    if folder is None:
        print("\nllama.cpp: skipped (no binaries: --llama-bin DIR or $LLAMA_BIN)")


def report(model: Path, results: dict[tuple[str, int], list[dict[str, float]]]) -> None:
    """One table: medians, ratios to llama.cpp at the same threads
    (:func:`benchmarks.realsize.ratio_cell`)."""
    print(f"\n{model.name}")
    head = ["engine", "threads", "decode tok/s", "vs llama.cpp", "8 streams tok/s"]
    head += ["vs llama.cpp", "prefill tok/s", "vs llama.cpp"]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for (engine, t), rounds in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ref = results.get(("llama.cpp", t))
        cells = [engine, str(t)]
        for key in KEYS:
            med = statistics.median(r[key] for r in rounds)
            cells.append(f"{med:.2f}")
            if ref is None or engine == "llama.cpp":
                cells.append("-")
            else:
                cells.append(ratio_cell(rounds, ref, key))
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="cut the models to their first N layers")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens; 0: skip")
    parser.add_argument("--llama-bin", help="folder of llama-bench, llama-batched-bench")
    parser.add_argument("--write-only", action="store_true", help="write the models, no run")
    parser.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    folder = llama_bin(args.llama_bin)
    print(f"threads {args.threads}, rounds {args.rounds}, {args.tokens} tokens, {uptime()}")
    for shape in args.shapes:
        model = cached_gguf(shape, args.layers)
        if not args.write_only:
            run_model(model, args, folder)


if __name__ == "__main__":
    main()
