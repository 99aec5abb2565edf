"""Concurrency benchmark (issue 16): many streams at once, with continuous batching on and off.

Run: ``.venv/bin/python benchmarks/concurrency.py`` (about 4 minutes on 2 busy cores;
``--streams 1 2 4 8 16 --max-tokens 64 --topologies one three``)

SmolLM2-135M (on the CPU with ``--weights``/``--dtype`` native, float32 or q8, temperature 0,
speculation off) serves ``S`` concurrent
streams of ``--max-tokens`` tokens each, for every ``S`` in ``--streams``, through the
real generation loop and scheduler (8 sequences generate at once; the rest wait for a
slot, as they do behind the HTTP API). Each configuration runs twice, side by side:
batching on (the default) and off (one frame per step, the behaviour before batching).

Topologies: ``one`` is the whole model in this process (``LocalPipeline``); ``three`` is
three stages of a real in-process mesh (coordinator, workers and the wire codec; messages
cross as encoded bytes over in-memory streams), the pipeline ``meshnode join --split 3``
runs, minus the TLS and sockets.

Printed per configuration: aggregate tokens/s (all tokens / wall time of the whole run),
p50/p99 time to first token and time per output token over the streams, and ratios:
batched over unbatched, and aggregate tokens/s over one stream's. On one node, for batching
on, also where a step's time goes: the median forward (``fwd``) and the median time from
the end of one forward to the start of the next (``between``: sampling, the thread
handoffs, the generation loops of all streams and the batcher). The last line measures a
new request's time to first token while 8 other streams decode, over its idle value (goal
≤ 2), and 8 streams' aggregate over one stream's (goal ≥ 4, one node).

``--temperature T`` samples instead (seeded, each stream its own seed; the API's default
is temperature 1), so that the sampler's cost per token shows.

``--api`` measures the serving path through the real HTTP API instead: a single-node
service (as ``meshnode join`` on one machine builds it) behind the node's app and
hypercorn on loopback, and a client in another process streaming ``/v1/completions``
(``S`` at once, usage included), so every token also crosses the SSE layer and a socket.
Printed per ``S``: completion tokens/s as the client sees them, and ``fwd``/``between``
as above.

The machine is shared: ``uptime`` is printed first and last; compare ratios, not times.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from meshnode_packaging.sources import ModelSource
from meshnode_protocol import BATCH_FEATURE, Message, decode_frame, encode_frame

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode.engine.backend import Backend, cpu_backend, limit_cpu_threads
from meshnode.engine.config import ModelConfig
from meshnode.engine.loader import LoadedModel, load_model, resolve_source
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.node.batcher import BatchLimits
from meshnode.node.config import Address
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import Pipeline, RequestId
from meshnode.node.relay import DataMessage, Relay
from meshnode.node.remote import RemotePipeline, is_data_reply
from meshnode.node.stage import StageRunner
from meshnode.node.wire import WireSequences, for_peer
from meshnode.node.worker import WorkerRun
from meshnode.serve.app import create_app, serve_api
from meshnode.serve.generation import GenerationParams, GenerationRun, GenerationState, generate
from meshnode.serve.openai_api import mount_openai
from meshnode.serve.scheduler import Scheduler, SchedulerLimits
from meshnode.serve.single import build_single_node_service
from tests.conftest import smollm2_gguf_path

CONTEXT = 512
#: Sequences each stage (and the scheduler) allows here: all 16 streams of the largest run
#: generate at once (the serving default is 8; beyond it requests wait for a slot).
MAX_SEQUENCES = 16
GREEDY = SamplingParams(temperature=0.0)
#: What the streams sample with (``--temperature``; seeds are per stream).
SAMPLING = GREEDY
# Prompts of different lengths, so that prefills and decodes of different sequences mix.
PROMPT_TEXTS = [
    "The history of the printing press begins",
    "Write a short poem about the sea and the wind, in the style of a sailor's song",
    "List three facts about the planet Mars:",
    "def fibonacci(n):",
]


class Silent:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class Stream:
    ttft_s: float
    tpot_s: float
    tokens: int


@dataclass
class Measure:
    streams: list[Stream]
    wall_s: float

    @property
    def tok_s(self) -> float:
        return sum(s.tokens for s in self.streams) / self.wall_s

    def pct(self, attr: str, q: float) -> float:
        values: list[float] = sorted(getattr(s, attr) for s in self.streams)
        return values[min(len(values) - 1, int(q * len(values)))]


def sampling(stream: int) -> SamplingParams:
    """The sampling of stream number ``stream`` (its own seed when sampling)."""
    return SAMPLING if SAMPLING.greedy else dataclasses.replace(SAMPLING, seed=stream)


class ForwardClock:
    """Times every forward of a stage (its ``forward_batch``, wrapped on the instance)."""

    def __init__(self, stage: Stage) -> None:
        self.spans: list[tuple[float, float]] = []
        inner = stage.forward_batch

        def timed(items: Any) -> list[Any]:
            began = time.perf_counter()
            out = inner(items)
            self.spans.append((began, time.perf_counter()))
            return out

        stage.forward_batch = timed  # type: ignore[method-assign]

    def summary(self) -> str:
        """Median forward and median gap between forwards (steady steps: the first 3
        and the last 3 left out), in ms."""
        spans = self.spans[3:-3] or self.spans
        if len(spans) < 2:
            return ""
        fwd = statistics.median(b - a for a, b in spans) * 1e3
        gap = statistics.median(n[0] - p[1] for p, n in itertools.pairwise(spans)) * 1e3
        return f" | fwd p50 {fwd:5.1f} ms, between p50 {gap:4.2f} ms"


async def one_stream(
    pipeline: Pipeline, scheduler: Scheduler, prompt: list[int], tokens: int, stream: int = 0
) -> Stream:
    params = GenerationParams(max_new_tokens=tokens, sampling=sampling(stream))
    run = GenerationRun(
        scheduler.new_request_id(), prompt, params, GenerationState(params, Silent())
    )
    began = trio.current_time()
    async with scheduler.admit():
        async for _ in generate(pipeline, run):
            pass
    first = run.timings.first_token or began
    end = run.timings.finished or first
    return Stream(first - began, (end - first) / max(1, tokens - 1), len(run.state.tokens))


async def measure(
    pipeline: Pipeline, prompts: list[list[int]], streams: int, tokens: int
) -> Measure:
    scheduler = Scheduler(SchedulerLimits(max_in_flight=MAX_SEQUENCES))
    out: list[Stream] = []

    async def go(i: int) -> None:
        out.append(await one_stream(pipeline, scheduler, prompts[i % len(prompts)], tokens, i))

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(go, i)
    return Measure(out, time.perf_counter() - began)


async def ttft_under_load(
    pipeline: Pipeline, prompts: list[list[int]], tokens: int
) -> tuple[float, float]:
    """A new request's time to first token: idle, and while 8 others decode."""
    scheduler = Scheduler(SchedulerLimits(max_in_flight=MAX_SEQUENCES))
    idle = (await one_stream(pipeline, scheduler, prompts[1], 2)).ttft_s
    loaded = 0.0
    busy = trio.Event()

    async def background(i: int) -> None:
        params = GenerationParams(max_new_tokens=tokens * 4, sampling=sampling(100 + i))
        run = GenerationRun(
            RequestId(f"bg{i}"),
            prompts[i % len(prompts)],
            params,
            GenerationState(params, Silent()),
        )
        async for _ in generate(pipeline, run):
            if len(run.state.tokens) >= 4:
                busy.set()
            if loaded:
                return

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(background, i)
        await busy.wait()
        await trio.sleep(0.2)
        loaded = (await one_stream(pipeline, scheduler, prompts[1], 2)).ttft_s
    return idle, loaded


