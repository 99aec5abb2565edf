"""The data plane of a worker: the frames of a loaded run through this node's stage.

A loaded run owns one *inbox* task (:meth:`Relay.serve_inbox`) that takes its data messages
in arrival order: an ``ActivationFrame`` runs through the stage in a worker thread and goes
on to the downstream stage, or, from the last stage, as a ``Prediction`` straight back to the
host (DESIGN §2); an ``ActivationBatch`` (one step of several requests) runs as one
multi-row forward and goes on as one ``ActivationBatch`` or ``PredictionBatch``; a
``Release`` frees its sequence. A frame that fails becomes an ``Error`` naming its request,
sent to the run's coordinator; the other frames of its step go on. The control plane
(claim, prepare, load, stop) is :mod:`meshnode.node.worker`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from meshnode_protocol import (
    ActivationBatch,
    ActivationFrame,
    Error,
    ErrorCode,
    Message,
    Prediction,
    PredictionBatch,
)

from meshnode.engine.prefix_cache import PrefixMissError
from meshnode.engine.recurrent import RollbackError
from meshnode.net.stream import SEND_ERRORS
from meshnode.node.pipeline import RequestId, Slot, StepResult, onward
from meshnode.node.stage import step_activations, step_results
from meshnode.node.wire import frame_from_wire, frame_to_wire, result_to_wire
from meshnode.node.worker_run import DataMessage, WorkerRun

log = logging.getLogger("meshnode.worker")

SendFn = Callable[[str, Message], Awaitable[None]]


class Relay:
    """Runs the data messages of this node's runs (see the module docstring)."""

    def __init__(self, node_id: str, send: SendFn) -> None:
        self.node_id = node_id
        self._send = send

    async def _to_coordinator(self, run: WorkerRun, error: Error) -> None:
        # Best effort: without a session to the coordinator the run is over anyway.
        with contextlib.suppress(*SEND_ERRORS):
            await self._send(run.coordinator, error)

    async def serve_inbox(
        self, run: WorkerRun, receive: trio.MemoryReceiveChannel[DataMessage]
    ) -> None:
        """Run the data messages of ``run`` one after another until the run is stopped."""
        try:
            await self._serve_all(run, receive)
        finally:
            run.idle.set()  # a forward it awaited has returned: trio waits for its thread

    async def _serve_all(
        self, run: WorkerRun, receive: trio.MemoryReceiveChannel[DataMessage]
    ) -> None:
        with run.scope, receive:
            async for message in receive:
                try:
                    await self._serve_one(run, message)
                except Exception as exc:
                    # Our own bug on one message: it fails its frames, not the node (the
                    # session loop used to contain it the same way). Not cancellation.
                    # The coordinator hears of each frame: its request must not wait for
                    # a prediction that will never come.
                    log.exception("run %s: a data message failed", run.run_id)
                    frames = message.frames if isinstance(message, ActivationBatch) else ()
                    for frame in frames or (message,):
                        if isinstance(frame, ActivationFrame):
                            reason = f"internal error on {self.node_id}: {type(exc).__name__}"
                            error = run.error(ErrorCode.INTERNAL, reason, frame.request_id)
                            await self._to_coordinator(run, error)

    async def _serve_one(self, run: WorkerRun, message: DataMessage) -> None:
        if isinstance(message, ActivationFrame):
            await self._step(run, (message,), batched=False)
        elif isinstance(message, ActivationBatch):
            await self._step(run, message.frames, batched=True)
        elif run.runner is not None:
            run.runner.release(RequestId(message.request_id))
            run.wire.release(RequestId(message.request_id))

    async def _step(
        self, run: WorkerRun, messages: tuple[ActivationFrame, ...], *, batched: bool
    ) -> None:
        """Run a step's frames as one forward and send on what comes out: as one message
        again (a batch stays a batch), each frame's failure to the coordinator."""
        runner = run.runner
        assert runner is not None  # the inbox task starts only once the runner is loaded
        slots: list[tuple[ActivationFrame, Slot[Any]]] = []  # outputs: StepResult or hidden
        for message in messages:
            try:
                # One inbox task per run: the sequence's input buffer, reused frame after
                # frame, is never written while a forward reads it.
                # Its shape is checked before its activations are copied (issue 36, item 6).
                width = runner.stage.config.hidden_size
                frame = frame_from_wire(message, run.wire, hidden_size=width)
                slots.append((message, Slot(frame)))
            except ValueError as exc:
                await self._fail(run, message, exc)
        began = time.perf_counter()
        step = [slot for _, slot in slots]
        run.busy_since = trio.current_time()
        try:
            if runner.last:
                await trio.to_thread.run_sync(step_results, runner, step)
            else:
                await trio.to_thread.run_sync(step_activations, runner, step)
        finally:
            run.busy_since = None
        compute_us = int((time.perf_counter() - began) * 1e6)
        outgoing: list[Any] = []
        for message, slot in slots:
            if slot.error is not None:
                await self._fail(run, message, slot.error)
            elif runner.last:
                if slot.output and slot.output.tokens:  # none after a non-final prefill chunk
                    outgoing.append(_prediction(run, slot, message))
            elif run.downstream is not None and (
                # None: the next stage resumes the sequence past this frame (issue 30)
                sent := _onward(run, slot, message, compute_us)
            ):
                outgoing.append(sent)
        if outgoing:
            await self._send_on(run, outgoing, batched, messages)

    async def _send_on(
        self,
        run: WorkerRun,
        outgoing: list[Any],
        batched: bool,
        messages: tuple[ActivationFrame, ...],
    ) -> None:
        target = run.coordinator if run.downstream is None else run.downstream
        message: Message = outgoing[0]
        if batched and isinstance(outgoing[0], Prediction):
            message = PredictionBatch(run_id=run.run_id, term=run.term, predictions=tuple(outgoing))
        elif batched:
            message = ActivationBatch(run_id=run.run_id, term=run.term, frames=tuple(outgoing))
        try:
            await self._send(target, message)
        except SEND_ERRORS:
            # The next node is gone: the host learns it from membership and replans; tell it
            # now so the requests fail at once (best effort: the host may be gone too).
            reason = f"stage after {self.node_id} ({target}) is unreachable"
            for frame in messages:
                failed = run.error(ErrorCode.NOT_READY, reason, frame.request_id)
                await self._to_coordinator(run, failed)

    async def _fail(self, run: WorkerRun, message: ActivationFrame, exc: Exception) -> None:
        rollback = isinstance(exc, RollbackError)
        code = ErrorCode.ROLLBACK_TOO_DEEP if rollback else ErrorCode.BAD_ACTIVATION
        if isinstance(exc, PrefixMissError):  # hook (issue 30): the host prefills from 0
            code = ErrorCode.PREFIX_MISS
        await self._to_coordinator(run, run.error(code, str(exc), message.request_id))


def _prediction(run: WorkerRun, slot: Slot[StepResult], message: ActivationFrame) -> Prediction:
    assert slot.output is not None
    return result_to_wire(
        slot.output,
        run_id=run.run_id,
        term=run.term,
        start_pos=slot.frame.start_pos,
        stage_compute_us=message.stage_compute_us,
    )


def _onward(
    run: WorkerRun, slot: Slot[Any], message: ActivationFrame, compute_us: int
) -> ActivationFrame | None:
    """The frame for the next stage: the rows from where it starts the sequence on
    (:func:`~meshnode.node.pipeline.onward`); None when it needs none of them."""
    if (next_step := onward(slot.frame, slot.output)) is None:
        return None
    frame, hidden = next_step
    return frame_to_wire(
        frame,
        hidden,
        run_id=run.run_id,
        term=run.term,
        wire_dtype=run.wire_dtype,
        sequences=run.wire,
        stage_compute_us=(*message.stage_compute_us, compute_us),
    )
