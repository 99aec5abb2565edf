"""Prefix-cache benchmark (issue 30): time to first token with the cache on and off, beside
llama.cpp, on one node and on a 2-stage split, and the memory over many distinct prompts.

Run (the idle figures, ~10 minutes on 2 idle cores):
``.venv/bin/python benchmarks/prefix.py``
(``--turns 10 --users 8 --system-tokens 1000 --rss-prompts 500 --threads 2 --replies
fixed``; a section is left out with ``--skip chat users rss split llama``).

Every meshnode figure comes from ``meshnode join`` processes on loopback, as a user runs
them (SmolLM2-135M from its GGUF, weights in their GGUF blocks: ``--dtype auto``, greedy,
speculation off, ``--threads``); the client streams ``/v1/chat/completions`` and times the
first content chunk. "off" is the same server with ``cache_prompt: false`` in the request
(no reuse; the request's blocks are still stored). llama.cpp is ``llama-server`` on the same
GGUF and threads (prompt caching on, one slot), from ``--llama-bin`` / ``$LLAMA_BIN`` /
the llama-cpp-python build under ``/work/llama``; left out when none is found.

- **chat** (one node): a conversation of ``--turns`` turns with fixed user and assistant
  texts (each turn resends the whole conversation, ~170 tokens more per turn, ~1,630 at
  turn 10): per turn meshnode on, meshnode off, llama-server. Every server first serves a
  warm-up chat of its own (:func:`warm_up`: :data:`WARM_TURNS` turns, cache on, another
  system prompt, so no block of it is shared with the timed chat), as a server that has
  answered a few chats has: every path a turn takes (a prompt of a few hundred rows, a
  resumed one, the first decode steps) is compiled before turn 1, and no turn's figure
  holds a first call's compiling (turn 2's once did, warmed by one short "Hi."). With
  ``--replies model`` the assistant's turns are instead what meshnode (cache on) answered,
  ``--reply-tokens`` long, as a chat client sends them back: a turn then resumes after the
  previous reply (its blocks were keyed as it was decoded), not at the previous prompt's
  last block.
- **users** (one node): ``--users`` concurrent requests sharing a ``--system-tokens``
  system prompt, each with its own question: all off at once, then all on at once (the
  off round has left the system prompt in the pool: a served system prompt's steady state).
- **rss** (one node): ``--rss-prompts`` distinct prompts one after another (one token
  each); the node's resident memory every tenth of the way (the pool is bounded, so it
  should level off).
- **split**: the chat, cache on, on a 2-stage split (two processes).

Printed: the tables, and the ratios the issue sets goals for: chat turn 10 over turn 2
(cache on, goal ≤ 1.5, on one node and split), turn 10 over llama.cpp's (goal ≤ 1.0), the
users' median off over on (goal ≥ 5). ``uptime`` is printed first and last.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import smollm2_gguf_path
from tests.e2e.cluster import Cluster, Node, init_token, ready_stages, wait_for

MODEL = "smollm2-135m"
CONTEXT = 4096  # turn 10 of the chat is ~1,630 tokens; 8 users' prompts ~1,050 each
MAX_TOKENS = 8  # the reply's length does not matter here: time to first token does
READY_TIMEOUT_S = 300.0
LLAMA_BIN_GLOB = "work/llama/llama_cpp_python-*/vendor/llama.cpp/build/bin"
SECTIONS = ("chat", "users", "rss", "split", "llama")
# The warm-up chat before the timed one (warm_up): its turns, and its system prompt's seed
# (the timed chat's is 1).
WARM_TURNS = 3
WARM_SYSTEM = 2
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
    http: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, str]],
    cache: bool,
    max_tokens: int = MAX_TOKENS,
) -> tuple[float, int, str]:
    """Seconds to the first content chunk of a streamed chat, the cached tokens the
    usage reports (-1 where it reports none), and the reply."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": cache,
    }
    began = time.perf_counter()
    ttft, cached, text = None, -1, []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            text.append(piece := choices[0].get("delta", {}).get("content") or "")
            if ttft is None and piece:
                ttft = time.perf_counter() - began
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens", cached))
    return (ttft if ttft is not None else time.perf_counter() - began), cached, "".join(text)


