"""Concurrency benchmark (issue 16): many streams at once, with continuous batching on and off.

Run: ``.venv/bin/python benchmarks/concurrency.py`` (about 4 minutes on 2 busy cores;
``--streams 1 2 4 8 16 --max-tokens 64 --topologies one three``)

SmolLM2-135M (on the CPU with ``--weights``/``--dtype`` native, float32 or q8, KV caches of
``--kv-dtype`` (auto: f16 with q8, else f32; ``--api`` takes auto), temperature 0,
speculation off) serves ``S`` concurrent
streams of ``--max-tokens`` tokens each, for every ``S`` in ``--streams``, through the
real generation loop and scheduler (8 sequences generate at once; the rest wait for a
slot, as they do behind the HTTP API). Each configuration runs twice, side by side:
batching on (the default) and off (one frame per step, the behaviour before batching).

Topologies: ``one`` is the whole model in this process (``LocalPipeline``); ``three`` is
three stages of a real in-process mesh (coordinator, workers and the wire codec; messages
cross as encoded bytes over in-memory streams), the pipeline ``meshnode join --split 3``
runs, minus the TLS and sockets.

``--baseline unqueued`` compares batching on with batching on as the generation loop ran
it before it queued each sequence's next decode frame ahead (before handing the token to
its client), instead of with batching off. ``--baseline stepwise`` compares it with
batching on without running ahead (every step handed back to the event loop, and the next
one gathered there: ``BatchLimits(ahead=False)``, the default). ``--ahead`` runs batching
on ahead in the compute thread for any number of sequences: ``--ahead --baseline
stepwise`` measures what running ahead gains.

``--rounds N`` runs every configuration N times, alternating (each round: every ``S``,
batching on then the baseline), and prints medians: the load of a shared machine drifts
within seconds, and one 32-token run of one stream lasts a third of a second.

Printed per configuration: aggregate tokens/s (all tokens / wall time of the whole run;
the median over the rounds), p50/p99 time to first token and time per output token over
the streams of all rounds, and ratios (medians over the rounds of each round's ratio):
batched over the baseline, and aggregate tokens/s over the first ``S``'s. On one node,
for batching on, also where the run's time goes: its prefill forwards (forwards of more
rows than streams: the prompts; their share of the wall), the median decode forward
(``fwd``) and the median time from the end of one forward to the start of the next
(``between``: sampling, the thread handoffs, the generation loops of all streams and the
batcher), and the same for the baseline. ``S`` streams' aggregate over one stream's is
at most ``S x (P1 + n f1) / (PS + n fS)`` whatever happens between forwards (``P``:
prefill, ``f``: decode forward, ``n``: tokens after the first). The last lines measure a
new request's time to first token while 8 other streams decode, over its idle value (goal
≤ 2); the goal for 8 streams' aggregate is ≥ 4x one stream's (one node).

``--temperature T`` samples instead (seeded, each stream its own seed; the API's default
is temperature 1), so that the sampler's cost per token shows; ``--top-p P`` adds top-p
truncation. ``--baseline greedy`` compares those sampled streams with the same streams
greedy, on the same pipeline (issue 35's goal: 8 seeded streams at temperature 0.7 and
top-p 0.9 reach >= 0.9x the greedy aggregate): ``--streams 1 8 --max-tokens 128
--topologies one --temperature 0.7 --top-p 0.9 --baseline greedy --rounds 3``.

``--api`` measures the serving path through the real HTTP API instead: a single-node
service (as ``meshnode join`` on one machine builds it) behind the node's app and
hypercorn on loopback, and a client in another process streaming ``/v1/completions``
(``S`` at once, usage included), so every token also crosses the SSE layer and a socket.
Printed per ``S`` (and per variant, with ``--baseline unqueued``) and round: completion
tokens/s as the client sees them, and ``fwd``/``between`` as above; then medians.

The machine is shared: ``uptime`` is printed first and last; compare ratios, not times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from meshnode_packaging.sources import ModelSource
from meshnode_protocol import BATCH_FEATURE, Message, decode_frame, encode_frame

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode.engine.backend import Backend, cpu_backend, limit_cpu_threads
from meshnode.engine.config import ModelConfig
from meshnode.engine.kv_cache import KV_DTYPES
from meshnode.engine.loader import LoadedModel, load_model, resolve_source
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.batcher import BatchLimits
from meshnode.node.config import Address
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import Pipeline, RequestId, StepFrame, StepResult
from meshnode.node.relay import Relay
from meshnode.node.remote import RemotePipeline, is_data_reply
from meshnode.node.stage import StageRunner
from meshnode.node.wire import WireSequences, for_peer
from meshnode.node.worker_run import DataMessage, WorkerRun
from meshnode.serve.app import create_app, serve_api
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
KV_DTYPE = "auto"  # --kv-dtype
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


@contextlib.contextmanager
def greedy_streams(on: bool) -> Iterator[None]:
    """While ``on``, every stream decodes greedily (``--baseline greedy``'s runs)."""
    global SAMPLING
    kept = SAMPLING
    SAMPLING = GREEDY if on else kept
    try:
        yield
    finally:
        SAMPLING = kept


class ForwardClock:
    """Times every forward of a stage (its ``forward_batch``, wrapped on the instance),
    with its rows."""

    def __init__(self, stage: Stage) -> None:
        self.spans: list[tuple[float, float, int]] = []
        inner = stage.forward_batch

        def timed(items: Any) -> list[Any]:
            began = time.perf_counter()
            out = inner(items)
            self.spans.append((began, time.perf_counter(), sum(len(i.inputs) for i in items)))
            return out

        stage.forward_batch = timed  # type: ignore[method-assign]

    def summary(self) -> str:
        """Median forward and median gap between forwards (steady steps: the first 3
        and the last 3 left out), in ms."""
        spans = self.spans[3:-3] or self.spans
        if len(spans) < 2:
            return ""
        fwd = statistics.median(b - a for a, b, _ in spans) * 1e3
        gap = statistics.median(n[0] - p[1] for p, n in itertools.pairwise(spans)) * 1e3
        return f" | fwd p50 {fwd:5.1f} ms, between p50 {gap:4.2f} ms"

    def cut(self, streams: int) -> Cut:
        """Where the last run's time went: its prefill forwards (more rows than streams),
        its decode forwards and the gaps between forwards."""
        decode = [b - a for a, b, rows in self.spans if rows <= streams]
        gaps = [n[0] - p[1] for p, n in itertools.pairwise(self.spans)]
        prefill = sum(b - a for a, b, rows in self.spans if rows > streams)
        return Cut(prefill, statistics.median(decode or [0.0]), statistics.median(gaps or [0.0]))


@dataclass(frozen=True)
class Cut:
    """One run's time by part, in seconds: all its prefill forwards, the median decode
    forward and the median gap between forwards (sampling, thread hand-offs, the
    generation loops and the batcher)."""

    prefill_s: float
    decode_s: float
    between_s: float


class Unqueued:
    """A pipeline as the generation loop saw one before it queued decode frames ahead
    (``run`` and ``release`` only: ``--baseline unqueued``)."""

    def __init__(self, inner: Pipeline) -> None:
        self.inner = inner

    @property
    def context_size(self) -> int:
        return self.inner.context_size

    async def run(self, frame: StepFrame) -> StepResult:
        return await self.inner.run(frame)

    async def release(self, request_id: RequestId) -> None:
        await self.inner.release(request_id)


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
        prompt = prompts[i % len(prompts)]
        budget = min(tokens * 4, CONTEXT - len(prompt) - 1)  # within the context
        params = GenerationParams(max_new_tokens=budget, sampling=sampling(100 + i))
        run = GenerationRun(
            RequestId(f"bg{i}"),
            prompt,
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
    kw = {"backend": backend, "kv_dtype": KV_DTYPE}
    stages = [
        Stage(config, source, a, b, embed=a == 0, head=b == config.num_layers, **kw)  # type: ignore[arg-type]
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


def _cell(runs: list[Measure]) -> str:
    """Median tokens/s over the rounds; TTFT and TPOT percentiles over all their streams."""
    p = Measure([st for m in runs for st in m.streams], 1.0).pct
    ttft = f"TTFT p50 {p('ttft_s', 0.5) * 1e3:5.0f} p99 {p('ttft_s', 0.99) * 1e3:5.0f}"
    tpot = f"TPOT p50 {p('tpot_s', 0.5) * 1e3:4.0f} p99 {p('tpot_s', 0.99) * 1e3:4.0f}"
    return f"{statistics.median(m.tok_s for m in runs):6.1f} tok/s {ttft} {tpot} ms"


def _ratio(a: list[Measure], b: list[Measure]) -> float:
    """Median over the rounds of ``a``'s tokens/s over ``b``'s in the same round (both
    measured minutes apart at most: the machine's load changes less within a round)."""
    return statistics.median(x.tok_s / y.tok_s for x, y in zip(a, b, strict=True))


def _cuts(cuts: list[Cut], wall_s: float) -> str:
    prefill = statistics.median(c.prefill_s for c in cuts) * 1e3
    fwd = statistics.median(c.decode_s for c in cuts) * 1e3
    gap = statistics.median(c.between_s for c in cuts) * 1e3
    share = prefill / wall_s / 1e3 * 100
    return (
        f"prefill {prefill:4.0f} ms ({share:2.0f} %), fwd p50 {fwd:5.1f}, between p50 {gap:4.2f} ms"
    )


Cuts = dict[tuple[str, int], list[Cut]]


def report(
    name: str, n: int, runs: dict[tuple[str, int], list[Measure]], first: int, cuts: Cuts
) -> None:
    on, off = runs["on", n], runs["off", n]
    ratios = f"on/off {_ratio(on, off):4.2f}"
    ratios += f" | vs {first} stream: on {_ratio(on, runs['on', first]):4.2f}"
    ratios += f" off {_ratio(off, runs['off', first]):4.2f}"
    line = f"{name:5} {n:2} | on {_cell(on)} | off {_cell(off)} | {ratios}"
    if cuts:
        wall = statistics.median(m.wall_s for m in on)
        line += f" | on: {_cuts(cuts['on', n], wall)}"
        wall_off = statistics.median(m.wall_s for m in off)
        line += f" | off: {_cuts(cuts['off', n], wall_off)}"
    print(line, flush=True)


async def bench(
    name: str,
    make: Factory,
    prompts: list[list[int]],
    args: argparse.Namespace,
    clock: ForwardClock | None = None,
) -> None:
    """Batching on against the baseline (``--baseline``), ``--rounds`` times, alternating."""
    on = await make(BatchLimits(max_frames=MAX_SEQUENCES, ahead=args.ahead))
    if args.baseline == "unqueued":
        off: Pipeline = Unqueued(await make(BatchLimits(max_frames=MAX_SEQUENCES)))
    elif args.baseline == "stepwise":
        off = await make(BatchLimits(max_frames=MAX_SEQUENCES, ahead=False))
    elif args.baseline == "greedy":
        off = on  # the same pipeline, its streams greedy (greedy_streams)
    else:
        off = await make(BatchLimits(enabled=False))
    # Warm-up: first-call costs out of the figures. As many streams as the largest run, so
    # that its batch shapes are not first seen in it (at d91eb01 a process's first 8-prompt
    # prefill step took 2.1-2.5 s against ~0.6 s for the next ones, after a 2-prompt one).
    await measure(on, prompts, max(args.streams), 4)
    with greedy_streams(args.baseline == "greedy"):
        await measure(off, prompts, 2, 4)
    runs: dict[tuple[str, int], list[Measure]] = {}
    cuts: Cuts = {}
    for _ in range(args.rounds):
        for n in args.streams:
            for label, pipeline in (("on", on), ("off", off)):
                if clock is not None:
                    clock.spans.clear()
                with greedy_streams(label == "off" and args.baseline == "greedy"):
                    measured = await measure(pipeline, prompts, n, args.max_tokens)
                runs.setdefault((label, n), []).append(measured)
                if clock is not None:
                    cuts.setdefault((label, n), []).append(clock.cut(n))
    for n in args.streams:
        report(name, n, runs, args.streams[0], cuts)
    for label, pipeline in (("on", on), ("off", off)):
        idle, loaded = await ttft_under_load(pipeline, prompts, args.max_tokens)
        print(
            f"{name:5} new request's TTFT, {label}: idle {idle * 1e3:.0f} ms, "
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


#: The ``--api`` client (benchmarks/api_client.py), run as another process.
API_CLIENT = Path(__file__).with_name("api_client.py")


async def api_bench(args: argparse.Namespace, backend: Backend) -> None:
    """``--api``: the streams through the HTTP API (module docstring)."""
    service = build_single_node_service(
        str(smollm2_gguf_path()), context_size=CONTEXT, backend=backend
    )
    clock = ForwardClock(service.pipeline.runner.stage)  # type: ignore[union-attr]
    app = create_app(lambda: {"node": {"node_id": "bench"}})
    mount_openai(app, service)
    queued = service.pipeline
    assert queued is not None
    variants: list[tuple[str, Pipeline]] = [("on", queued)]
    if args.baseline == "unqueued":
        variants.append(("unqueued", Unqueued(queued)))
    rates: dict[tuple[str, int], list[float]] = {}
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_api, app, Address("127.0.0.1", 0))
        prompts = json.dumps(PROMPT_TEXTS).encode()

        async def client(n: int) -> float:
            url, knobs = f"http://{address}", [str(SAMPLING.temperature), str(SAMPLING.top_p)]
            argv = [url, service.model_id, str(n), str(args.max_tokens), *knobs]
            done = await trio.run_process(
                [sys.executable, str(API_CLIENT), *argv], stdin=prompts, capture_stdout=True
            )
            tokens, seconds = done.stdout.split()
            return int(tokens) / float(seconds)

        await client(max(args.streams))  # warm-up
        for _ in range(args.rounds):
            for n in args.streams:
                for label, pipeline in variants:
                    service.pipeline = pipeline
                    clock.spans.clear()
                    rate = await client(n)
                    rates.setdefault((label, n), []).append(rate)
                    print(
                        f"api   {n:2} {label:8} | {rate:6.1f} tok/s at the client{clock.summary()}",
                        flush=True,
                    )
        nursery.cancel_scope.cancel()
    first = args.streams[0]
    for label, _ in variants:
        for n in args.streams:
            ratio = statistics.median(
                x / y for x, y in zip(rates[label, n], rates[label, first], strict=True)
            )
            median = statistics.median(rates[label, n])
            print(
                f"api   {n:2} {label:8} | median {median:6.1f} tok/s, vs {first} "
                f"stream {ratio:4.2f}"
            )


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
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p of the sampled streams")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (README)")
    parser.add_argument(
        "--weights",
        "--dtype",
        default="native",
        choices=["native", "float32", "q8"],
        help="CPU weights (meshnode's --dtype; q8: 8-bit activations, inexact)",
    )
    parser.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="KV caches")
    topologies = ["one", "three"]
    parser.add_argument("--topologies", nargs="+", default=topologies, choices=topologies)
    parser.add_argument("--api", action="store_true", help="through the HTTP API instead")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds; medians")
    parser.add_argument(
        "--baseline",
        default="unbatched",
        choices=["unbatched", "unqueued", "stepwise", "greedy"],
        help="what batching on is compared with: batching off, batching on without "
        "the decode frames queued ahead (the generation loop before it queued them), "
        "batching on without running steps ahead in the compute thread, or the same "
        "streams greedy (with --temperature: what sampling costs)",
    )
    parser.add_argument(
        "--ahead",
        action="store_true",
        help="batching on runs decode steps ahead in the compute thread for any number "
        "of sequences (one node; off by default: BatchLimits.ahead)",
    )
    args = parser.parse_args()
    global SAMPLING, KV_DTYPE
    SAMPLING = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    KV_DTYPE = args.kv_dtype
    print("uptime:", uptime(), "sampling:", SAMPLING, flush=True)
    limit = limit_cpu_threads(args.threads)  # the limit lasts while the handle is referenced
    source = resolve_source(str(smollm2_gguf_path()))
    backend = cpu_backend(args.weights)
    print("weights:", args.weights, flush=True)
    if args.api:
        trio.run(api_bench, args, backend)
        print("uptime:", uptime(), "threads handle:", type(limit).__name__)
        return
    model = load_model(str(smollm2_gguf_path()), backend, args.kv_dtype)
    print("KV:", model.stage.kv_dtype, flush=True)
    trio.run(run_all, args, model, source, backend)
    print("uptime:", uptime(), "threads handle:", type(limit).__name__)


if __name__ == "__main__":
    main()
