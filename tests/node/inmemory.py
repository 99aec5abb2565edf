"""A coordinator and real workers in this process, joined by an in-memory mesh.

The workers are the real :class:`~meshnode.node.worker.Worker` and fetch their layers of a
tiny model from a loopback hub (the ``hub_ref`` fixture in ``conftest.py``), as nodes on
other machines would. Only the transport is replaced: the mesh delivers each message by
calling the receiver directly (the network is not the point here; tests/e2e and tests/lab
cover it with real processes), after a trip through the wire codec, as over a session: a
sender reuses a sequence's activation buffer for its next frame once the previous one is
encoded, so handing over the message object itself would let a queued frame change.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import trio
from meshnode_packaging.refs import open_ref
from meshnode_protocol import Message, PeerInfo, PeerLink, decode_frame, encode_frame

from meshnode.engine.backend import cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.node.coordinator import Coordinator
from meshnode.node.mesh import CoordinatorSettings
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame
from meshnode.node.planner import NodeCapacity
from meshnode.node.remote import PassDeadline, RemotePipeline, is_data_reply
from meshnode.node.worker import Worker

HOST = "host"
REF = "hf://test/tiny"
CONTEXT = 64
GREEDY = SamplingParams(temperature=0.0)
PROMPT = (1, 5, 9, 14, 3)
STEPS = 6
BRING_UP_TIMEOUT_S = 60.0

NextPipeline = Callable[[], Awaitable[RemotePipeline | None]]


class InMemoryMesh:
    """The host's ``MeshView`` over workers that live in this process."""

    def __init__(self, host_memory: int) -> None:
        self.host_memory = host_memory
        self.workers: dict[str, Worker] = {}
        self.coordinator: Coordinator | None = None
        self._changed = trio.Event()

    @property
    def node_id(self) -> str:
        return HOST

    def live_nodes(self) -> list[NodeCapacity]:
        workers = [NodeCapacity(node_id, 1 << 34) for node_id in sorted(self.workers)]
        return [NodeCapacity(HOST, self.host_memory), *workers]

    def suspects(self) -> dict[str, float]:
        return {}  # a worker here is in the mesh or not (tests/node/test_suspects.py: both)

    def peer_info(self, node_id: str) -> PeerInfo:
        return PeerInfo(node_id=node_id, address=f"{node_id}.invalid:7470")

    async def send(self, node_id: str, message: Message) -> None:
        await self.deliver(HOST, node_id, message)

    async def deliver(self, sender: str, receiver: str, message: Message) -> None:
        message = decode_frame(memoryview(encode_frame(message))[4:])
        if receiver == HOST:
            # As the daemon's sessions do: data replies straight to the live pipeline.
            assert self.coordinator is not None
            if is_data_reply(message):
                if (pipeline := self.coordinator.pipeline) is not None:
                    pipeline.deliver(sender, message)
                return
            assert self.coordinator.handle(sender, message), message
        else:
            assert await self.workers[receiver].handle(sender, message), message

    def membership_event(self) -> trio.Event:
        return self._changed

    def changed(self) -> None:
        """Wake the coordinator: the membership changed (a worker joined or was lost)."""
        self._changed.set()
        self._changed = trio.Event()


def add_worker(
    mesh: InMemoryMesh,
    node_id: str,
    cache_dir: Path,
    nursery: trio.Nursery,
    links: Callable[[], tuple[PeerLink, ...]] = tuple,
    *,
    measure_when_asked: bool = False,
) -> None:
    """A real worker ``node_id`` on ``mesh``; ``links``: what it reports of its links to its
    peers now (the daemon's are measured: node/links.py); ``measure_when_asked``: as the
    daemon's, a cold worker measures itself when a ``SpeedQuery`` asks."""

    async def send(peer: str, message: Message) -> None:
        await mesh.deliver(node_id, peer, message)

    async def connect(info: PeerInfo) -> None:
        assert info.node_id == HOST or info.node_id in mesh.workers

    mesh.workers[node_id] = Worker(
        node_id,
        send,
        connect=connect,
        backend=cpu_backend(),
        cache_dir=cache_dir,
        nursery=nursery,
        links=links,
        measure_when_asked=measure_when_asked,
    )


