"""Messages are checked against their sender (issue 15 item 4): a member that is not the
run's coordinator (or the stage's upstream) can neither steer a run nor learn about it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing
from meshnode_protocol import (
    ActivationFrame,
    Claim,
    ClaimAccepted,
    ClaimRejected,
    Error,
    ErrorCode,
    Inventory,
    Message,
    PeerInfo,
    Prediction,
    Prepare,
    Release,
    Stop,
)

from meshnode.engine.backend import cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.recurrent import RollbackError
from meshnode.engine.sampling import SamplingParams
from meshnode.node.pipeline import FrameKind, PipelineError, RequestId, StepFrame, StepResult
from meshnode.node.remote import RemotePipeline
from meshnode.node.stage import StageRunner
from meshnode.node.worker import Worker, may_send
from meshnode.node.worker_run import WorkerRun
from tests.speculative.tinymodel import TinySource, tiny_config

HOST, MALLORY, UPSTREAM = "host", "mallory", "stage-1"
RUN, TERM = "run-secret", 7


class Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    async def send(self, peer: str, message: Message) -> None:
        self.sent.append((peer, message))

    def last(self, peer: str) -> Message:
        return next(m for p, m in reversed(self.sent) if p == peer)


@pytest.fixture
async def claimed(tmp_path: Path) -> AsyncIterator[tuple[Worker, Outbox]]:
    """A worker claimed by HOST for RUN@TERM."""
    outbox = Outbox()

    async def connect(info: PeerInfo) -> None:
        raise AssertionError("nothing here dials")

    async with trio.open_nursery() as nursery:
        worker = Worker(
            "w", outbox.send, connect=connect, backend=cpu_backend(), cache_dir=tmp_path,
            nursery=nursery,
        )  # fmt: skip
        await worker.handle(HOST, Claim(run_id=RUN, term=TERM, coordinator_id=HOST))
        assert isinstance(outbox.last(HOST), ClaimAccepted)
        yield worker, outbox
        nursery.cancel_scope.cancel()


CONTROL: list[Message] = [
    Stop(run_id=RUN, term=TERM, reason="mallory says so"),
    Prepare(
        run_id=RUN, term=TERM, package_ref="hf://evil/model", manifest_sha256="00" * 32,
        layer_range=(0, 1), has_embed=True, has_head=True,
    ),
    Inventory(run_id=RUN, term=TERM, package_ref="hf://evil/model"),
    Release(request_id="0", run_id=RUN, term=TERM),
    ActivationFrame(
        request_id="0", run_id=RUN, term=TERM, kind="prefill", start_pos=0, tokens=(1,)
    ),
]  # fmt: skip


@pytest.mark.parametrize("message", CONTROL, ids=lambda m: type(m).__name__)
async def test_another_member_cannot_steer_a_claimed_run(
    claimed: tuple[Worker, Outbox], message: Message
) -> None:
    worker, outbox = claimed
    assert await worker.handle(MALLORY, message)
    reply = outbox.last(MALLORY)
    assert isinstance(reply, Error)
    assert reply.code == ErrorCode.UNKNOWN_RUN
    assert worker.run is not None
    assert worker.run.state == "claimed"
    assert worker.run.preparation is None


async def test_refusals_to_other_nodes_disclose_nothing_about_the_run(
    claimed: tuple[Worker, Outbox],
) -> None:
    worker, outbox = claimed
    await worker.handle(MALLORY, Stop(run_id="run-guess", term=1))
    await worker.handle(MALLORY, Claim(run_id="run-mine", term=1, coordinator_id=MALLORY))
    replies = [m for p, m in outbox.sent if p == MALLORY]
    assert isinstance(replies[0], Error)
    assert isinstance(replies[1], ClaimRejected)
    assert replies[1].held_by_run == ""
    assert replies[1].held_by_term == 0
    for reply in replies:
        assert RUN not in repr(reply)
        assert HOST not in repr(reply)
    # The run's own coordinator, with a stale term, is told which run holds the node.
    await worker.handle(HOST, Stop(run_id=RUN, term=TERM - 1))
    stale = outbox.last(HOST)
    assert isinstance(stale, Error)
    assert stale.code == ErrorCode.STALE_TERM
    assert f"{RUN}@{TERM}" in stale.message


def test_activations_come_only_from_the_upstream_stage() -> None:
    run = WorkerRun(RUN, TERM, HOST)
    frame = CONTROL[-1]
    assert may_send(run, HOST, frame)
    assert not may_send(run, MALLORY, frame)
    run.upstream = UPSTREAM
    assert may_send(run, UPSTREAM, frame)
    assert not may_send(run, HOST, frame)
    assert not may_send(run, MALLORY, frame)
    assert may_send(run, HOST, CONTROL[0])
    assert not may_send(run, UPSTREAM, CONTROL[0])


async def test_the_host_takes_predictions_only_from_the_last_stage() -> None:
    """Wire ids are guessable (r0, r1, …): what makes a Prediction genuine is its sender."""
    source = TinySource(tiny_config(48, 4), seed=0, logit_scale=8.0)
    config = ModelConfig.from_hf(source.config)
    stage0 = Stage(config, source, 0, 2, embed=True, head=False)
    sent: list[tuple[str, Message]] = []
    forwarded = trio.Event()

    async def send(peer: str, message: Message) -> None:
        sent.append((peer, message))
        forwarded.set()

    pipeline = RemotePipeline(
        StageRunner(stage0, context_size=32, max_sequences=1),
        run_id=RUN, term=TERM, stage_nodes=(HOST, "s1", "s2"), send=send, wire_dtype="f32",
    )  # fmt: skip
    frame = StepFrame(
        request_id=RequestId("req"), kind=FrameKind.PREFILL, start_pos=0, tokens=(1, 2),
        sampling=SamplingParams(temperature=0.0),
    )  # fmt: skip
    results: list[StepResult] = []

    async def step() -> None:
        results.append(await pipeline.run(frame))

    def reply(tokens: tuple[int, ...]) -> Prediction:
        wire = sent[-1][1]
        assert isinstance(wire, ActivationFrame)
        return Prediction(
            request_id=wire.request_id, run_id=RUN, term=TERM, start_pos=2, accepted=0,
            tokens=tokens,
        )  # fmt: skip

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(step)
            await forwarded.wait()
            pipeline.deliver(MALLORY, reply((666,)))  # a member guessing the wire id
            pipeline.deliver("s1", reply((667,)))  # a middle stage cannot answer either
            pipeline.deliver("s1", Error(code=1, message="x", run_id="other", request_id="r0"))
            await trio.testing.wait_all_tasks_blocked()
            assert not results  # still waiting for the genuine reply
            pipeline.deliver("s2", reply((42,)))
    assert [r.tokens for r in results] == [(42,)]


async def test_a_rollback_refusal_from_a_stage_raises_rollback_error() -> None:
    """``ROLLBACK_TOO_DEEP`` from a stage of the run reaches the generation loop as
    ``RollbackError`` (which prefills the history again), not as a failed pipeline."""
    source = TinySource(tiny_config(48, 4), seed=0, logit_scale=8.0)
    stage0 = Stage(ModelConfig.from_hf(source.config), source, 0, 2, embed=True, head=False)
    outbox = Outbox()
    forwarded = trio.Event()

    async def send(peer: str, message: Message) -> None:
        await outbox.send(peer, message)
        forwarded.set()

    pipeline = RemotePipeline(
        StageRunner(stage0, context_size=32, max_sequences=1),
        run_id=RUN, term=TERM, stage_nodes=(HOST, "s1"), send=send, wire_dtype="f32",
    )  # fmt: skip
    frame = StepFrame(
        request_id=RequestId("req"), kind=FrameKind.PREFILL, start_pos=0, tokens=(1, 2),
        sampling=SamplingParams(temperature=0.0),
    )  # fmt: skip
    failures: list[BaseException] = []

    async def step() -> None:
        try:
            await pipeline.run(frame)
        except (RollbackError, PipelineError) as exc:
            failures.append(exc)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(step)
            await forwarded.wait()
            wire = outbox.last("s1")
            assert isinstance(wire, ActivationFrame)
            refusal = Error(
                code=ErrorCode.ROLLBACK_TOO_DEEP, message="behind the ring", run_id=RUN,
                term=TERM, request_id=wire.request_id,
            )  # fmt: skip
            pipeline.deliver("s1", refusal)
    assert len(failures) == 1
    assert type(failures[0]) is RollbackError
