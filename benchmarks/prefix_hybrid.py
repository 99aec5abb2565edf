"""Prefix reuse on a hybrid (Gated DeltaNet) stage (issue 30): time to the first token of
each turn of a chat, resumed from the stage's recurrent snapshots against the same request
with ``cache_prompt: false``.

Run: ``.venv/bin/python benchmarks/prefix_hybrid.py [--tiny] [--turns 10] [--repeats 3]``

The model is ``benchmarks/hybrid.py``'s randomly initialised Qwen3.5-shaped stack (~0.3B
parameters float32; ``--tiny`` shrinks it for a smoke run), one stage in this process
behind the real :class:`~meshnode.node.local.LocalPipeline` and generation loop, one BLAS
thread, greedy, prefill chunks of 256. Turn ``t``'s prompt is turn ``t - 1``'s plus a
reply and a question (``--turn-tokens`` tokens together), as a chat client resends the
conversation. Each turn runs the cached request (which finds the snapshots the earlier
turns left) and then the same one uncached, whose reply must equal the cached one's; the
chat runs ``--repeats`` times on fresh stage caches (medians). Printed per turn: the
prompt's tokens, the tokens read from snapshots, and the wall and process CPU seconds to
the first token of both, with their ratio; ``uptime`` first and last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from threadpoolctl import threadpool_limits

from benchmarks.hybrid import FULL, TINY, RandomHybrid
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import RequestId
from meshnode.node.stage import StageRunner

CONTEXT = 4096
CHUNK_TOKENS = 256  # the serve default (--prefill-chunk-tokens)
GREEDY = SamplingParams(temperature=0.0)


class _Silent:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


async def _first_token(
    pipeline: LocalPipeline, name: str, prompt: list[int], cache: bool
) -> tuple[float, float, int, list[int]]:
    """Wall and CPU seconds to the first token, the tokens resumed, the reply's ids."""
    params = GenerationParams(max_new_tokens=1, sampling=GREEDY, cache_prompt=cache)
    run = GenerationRun(RequestId(name), prompt, params, GenerationState(params, _Silent()))
    wall, cpu = time.perf_counter(), time.process_time()
    async for _ in generate(pipeline, run, chunk_tokens=CHUNK_TOKENS):
        pass
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, run.cached_tokens, run.history[len(prompt) :]


async def _chat(runner: StageRunner, turns: int, turn_tokens: int) -> list[tuple[float, ...]]:
    """One conversation on a fresh pipeline: per turn, the cached request first (it finds
    the previous turns' snapshots), then the uncached one; their figures."""
    pipeline = LocalPipeline(runner)
    vocab = runner.stage.config.vocab_size
    prompt: list[int] = []
    rows: list[tuple[float, ...]] = []
    for turn in range(1, turns + 1):
        prompt += [(7 * len(prompt) + 11 * i) % (vocab - 3) + 3 for i in range(turn_tokens)]
        on = await _first_token(pipeline, f"on{turn}", prompt, True)
        off = await _first_token(pipeline, f"off{turn}", prompt, False)
        assert on[3] == off[3], "the resumed reply differs from the uncached one"
        rows.append((len(prompt), on[2], on[0], off[0], on[1], off[1]))
    return rows


def _print(runs: list[list[tuple[float, ...]]]) -> None:
    print("turn  prompt  cached  wall on / off (s)      CPU on / off (s)       CPU ratio")
    for turn, per_run in enumerate(zip(*runs, strict=True), start=1):
        n, cached = per_run[0][0], per_run[0][1]
        w_on, w_off, c_on, c_off = (statistics.median(r[i] for r in per_run) for i in range(2, 6))
        print(
            f"{turn:>4}  {n:>6.0f}  {cached:>6.0f}  {w_on:8.3f} / {w_off:8.3f}     "
            f"{c_on:8.3f} / {c_off:8.3f}     {c_off / max(c_on, 1e-9):6.1f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small model: a smoke run")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=170)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    source = RandomHybrid(TINY if args.tiny else FULL)
    config = ModelConfig.from_hf(source.config)
    print("#", os.popen("uptime").read().strip())
    with threadpool_limits(limits=1, user_api="blas"):
        stage = Stage(config, source, 0, config.num_layers, embed=True, head=True, mtp=False)
        print(f"# prefix reuse on a hybrid stage: {stage.weights.nbytes() / 2**20:.0f} MiB")
        runs = []
        for _ in range(args.repeats):  # each a fresh stage cache: the chat from its start
            runner = StageRunner(stage, context_size=CONTEXT)
            runs.append(trio.run(_chat, runner, args.turns, args.turn_tokens))
        _print(runs)
        print("# the last run's stage:", runner.kv_usage())
    print("#", os.popen("uptime").read().strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