def greedy_reference(
    package: Path, prompt: tuple[int, ...] = PROMPT, steps: int = STEPS, context: int = CONTEXT
) -> list[int]:
    """Tokens a single whole-model stage decodes greedily from ``prompt`` (``steps`` of
    them, in a cache of ``context`` positions)."""
    source = open_ref(package)
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, 0, config.num_layers, embed=True, head=True)
    cache = stage.new_cache(context)
    logits = stage.forward(np.asarray(prompt), 0, cache, out_rows=1)
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(steps - 1):
        logits = stage.forward(np.asarray(tokens[-1:]), cache.length, cache, out_rows=1)
        tokens.append(int(np.argmax(logits[-1])))
    return tokens


async def prefill(pipeline: RemotePipeline, request: RequestId) -> list[int]:
    """Prefill ``PROMPT`` as ``request``; the first token."""
    result = await pipeline.run(StepFrame(request, FrameKind.PREFILL, 0, PROMPT, GREEDY))
    return list(result.tokens)


async def finish(pipeline: RemotePipeline, request: RequestId, tokens: list[int]) -> list[int]:
    """Decode ``request`` greedily up to ``STEPS`` tokens, then release it."""
    while len(tokens) < STEPS:
        position = len(PROMPT) + len(tokens) - 1
        frame = StepFrame(request, FrameKind.DECODE, position, (tokens[-1],), GREEDY)
        tokens += (await pipeline.run(frame)).tokens
    await pipeline.release(request)
    return tokens


async def decode(pipeline: RemotePipeline, request: str = "req-1") -> list[int]:
    """``STEPS`` greedy tokens after ``PROMPT``, on ``pipeline``."""
    tokens = await prefill(pipeline, RequestId(request))
    return await finish(pipeline, RequestId(request), tokens)


async def serve(
    mesh: InMemoryMesh,
    ref: str,
    package: Path,
    split: int,
    nursery: trio.Nursery,
    *,
    place_by_speed: bool = True,
) -> RemotePipeline:
    """Start a coordinator on ``mesh`` and return its first pipeline (``place_by_speed``
    False: ``--placement memory``)."""
    pipelines: list[RemotePipeline] = []
    ready = trio.Event()

    def on_pipeline(pipeline: RemotePipeline | None) -> None:
        if pipeline is not None:
            pipelines.append(pipeline)
            ready.set()

    coordinator = Coordinator(
        mesh,
        CoordinatorSettings(
            model_ref=ref, context_size=CONTEXT, split=split, place_by_speed=place_by_speed
        ),
        source=open_ref(package),
        backend=cpu_backend(),
        on_pipeline=on_pipeline,
    )
    mesh.coordinator = coordinator
    nursery.start_soon(coordinator.run)
    with trio.fail_after(BRING_UP_TIMEOUT_S):
        await ready.wait()
    return pipelines[0]


def split_host(
    mesh: InMemoryMesh,
    hub_ref: tuple[str, Path],
    nursery: trio.Nursery,
    deadline: PassDeadline | None = None,
    *,
    calibrate: bool = False,
    cache_dir: Path | None = None,
) -> tuple[Coordinator, NextPipeline]:
    """A ``--split 2`` host on ``mesh`` (``calibrate``: timing each new pipeline before it
    serves, as ``join`` does; ``cache_dir``: the host's cache folder), and a receiver of
    each pipeline it hands out (None: the old one was dropped), bounded in time."""
    ref, package = hub_ref
    send, pipelines = trio.open_memory_channel[RemotePipeline | None](16)
    settings = CoordinatorSettings(
        model_ref=ref,
        context_size=CONTEXT,
        split=2,
        pass_deadline=deadline or PassDeadline(),
        calibrate=calibrate,
        cache_dir=cache_dir,
    )
    coordinator = Coordinator(
        mesh,
        settings,
        source=open_ref(package),
        backend=cpu_backend(),
        on_pipeline=send.send_nowait,
    )
    mesh.coordinator = coordinator
    nursery.start_soon(coordinator.run)

    async def next_pipeline() -> RemotePipeline | None:
        with trio.fail_after(BRING_UP_TIMEOUT_S):
            return await pipelines.receive()

    return coordinator, next_pipeline
