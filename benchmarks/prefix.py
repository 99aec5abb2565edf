"""Prefix-cache benchmark (issue 30): time to first token with the cache on and off.

Run: ``.venv/bin/python benchmarks/prefix.py`` (a few minutes on 2 busy cores;
``--turns 10 --users 8 --system-tokens 1000 --rounds 1``)

SmolLM2-135M on one node (the single-node service ``meshnode join`` builds on one
machine, its weights in their GGUF blocks, greedy, speculation off) behind the node's HTTP
app on loopback; the client streams ``/v1/chat/completions`` from this process (httpx) and
times the first content chunk. "off" is the same server with ``cache_prompt: false`` in
the request (no reuse; the request's blocks are still stored).

- **chat**: a conversation of ``--turns`` turns with fixed user and assistant texts (each
  turn resends the whole conversation, ~190 tokens more per turn, ~1,900 at turn 10).
  Each turn runs with the cache on, then with it off, side by side.
- **users**: ``--users`` concurrent requests sharing a ``--system-tokens`` system prompt,
  each with its own question: all off at once, then all on at once (the off round has
  left the system prompt in the pool: the steady state of a served system prompt).

Printed: per turn, the time to first token on and off and the cached tokens the usage
reported; the ratios the issue sets goals for (turn 10 over turn 2 with the cache on, goal
≤ 1.5; the users' median off over on, goal ≥ 5). The machine is shared: ``uptime`` is
printed first and last; compare ratios, not times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode.engine.backend import cpu_backend, limit_cpu_threads
from meshnode.node.config import Address
from meshnode.serve.app import create_app, serve_api
from meshnode.serve.openai_api import mount_openai
from meshnode.serve.single import build_single_node_service
from tests.conftest import smollm2_gguf_path

CONTEXT = 4096  # turn 10 of the chat is ~1,900 tokens; 8 users' prompts ~1,050 each
MAX_TOKENS = 8  # the reply's length does not matter here: time to first token does
WORDS = [
    "river",
    "mountain",
    "quiet",
    "lantern",
    "orchard",
    "copper",
    "meadow",
    "harbor",
    "signal",
    "thunder",
    "ribbon",
    "marble",
    "canyon",
    "velvet",
    "ember",
    "glacier",
    "falcon",
    "whisper",
    "timber",
    "compass",
]


def _text(seed: int, words: int) -> str:
    """A deterministic sentence soup of ``words`` words (no two seeds alike)."""
    out = [WORDS[(seed * 7 + i * (seed % 5 + 3)) % len(WORDS)] for i in range(words)]
    return " ".join(out).capitalize() + "."


async def first_token(
    http: httpx.AsyncClient, url: str, messages: list[dict[str, str]], cache: bool
) -> tuple[float, int]:
    """Seconds to the first content chunk of a streamed chat, and the cached tokens."""
    body: dict[str, Any] = {
        "model": "bench",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": cache,
    }
    began = time.perf_counter()
    ttft, cached = None, -1
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            if ttft is None and choices[0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - began
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - began), cached


async def chat(http: httpx.AsyncClient, url: str, turns: int) -> dict[str, list[float]]:
    messages: list[dict[str, str]] = [{"role": "system", "content": _text(1, 20)}]
    out: dict[str, list[float]] = {"on": [], "off": []}
    print("turn | ttft on (cached) | ttft off | off/on", flush=True)
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": _text(10 + turn, 70)})
        on, cached = await first_token(http, url, messages, True)
        off, _ = await first_token(http, url, messages, False)
        out["on"].append(on)
        out["off"].append(off)
        print(f"{turn:4} | {on:6.2f} s ({cached:4}) | {off:6.2f} s | {off / on:5.1f}", flush=True)
        messages.append({"role": "assistant", "content": _text(100 + turn, 70)})
    return out


async def users(http: httpx.AsyncClient, url: str, n: int, system_tokens: int) -> None:
    system = _text(3, system_tokens)  # ~1.05 tokens a word in this soup
    medians = {}

    async def one(i: int, cache: bool, out: list[tuple[float, int]]) -> None:
        question = [{"role": "user", "content": _text(500 + i, 25)}]
        messages = [{"role": "system", "content": system}, *question]
        out[i] = await first_token(http, url, messages, cache)

    for label, cache in (("off", False), ("on", True)):
        got = [(0.0, 0)] * n
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i, cache, got)
        times, cached = [t for t, _ in got], [c for _, c in got]
        medians[label] = statistics.median(times)
        print(
            f"users {label:3} | median ttft {medians[label]:6.2f} s, max {max(times):6.2f} s, "
            f"cached tokens {sorted(cached)}",
            flush=True,
        )
    print(f"users | median off/on {medians['off'] / medians['on']:5.1f} (goal >= 5)")


async def bench(args: argparse.Namespace) -> None:
    service = build_single_node_service(
        str(smollm2_gguf_path()), model_id="bench", context_size=CONTEXT, backend=cpu_backend()
    )
    app = create_app(lambda: {"node": {"node_id": "bench"}})
    mount_openai(app, service)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_api, app, Address("127.0.0.1", 0))
        url = f"http://{address}"
        async with httpx.AsyncClient(timeout=600) as http:
            await first_token(http, url, [{"role": "user", "content": "Hi."}], False)  # warm
            for round_ in range(args.rounds):
                print(f"-- round {round_ + 1}", flush=True)
                got = await chat(http, url, args.turns)
                on = got["on"]
                if len(on) >= 2:
                    print(f"chat | turn {len(on)} over turn 2, cache on: {on[-1] / on[1]:4.2f} "
                          f"(goal <= 1.5); off: {got['off'][-1] / got['off'][1]:4.2f}")  # fmt: skip
                await users(http, url, args.users, args.system_tokens)
        nursery.cancel_scope.cancel()


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (README)")
    args = parser.parse_args()
    print("uptime:", uptime(), flush=True)
    limit = limit_cpu_threads(args.threads)  # the limit lasts while the handle is referenced
    trio.run(bench, args)
    print("uptime:", uptime(), "threads handle:", type(limit).__name__)


if __name__ == "__main__":
    main()
