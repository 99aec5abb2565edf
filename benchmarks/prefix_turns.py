"""A served chat's first token per turn, in process, and where its wall-clock time goes
(issue 30: one node's turns flat, turn 10 <= 1.5x turn 2).

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/prefix_turns.py [--threads 2]
[--chats 3] [--turns 10] [--dtype q8]``

What ``meshnode join`` runs for ``benchmarks/prefix.py``'s chat, less HTTP: SmolLM2-135M
from its GGUF (``--dtype q8``, the CPU default, float16 K/V), ``--threads`` kernel threads,
one :class:`~meshnode.node.stage.StageRunner` (prefix cache on, a 4,096-token context)
behind a :class:`~meshnode.node.local.LocalPipeline`, the generation loop to its first
token, the host's templating and tokenizing included. Each of ``--chats`` conversations
begins with its own system prompt (no block shared between chats), so every turn of every
chat resumes from what its previous turn left, as the benchmark's do, after the same
warm-up chat as ``benchmarks/prefix.py``'s (``warm_up``); printed per turn:
the least wall-clock time over the chats and, of that run, the process CPU time, the
forward, its attention (the compiled kernel's calls and the BLAS path's), the BLAS path's
``blocked_attention`` and the paged cache's writes and gathers for it, all wall-clock ms.
``uptime`` is printed first and last: the machine is shared.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prefix import WARM_SYSTEM, WARM_TURNS, conversation, uptime
from meshnode.engine import attention
from meshnode.engine.backend import cpu_backend, limit_cpu_threads
from meshnode.engine.kv_cache import resolve_kv_dtype
from meshnode.engine.kv_pages import PagedCache
from meshnode.engine.loader import load_model
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import RequestId
from meshnode.node.stage import StageRunner
from meshnode.serve.single import EngineCodec
from tests.conftest import smollm2_gguf_path

CONTEXT = 4096
PARTS = ("forward", "attention", "blas", "kv")
spent = dict.fromkeys(PARTS, 0.0)


def timed(fn: Callable[..., Any], part: str) -> Callable[..., Any]:
    """``fn``, adding the wall-clock ms of each call to ``spent[part]``."""

    def inner(*a: Any, **k: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[part] += 1000 * (time.perf_counter() - began)

    return inner


class Quiet:
    """A detokenizer that makes every token a piece of text."""

    def push(self, token: int) -> str:
        return "x"

    def flush(self) -> str:
        return ""


async def first_token(
    pipe: LocalPipeline, codec: EngineCodec, messages: list[dict[str, str]], name: str
) -> tuple[float, float, int, int]:
    """Wall and CPU seconds to the first token of ``messages``, the prompt's tokens and
    those read from the cache."""
    began, cpu = time.perf_counter(), time.process_time()
    ids = codec.encode(codec.render_chat(messages))
    params = GenerationParams(max_new_tokens=1, sampling=SamplingParams(temperature=0.0))
    run = GenerationRun(RequestId(name), ids, params, GenerationState(params, Quiet()))
    async for _ in generate(pipe, run):
        break
    return time.perf_counter() - began, time.process_time() - cpu, len(ids), run.cached_tokens


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--dtype", choices=["native", "q8"], default="q8")
    args = parser.parse_args()
    print("uptime:", uptime(), flush=True)
    handle = limit_cpu_threads(args.threads)
    kv = resolve_kv_dtype("auto", args.dtype)
    model = load_model(str(smollm2_gguf_path()), cpu_backend(args.dtype), kv)
    codec = EngineCodec(model.tokenizer, model.chat_template, model.config.vocab_size)
    pipe = LocalPipeline(StageRunner(model.stage, context_size=CONTEXT, max_sequences=8))
    Stage.forward_batch = timed(Stage.forward_batch, "forward")  # type: ignore[method-assign]
    kernel = attention.KernelAttention
    kernel.__call__ = timed(kernel.__call__, "attention")  # type: ignore[method-assign]
    attention.blocked_attention = timed(attention.blocked_attention, "blas")
    PagedCache.write = timed(PagedCache.write, "kv")  # type: ignore[method-assign]
    for turn, messages in enumerate(conversation(WARM_TURNS, system=WARM_SYSTEM)):
        await first_token(pipe, codec, messages, f"warm.{turn}")  # as prefix.warm_up
    best: dict[int, list[float]] = {}
    print(f"weights {args.dtype}, K/V {kv}, {args.threads} threads; wall-clock ms")
    print("turn | prompt | cached | first token | CPU | " + " | ".join(PARTS))
    for chat in range(args.chats):
        for turn, messages in enumerate(conversation(args.turns), 1):
            messages = [dict(m) for m in messages]
            messages[0]["content"] = f"Chat {chat}. {messages[0]['content']}"
            spent.update(dict.fromkeys(PARTS, 0.0))
            wall, cpu, prompt, cached = await first_token(pipe, codec, messages, f"{chat}.{turn}")
            row = [prompt, cached, 1000 * wall, 1000 * cpu, *(spent[p] for p in PARTS)]
            if turn not in best or row[2] < best[turn][2]:
                best[turn] = row
    for turn, row in sorted(best.items()):
        cells = " | ".join(f"{x:.0f}" for x in row[2:])
        print(f"{turn:4} | {row[0]:.0f} | {row[1]:.0f} | {cells}")
    if 2 in best and args.turns in best:
        ratio = best[args.turns][2] / best[2][2]
        print(f"turn {args.turns} over turn 2: {ratio:.2f} (goal <= 1.5)")
    print("uptime:", uptime(), "threads handle:", type(handle).__name__)


if __name__ == "__main__":
    trio.run(main)