def conversation(
    turns: int, replies: list[str] | None = None, system: int = 1
) -> Iterator[list[dict[str, str]]]:
    """The chat's messages at each turn: the assistant's earlier replies fixed, or the last
    of ``replies`` (the caller appends each turn's reply before asking for the next); the
    system prompt is the text of seed ``system``."""
    messages: list[dict[str, str]] = [{"role": "system", "content": _text(system, 20)}]
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": _text(10 + turn, 70)})
        yield list(messages)
        reply = _text(100 + turn, 70) if replies is None else replies[-1]
        messages.append({"role": "assistant", "content": reply})


async def chat(
    targets: dict[str, tuple[str, bool]], turns: int, reply_tokens: int = 0
) -> dict[str, list[float]]:
    """Each turn on every target (label: url, cache), side by side; the times by label.
    With ``reply_tokens``, the first target's replies of that many tokens are the
    assistant's turns (``--replies model``)."""
    out: dict[str, list[float]] = {label: [] for label in targets}
    replies: list[str] | None = [] if reply_tokens else None
    print("turn | " + " | ".join(f"{label} (cached)" for label in targets), flush=True)
    async with httpx.AsyncClient(timeout=600) as http:
        for url, _ in dict.fromkeys(targets.values()):  # warm each server once
            await warm_up(http, url)
        for turn, messages in enumerate(conversation(turns, replies), 1):
            cells = []
            for i, (label, (url, cache)) in enumerate(targets.items()):
                keep = replies is not None and i == 0  # the reply the chat goes on with
                tokens = reply_tokens if keep else MAX_TOKENS
                ttft, cached, text = await first_token(http, url, messages, cache, tokens)
                if keep and replies is not None:
                    replies.append(text)
                out[label].append(ttft)
                cells.append(f"{ttft:6.2f} s ({cached:5})")
            print(f"{turn:4} | " + " | ".join(cells), flush=True)
    return out


async def warm_up(http: httpx.AsyncClient, url: str) -> None:
    """A chat of :data:`WARM_TURNS` turns of its own (cache on, :data:`WARM_SYSTEM`'s
    system prompt): what a server that has answered a few chats has compiled."""
    for messages in conversation(WARM_TURNS, system=WARM_SYSTEM):
        await first_token(http, url, messages, True)


def chat_ratios(times: dict[str, list[float]], on: str, llama: str | None) -> None:
    got = times[on]
    if len(got) >= 2:
        print(f"chat {on} | turn {len(got)} over turn 2: {got[-1] / got[1]:4.2f} (goal <= 1.5)")
    if llama is not None and llama in times:
        ratio = got[-1] / times[llama][-1]
        print(f"chat {on} | turn {len(got)} over llama.cpp's: {ratio:4.2f} (goal <= 1.0)")


async def users(url: str, n: int, system_tokens: int) -> None:
    system = _text(3, system_tokens)  # ~1.05 tokens a word in this soup
    medians = {}

    async def one(http: httpx.AsyncClient, i: int, cache: bool, out: list[Any]) -> None:
        question = [{"role": "user", "content": _text(500 + i, 25)}]
        messages = [{"role": "system", "content": system}, *question]
        out[i] = (await first_token(http, url, messages, cache))[:2]

    async with httpx.AsyncClient(timeout=600) as http:
        for label, cache in (("off", False), ("on", True)):
            got: list[Any] = [(0.0, 0)] * n
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, http, i, cache, got)
            times, cached = [t for t, _ in got], [c for _, c in got]
            medians[label] = statistics.median(times)
            print(
                f"users {label:3} | median ttft {medians[label]:6.2f} s, max {max(times):6.2f} s,"
                f" cached tokens {sorted(cached)}",
                flush=True,
            )
    print(f"users | median off/on {medians['off'] / medians['on']:5.1f} (goal >= 5)")


