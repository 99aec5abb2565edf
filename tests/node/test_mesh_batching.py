"""Continuous batching across a 3-stage mesh: a step crosses every stage as one message,
several micro-batches are in flight at once, and every stream equals its solo run.

The coordinator and the workers are real (tests/node/inmemory.py); this mesh also passes
every message through the wire codec (encode, then decode from the bytes), as a session
would, and counts what crossed.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import trio
import trio.testing
from meshnode_protocol import ActivationBatch, Message, Release, decode_frame, encode_frame

from meshnode.engine.sampling import SamplingParams
from meshnode.node.batcher import BatchLimits
from meshnode.node.pipeline import FrameKind, PipelineError, RequestId, StepFrame
from meshnode.node.remote import RemotePipeline
from meshnode.node.worker import Worker
from tests.node.inmemory import HOST, InMemoryMesh, add_worker, serve

PROMPTS = [(1, 5, 9, 14, 3), (7, 7, 2), (30, 31, 32, 33, 34, 35, 36), (4,), (11, 12), (40, 2, 9)]
TOKENS = 12
GREEDY = SamplingParams(temperature=0.0)


def _live(worker: Worker) -> int:
    runner = worker.run.runner if worker.run is not None else None
    return runner.live_sequences if runner is not None else 0


class WireMesh(InMemoryMesh):
    """The in-memory mesh, each message encoded and decoded on its way, and counted; the
    host's steps in flight (sent, not yet answered) are tracked at their peak."""

    def __init__(self, host_memory: int) -> None:
        super().__init__(host_memory)
        self.sent: Counter[tuple[str, str]] = Counter()
        self.batch_sizes: list[int] = []
        self.in_flight = 0
        self.peak_in_flight = 0

    async def deliver(self, sender: str, receiver: str, message: Message) -> None:
        message = decode_frame(memoryview(encode_frame(message))[4:])
        self.sent[(sender, type(message).__name__)] += 1
        if sender == HOST and type(message).__name__ in ("ActivationFrame", "ActivationBatch"):
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        if receiver == HOST and type(message).__name__ in ("Prediction", "PredictionBatch"):
            self.in_flight -= 1
        if isinstance(message, ActivationBatch):
            self.batch_sizes.append(len(message.frames))
        await super().deliver(sender, receiver, message)


async def _stream(pipeline: RemotePipeline, request: str, prompt: tuple[int, ...]) -> list[int]:
    rid = RequestId(request)
    result = await pipeline.run(StepFrame(rid, FrameKind.PREFILL, 0, prompt, GREEDY))
    tokens = list(result.tokens)
    while len(tokens) < TOKENS:
        frame = StepFrame(
            rid, FrameKind.DECODE, len(prompt) + len(tokens) - 1, (tokens[-1],), GREEDY
        )
        tokens += (await pipeline.run(frame)).tokens
    await pipeline.release(rid)
    return tokens


async def test_concurrent_streams_across_three_stages(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    ref, package = hub_ref
    mesh = WireMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "a", tmp_path / "a-cache", nursery)
        add_worker(mesh, "b", tmp_path / "b-cache", nursery)
        pipeline = await serve(mesh, ref, package, 3, nursery)
        assert len(pipeline.stage_nodes) == 3
        solo = [await _stream(pipeline, f"solo{i}", p) for i, p in enumerate(PROMPTS)]
        assert mesh.sent[(HOST, "ActivationBatch")] == 0  # alone, a step is one frame
        outputs: list[list[int]] = [[] for _ in PROMPTS]

        async def one(i: int) -> None:
            outputs[i] = await _stream(pipeline, f"r{i}", PROMPTS[i])

        async with trio.open_nursery() as streams:
            for i in range(len(PROMPTS)):
                streams.start_soon(one, i)
        assert outputs == solo
        # Steps crossed every stage as one message each way...
        assert mesh.sent[(HOST, "ActivationBatch")] > 0
        assert mesh.sent[("a", "ActivationBatch")] == mesh.sent[(HOST, "ActivationBatch")]
        assert mesh.sent[("b", "PredictionBatch")] > 0
        # ...in micro-batches of about a third of the sequences, several in flight at once.
        assert max(mesh.batch_sizes) == len(PROMPTS) // 3
        assert mesh.peak_in_flight >= 2
        assert pipeline.runner.live_sequences == 0
        # Every stage frees every sequence (once the workers' inboxes took the Releases).
        await trio.testing.wait_all_tasks_blocked()
        assert not any(_live(worker) for worker in mesh.workers.values())
        nursery.cancel_scope.cancel()


async def test_a_bad_frame_fails_alone_in_its_batch(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """A frame that the middle stage cannot take (its sequence was released there) fails
    its own request with an error; the other frame of the same ActivationBatch goes on."""
    ref, package = hub_ref
    mesh = WireMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "a", tmp_path / "a-cache", nursery)
        add_worker(mesh, "b", tmp_path / "b-cache", nursery)
        pipeline = await serve(mesh, ref, package, 3, nursery)
        reference = await _stream(pipeline, "alone", PROMPTS[0])
        pipeline.batcher.limits = BatchLimits(micro_batches=1)  # both frames in one step
        first: dict[str, int] = {}

        async def prefill(request: str) -> None:
            frame = StepFrame(RequestId(request), FrameKind.PREFILL, 0, PROMPTS[0], GREEDY)
            first[request] = (await pipeline.run(frame)).tokens[0]

        async with trio.open_nursery() as streams:
            streams.start_soon(prefill, "bad")
            streams.start_soon(prefill, "fine")
        # Stage "a" forgets "bad" (stage 0 and "b" still hold it).
        wire_id = pipeline._wire_ids[RequestId("bad")]
        forget = Release(request_id=wire_id, run_id=pipeline.run_id, term=pipeline.term)
        await mesh.deliver(HOST, "a", forget)
        steps_before = len(mesh.batch_sizes)
        errors: list[str] = []
        tokens: list[int] = []
        position = len(PROMPTS[0])

        async def bad() -> None:
            frame = StepFrame(RequestId("bad"), FrameKind.DECODE, position, (first["bad"],), GREEDY)
            try:
                await pipeline.run(frame)
            except PipelineError as exc:
                errors.append(str(exc))

        async def fine() -> None:
            tokens.append(first["fine"])
            while len(tokens) < TOKENS:
                at = len(PROMPTS[0]) + len(tokens) - 1
                frame = StepFrame(RequestId("fine"), FrameKind.DECODE, at, (tokens[-1],), GREEDY)
                tokens.extend((await pipeline.run(frame)).tokens)

        async with trio.open_nursery() as streams:
            streams.start_soon(bad)
            streams.start_soon(fine)
        assert mesh.batch_sizes[steps_before] == 2  # the two decode frames went together
        assert len(errors) == 1
        assert "unknown on this stage" in errors[0]
        assert tokens == reference
        nursery.cancel_scope.cancel()