Factory = Callable[[BatchLimits], Awaitable[Pipeline]]

#: Layers of each of the three stages (SmolLM2-135M has 30).
SPLIT = ((0, 10), (10, 20), (20, 30))


async def three_stages(
    source: ModelSource, backend: Backend, limits: BatchLimits, nursery: trio.Nursery
) -> Pipeline:
    """Stage 0 here (a ``RemotePipeline``) and two relays (the workers' data plane), every
    message encoded and decoded by the wire codec on its way, each stage computing in its
    own worker thread as a node does."""
    config = ModelConfig.from_hf(source.config)
    stages = [
        Stage(config, source, a, b, embed=a == 0, head=b == config.num_layers, backend=backend)
        for a, b in SPLIT
    ]
    runners = [
        StageRunner(stage, context_size=CONTEXT, max_sequences=MAX_SEQUENCES) for stage in stages
    ]
    nodes = ("host", "a", "b")
    inboxes: dict[str, trio.MemorySendChannel[DataMessage]] = {}
    pipeline: RemotePipeline | None = None

    async def send(sender: str, receiver: str, message: Message) -> None:
        for part in for_peer(message, frozenset({BATCH_FEATURE})):
            decoded = decode_frame(memoryview(encode_frame(part))[4:])
            if receiver == "host":
                if pipeline is None or not is_data_reply(decoded):
                    raise AssertionError(f"unexpected {decoded!r} for the host")
                pipeline.deliver(sender, decoded)
            else:
                await inboxes[receiver].send(decoded)  # type: ignore[arg-type]

    for i, node in enumerate(nodes[1:], start=1):
        downstream = nodes[i + 1] if i + 1 < len(nodes) else None
        run = WorkerRun("bench", 1, "host", runner=runners[i], upstream=nodes[i - 1])
        run.downstream, run.wire = downstream, WireSequences(MAX_SEQUENCES)
        inbox, receive = trio.open_memory_channel[DataMessage](64)
        inboxes[node] = inbox
        relay = Relay(node, functools.partial(send, node))
        nursery.start_soon(relay.serve_inbox, run, receive)
    pipeline = RemotePipeline(
        runners[0],
        run_id="bench",
        term=1,
        stage_nodes=nodes,
        send=functools.partial(send, "host"),
        wire_dtype="f16",
        batch_limits=dataclasses.replace(limits, micro_batches=len(nodes)),
    )
    return pipeline