async def rss(url: str, pids: list[int], prompts: int) -> None:
    """Distinct prompts one after another; the nodes' RSS every tenth of the way."""
    every = max(prompts // 10, 1)
    async with httpx.AsyncClient(timeout=600) as http:
        for i in range(prompts):
            text = f"{i}: " + _text(1000 + i, 90)  # distinct from the first token on
            await first_token(http, url, [{"role": "user", "content": text}], True)
            if (i + 1) % every == 0 or i == 0:
                mib = sum(rss_bytes(pid) for pid in pids) / 2**20
                print(f"rss | after {i + 1:4} prompts: {mib:7.1f} MiB", flush=True)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextmanager
def mesh(stages: int, threads: int) -> Iterator[tuple[str, list[int]]]:
    """``stages`` ``meshnode join`` processes serving the model split that many ways; the
    host's API and every process id."""
    env = {"MESHNODE_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), env=env) as cluster:
        token = init_token(Path(tmp) / "mesh.token")
        workers = [cluster.spawn(f"w{i}", token, mdns=False) for i in range(1, stages)]
        cluster.wait_started(*workers)
        peers = [arg for w in workers for arg in ("--peer", w.listen)]
        host = cluster.spawn(
            "host", token, *peers,
            "--model", MODEL, "--split", str(stages), "--context", str(CONTEXT),
            "--speculative", "off", mdns=False,
        )  # fmt: skip
        cluster.wait_started(host)
        try:
            wait_for(lambda: _ready(host, stages), READY_TIMEOUT_S, f"{stages} stages")
        except AssertionError as exc:
            raise SystemExit(f"{exc}\n{cluster.logs()}") from exc
        yield host.api, [n.process.pid for n in cluster.nodes]


def _ready(host: Node, stages: int) -> bool:
    return ready_stages(host) == stages


def llama_bin(option: str | None) -> Path | None:
    """The folder with ``llama-server``: the option, ``$LLAMA_BIN``, the lead's build."""
    for candidate in (option, os.environ.get("LLAMA_BIN")):
        if candidate:
            return Path(candidate)
    found = sorted(Path("/").glob(LLAMA_BIN_GLOB))
    return found[-1] if found and (found[-1] / "llama-server").exists() else None


@contextmanager
def llama_server(folder: Path, threads: int) -> Iterator[str]:
    """``llama-server`` on the same GGUF (prompt caching on, one slot); its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [str(folder / "llama-server"), "-m", str(smollm2_gguf_path()), "-c", str(CONTEXT)]
    cmd += ["-t", str(threads), "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _healthy(url), READY_TIMEOUT_S, "llama-server")
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run(args: argparse.Namespace) -> None:
    skip = set(args.skip)
    replies = args.reply_tokens if args.replies == "model" else 0
    folder = None if "llama" in skip else llama_bin(args.llama_bin)
    if folder is None and "llama" not in skip:
        print("llama.cpp: no llama-server found (--llama-bin): left out")
    if not {"chat", "users", "rss"} <= skip:
        with mesh(1, args.threads) as (url, pids):
            if "chat" not in skip:
                targets = {"meshnode on": (url, True), "meshnode off": (url, False)}
                if folder is None:
                    times = trio.run(chat, targets, args.turns, replies)
                else:
                    with llama_server(folder, args.threads) as llama:
                        targets["llama.cpp"] = (llama, True)
                        times = trio.run(chat, targets, args.turns, replies)
                chat_ratios(times, "meshnode on", "llama.cpp")
            if "users" not in skip:
                trio.run(users, url, args.users, args.system_tokens)
            if "rss" not in skip:
                trio.run(rss, url, pids, args.rss_prompts)
    if "split" not in skip:
        with mesh(2, args.threads) as (url, _):
            times = trio.run(chat, {"2 stages on": (url, True)}, args.turns, replies)
            chat_ratios(times, "2 stages on", None)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--rss-prompts", type=int, default=500)
    parser.add_argument("--threads", type=int, default=2, help="meshnode's and llama.cpp's")
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    parser.add_argument("--llama-bin", help="the folder with llama-server")
    parser.add_argument(
        "--replies", choices=["fixed", "model"], default="fixed",
        help="the chat's assistant turns: fixed texts, or meshnode's own replies",
    )  # fmt: skip
    parser.add_argument("--reply-tokens", type=int, default=48, help="with --replies model")
    args = parser.parse_args()
    print("uptime:", uptime(), flush=True)
    run(args)
    print("uptime:", uptime())


if __name__ == "__main__":
    main()
