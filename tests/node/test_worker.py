"""The worker's data plane: compute off the session loop, errors routed to the coordinator.

Real workers and coordinator in this process over the in-memory mesh of
:mod:`tests.node.inmemory`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from meshnode_protocol import ActivationFrame, Message

from meshnode.node.pipeline import PipelineError, StepFrame
from tests.node.inmemory import (
    BRING_UP_TIMEOUT_S,
    HOST,
    InMemoryMesh,
    add_worker,
    decode,
    greedy_reference,
    serve,
)

# Long enough for any pass of the tiny model; a gate that never opens fails the test here.
GATE_TIMEOUT_S = 30.0
# A frame handed to a worker must come back to the session loop at once, not after compute.
HANDLE_TIMEOUT_S = 5.0


class Gate:
    """Holds a stage's forward (in its worker thread) until opened."""

    def __init__(self, process: Callable[[Sequence[StepFrame]], Any]) -> None:
        self._process = process
        self.entered = threading.Event()
        self.opened = threading.Event()

    def process(self, frames: Sequence[StepFrame]) -> Any:
        self.entered.set()
        self.opened.wait(GATE_TIMEOUT_S)
        return self._process(frames)


async def test_a_long_pass_leaves_the_session_loop_free(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """While a worker's forward runs, handing it a message returns at once: the daemon's
    receive loop (which awaits ``Worker.handle``) goes on reading heartbeats and Hellos."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    handled = trio.Event()
    deliver = mesh.deliver

    async def deliver_and_note(sender: str, receiver: str, message: Message) -> None:
        await deliver(sender, receiver, message)
        if receiver == "w" and isinstance(message, ActivationFrame):
            handled.set()

    mesh.deliver = deliver_and_note  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        pipeline = await serve(mesh, ref, package, 2, nursery)
        run = mesh.workers["w"].run
        assert run is not None
        assert run.runner is not None
        assert run.runner.last  # two stages: the worker's pass is the last one
        held = Gate(run.runner.results_batch)
        run.runner.results_batch = held.process  # type: ignore[method-assign]
        decoded: list[int] = []
        done = trio.Event()

        async def decode_into() -> None:
            decoded.extend(await decode(pipeline))
            done.set()

        nursery.start_soon(decode_into)
        assert await trio.to_thread.run_sync(held.entered.wait, GATE_TIMEOUT_S)
        with trio.fail_after(HANDLE_TIMEOUT_S):
            await handled.wait()  # the worker took the frame while its forward is held
        assert not done.is_set()
        held.opened.set()
        with trio.fail_after(BRING_UP_TIMEOUT_S):
            await done.wait()
        nursery.cancel_scope.cancel()
    assert decoded == greedy_reference(package)


async def test_a_fenced_reply_of_a_middle_stage_reaches_the_coordinator(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """The last stage restarted with the same identity (it holds no run): its ``Error``
    goes back to the middle stage, which passes it on to the host; the request fails at
    once instead of waiting forever for a ``Prediction``."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "a", tmp_path / "cache-a", nursery)
        add_worker(mesh, "b", tmp_path / "cache-b", nursery)
        pipeline = await serve(mesh, ref, package, 3, nursery)
        assert pipeline.stage_nodes == (HOST, "a", "b")
        add_worker(mesh, "b", tmp_path / "cache-b", nursery)  # "b" again, without its run
        refused = pytest.raises(PipelineError, match="no run of yours")
        with trio.fail_after(BRING_UP_TIMEOUT_S), refused:
            await decode(pipeline)
        nursery.cancel_scope.cancel()