def _cell(m: Measure) -> str:
    ttft = f"TTFT p50 {m.pct('ttft_s', 0.5) * 1e3:5.0f} p99 {m.pct('ttft_s', 0.99) * 1e3:5.0f}"
    tpot = f"TPOT p50 {m.pct('tpot_s', 0.5) * 1e3:4.0f} p99 {m.pct('tpot_s', 0.99) * 1e3:4.0f}"
    return f"{m.tok_s:6.1f} tok/s {ttft} {tpot} ms"


def report(
    name: str, n: int, on: Measure, off: Measure, base: tuple[float, float], steps: str = ""
) -> None:
    ratios = f"on/off {on.tok_s / off.tok_s:4.2f}"
    ratios += f" | vs 1 stream: on {on.tok_s / base[0]:4.2f} off {off.tok_s / base[1]:4.2f}"
    print(f"{name:5} {n:2} | on {_cell(on)} | off {_cell(off)} | {ratios}{steps}", flush=True)


async def bench(
    name: str,
    make: Factory,
    prompts: list[list[int]],
    args: argparse.Namespace,
    clock: ForwardClock | None = None,
) -> None:
    on = await make(BatchLimits(max_frames=MAX_SEQUENCES))
    off = await make(BatchLimits(enabled=False))
    # Warm-up: first-call costs out of the figures. As many streams as the largest run, so
    # that its batch shapes are not first seen in it (at d91eb01 a process's first 8-prompt
    # prefill step took 2.1-2.5 s against ~0.6 s for the next ones, after a 2-prompt one).
    await measure(on, prompts, max(args.streams), 4)
    await measure(off, prompts, 2, 4)
    base: tuple[float, float] | None = None
    for n in args.streams:
        if clock is not None:
            clock.spans.clear()
        batched = await measure(on, prompts, n, args.max_tokens)
        steps = clock.summary() if clock is not None else ""
        plain = await measure(off, prompts, n, args.max_tokens)
        base = base or (batched.tok_s, plain.tok_s)
        report(name, n, batched, plain, base, steps)
    for label, pipeline in (("on", on), ("off", off)):
        idle, loaded = await ttft_under_load(pipeline, prompts, args.max_tokens)
        print(
            f"{name:5} new request's TTFT, batching {label}: idle {idle * 1e3:.0f} ms, "
            f"with 8 streams decoding {loaded * 1e3:.0f} ms, ratio {loaded / idle:.2f}",
            flush=True,
        )


