"""The coordinator with real workers in this process, joined by an in-memory mesh.

The workers are the real :class:`~meshnode.node.worker.Worker` and fetch their layers of a
tiny model from a loopback hub, as nodes on other machines would. Only the transport is
replaced: the mesh delivers each message by calling the receiver directly (the network is
not the point here; tests/e2e covers it with real processes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio
from meshnode_packaging.refs import open_ref
from meshnode_packaging.testing import LocalHub
from meshnode_packaging.writer import write_package
from meshnode_protocol import Message, PeerInfo

from meshnode.engine.backend import cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.node.coordinator import Coordinator, CoordinatorSettings, model_footprint
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame
from meshnode.node.planner import NodeCapacity
from meshnode.node.remote import RemotePipeline, is_data_reply
from meshnode.node.worker import Worker
from tests.engine.tiny import write_tiny_model

HOST = "host"
REF = "hf://test/tiny"
CONTEXT = 64
GREEDY = SamplingParams(temperature=0.0)
PROMPT = (1, 5, 9, 14, 3)
STEPS = 6
BRING_UP_TIMEOUT_S = 60.0


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

    def peer_info(self, node_id: str) -> PeerInfo:
        return PeerInfo(node_id=node_id, address=f"{node_id}.invalid:7470")

    async def send(self, node_id: str, message: Message) -> None:
        await self.deliver(HOST, node_id, message)

    async def deliver(self, sender: str, receiver: str, message: Message) -> None:
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

    async def wait_changed(self) -> None:
        await self._changed.wait()


def add_worker(
    mesh: InMemoryMesh, node_id: str, cache_dir: Path, nursery: trio.Nursery
) -> None:
    async def send(peer: str, message: Message) -> None:
        await mesh.deliver(node_id, peer, message)

    async def connect(info: PeerInfo) -> None:
        assert info.node_id == HOST or info.node_id in mesh.workers

    mesh.workers[node_id] = Worker(
        node_id, send, connect=connect, backend=cpu_backend(), cache_dir=cache_dir, nursery=nursery
    )


@pytest.fixture
def hub_ref(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """The tiny model as a layer package on a loopback hub; (ref, package folder)."""
    gguf_path = write_tiny_model(tmp_path / "model", "Q8_0")
    package = tmp_path / "package"
    write_package(gguf_path, package)
    with LocalHub() as hub:
        hub.add_repo("test/tiny", package)
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield REF, package


def greedy_reference(package: Path) -> list[int]:
    """Tokens a single whole-model stage decodes greedily from ``PROMPT``."""
    source = open_ref(package)
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, 0, config.num_layers, embed=True, head=True)
    cache = stage.new_cache(CONTEXT)
    logits = stage.forward(np.asarray(PROMPT), 0, cache, out_rows=1)
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(STEPS - 1):
        logits = stage.forward(np.asarray(tokens[-1:]), cache.length, cache, out_rows=1)
        tokens.append(int(np.argmax(logits[-1])))
    return tokens


async def decode(pipeline: RemotePipeline) -> list[int]:
    request = RequestId("req-1")
    result = await pipeline.run(StepFrame(request, FrameKind.PREFILL, 0, PROMPT, GREEDY))
    tokens = list(result.tokens)
    while len(tokens) < STEPS:
        position = len(PROMPT) + len(tokens) - 1
        frame = StepFrame(request, FrameKind.DECODE, position, (tokens[-1],), GREEDY)
        tokens += (await pipeline.run(frame)).tokens
    await pipeline.release(request)
    return tokens


async def test_a_failed_prepare_replans_without_the_node(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    ref, package = hub_ref
    config = ModelConfig.from_hf(open_ref(package).config)
    footprint = model_footprint(config)
    # The host holds about half the model, so every plan needs at least one worker.
    whole = sum(footprint.layer_bytes) + footprint.embed_bytes * 2 + footprint.head_bytes
    whole += footprint.kv_bytes_per_token_per_layer * config.num_layers * CONTEXT
    mesh = InMemoryMesh(host_memory=whole // 2)
    # "broken" cannot materialize: its cache directory lies under a regular file.
    (tmp_path / "not-a-dir").write_text("")
    served: list[RemotePipeline] = []
    serving = trio.Event()

    def on_pipeline(pipeline: RemotePipeline | None) -> None:
        if pipeline is not None:
            served.append(pipeline)
            serving.set()

    async with trio.open_nursery() as nursery:
        add_worker(mesh, "broken", tmp_path / "not-a-dir" / "cache", nursery)
        add_worker(mesh, "good", tmp_path / "good-cache", nursery)
        coordinator = Coordinator(
            mesh,
            CoordinatorSettings(model_ref=ref, context_size=CONTEXT, split=3),
            source=open_ref(package),
            backend=cpu_backend(),
            on_pipeline=on_pipeline,
        )
        mesh.coordinator = coordinator
        nursery.start_soon(coordinator.run)
        with trio.fail_after(BRING_UP_TIMEOUT_S):
            await serving.wait()
        assert "node broken could not prepare" in coordinator.status()["last_failure"]
        tokens = await decode(served[0])
        nursery.cancel_scope.cancel()
    # The first run (three stages) failed on "broken"; the replan ran without it.
    assert served[0].stage_nodes == (HOST, "good")
    assert mesh.workers["broken"].run is None  # stopped with the failed run
    assert tokens == greedy_reference(package)


async def test_every_stage_reports_its_compute_time(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    # Three stages: the middle one's compute reaches the host through the frame, so the
    # console can show compute per stage and the wire time as what is left of a pass.
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    served: list[RemotePipeline] = []
    serving = trio.Event()

    def on_pipeline(pipeline: RemotePipeline | None) -> None:
        if pipeline is not None:
            served.append(pipeline)
            serving.set()

    async with trio.open_nursery() as nursery:
        add_worker(mesh, "a", tmp_path / "a-cache", nursery)
        add_worker(mesh, "b", tmp_path / "b-cache", nursery)
        coordinator = Coordinator(
            mesh,
            CoordinatorSettings(model_ref=ref, context_size=CONTEXT, split=3),
            source=open_ref(package),
            backend=cpu_backend(),
            on_pipeline=on_pipeline,
        )
        mesh.coordinator = coordinator
        nursery.start_soon(coordinator.run)
        with trio.fail_after(BRING_UP_TIMEOUT_S):
            await serving.wait()
        pipeline = served[0]
        request = RequestId("req-1")
        result = await pipeline.run(StepFrame(request, FrameKind.PREFILL, 0, PROMPT, GREEDY))
        frame = StepFrame(request, FrameKind.DECODE, len(PROMPT), result.tokens, GREEDY)
        decoded = await pipeline.run(frame)
        await pipeline.release(request)
        nursery.cancel_scope.cancel()
    assert pipeline.stage_nodes == (HOST, "a", "b")
    for step in (result, decoded):
        assert len(step.stage_compute_s) == 3
        assert all(seconds > 0 for seconds in step.stage_compute_s)
        assert step.compute_s == pytest.approx(sum(step.stage_compute_s))