async def run_all(
    args: argparse.Namespace, model: LoadedModel, source: ModelSource, backend: Backend
) -> None:
    prompts = [model.tokenizer.encode_prompt(t) for t in PROMPT_TEXTS]
    async with trio.open_nursery() as nursery:

        async def local(limits: BatchLimits) -> Pipeline:
            runner = StageRunner(model.stage, context_size=CONTEXT, max_sequences=MAX_SEQUENCES)
            return LocalPipeline(runner, limits)

        async def three(limits: BatchLimits) -> Pipeline:
            return await three_stages(source, backend, limits, nursery)

        if "one" in args.topologies:
            await bench("one", local, prompts, args, ForwardClock(model.stage))
        if "three" in args.topologies:
            await bench("three", three, prompts, args)
        nursery.cancel_scope.cancel()


#: The ``--api`` client (another process: a client on this machine competes for its
#: cores, as a real one would): argv is url, model, streams, max tokens, temperature.
API_CLIENT = """
import asyncio, json, sys, time, httpx
url, model, streams, tokens, temperature = sys.argv[1:6]
prompts = json.loads(sys.stdin.read())
async def one(client, i):
    body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": int(tokens),
            "temperature": float(temperature), "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}
    used = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                used = json.loads(line[6:])["usage"]["completion_tokens"]
    return used
async def main():
    async with httpx.AsyncClient(timeout=600) as client:
        began = time.perf_counter()
        used = await asyncio.gather(*(one(client, i) for i in range(int(streams))))
        print(sum(used), time.perf_counter() - began)
asyncio.run(main())
"""


async def api_bench(args: argparse.Namespace, backend: Backend) -> None:
    """``--api``: the streams through the HTTP API (module docstring)."""
    service = build_single_node_service(
        str(smollm2_gguf_path()), context_size=CONTEXT, backend=backend
    )
    clock = ForwardClock(service.pipeline.runner.stage)  # type: ignore[union-attr]
    app = create_app(lambda: {"node": {"node_id": "bench"}})
    mount_openai(app, service)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_api, app, Address("127.0.0.1", 0))
        prompts = json.dumps(PROMPT_TEXTS).encode()
        for n in [max(args.streams), *args.streams]:  # the first run warms up
            clock.spans.clear()
            url, temperature = f"http://{address}", str(SAMPLING.temperature)
            argv = [url, service.model_id, str(n), str(args.max_tokens), temperature]
            done = await trio.run_process(
                [sys.executable, "-c", API_CLIENT, *argv], stdin=prompts, capture_stdout=True
            )
            tokens, seconds = done.stdout.split()
            rate = int(tokens) / float(seconds)
            print(f"api   {n:2} | {rate:6.1f} tok/s at the client{clock.summary()}", flush=True)
        nursery.cancel_scope.cancel()


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling"
    )
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (README)")
    parser.add_argument(
        "--weights",
        "--dtype",
        default="native",
        choices=["native", "float32", "q8"],
        help="CPU weights (meshnode's --dtype; q8: 8-bit activations, inexact)",
    )
    topologies = ["one", "three"]
    parser.add_argument("--topologies", nargs="+", default=topologies, choices=topologies)
    parser.add_argument("--api", action="store_true", help="through the HTTP API instead")
    args = parser.parse_args()
    global SAMPLING
    SAMPLING = SamplingParams(temperature=args.temperature)
    print("uptime:", uptime(), "sampling:", SAMPLING, flush=True)
    limit = limit_cpu_threads(args.threads)  # the limit lasts while the handle is referenced
    source = resolve_source(str(smollm2_gguf_path()))
    backend = cpu_backend(args.weights)
    print("weights:", args.weights, flush=True)
    if args.api:
        trio.run(api_bench, args, backend)
        print("uptime:", uptime(), "threads handle:", type(limit).__name__)
        return
    model = load_model(str(smollm2_gguf_path()), backend)
    trio.run(run_all, args, model, source, backend)
    print("uptime:", uptime(), "threads handle:", type(limit).__name__)


if __name__ == "__main__":
    main()
