"""The data plane of a worker: the frames of a loaded run through this node's stage.

A loaded run owns one *inbox* task (:meth:`Relay.serve_inbox`) that takes its data messages
in arrival order: an ``ActivationFrame`` runs through the stage in a worker thread and goes
on to the downstream stage, or, from the last stage, as a ``Prediction`` straight back to the
host (DESIGN §2); a ``Release`` frees its sequence. A frame that fails becomes an ``Error``
naming its request, sent to the run's coordinator. The control plane (claim, prepare,
load, stop) is :mod:`meshnode.node.worker`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio
from meshnode_protocol import ActivationFrame, Error, ErrorCode, Message, Release

from meshnode.engine.recurrent import RollbackError
from meshnode.net.stream import SEND_ERRORS
from meshnode.node.pipeline import PipelineError, RequestId, StepResult
from meshnode.node.wire import frame_from_wire, frame_to_wire, result_to_wire

if TYPE_CHECKING:
    from meshnode.node.worker import WorkerRun

log = logging.getLogger("meshnode.worker")

SendFn = Callable[[str, Message], Awaitable[None]]
DataMessage = ActivationFrame | Release


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
        with run.scope, receive:
            async for message in receive:
                try:
                    await self._serve_one(run, message)
                except Exception:
                    # Our own bug on one frame: it fails that frame, not the node (the
                    # session loop used to contain it the same way). Not cancellation.
                    log.exception("run %s: a data message failed", run.run_id)

    async def _serve_one(self, run: WorkerRun, message: DataMessage) -> None:
        if isinstance(message, ActivationFrame):
            await self._activation(run, message)
        elif run.runner is not None:
            run.runner.release(RequestId(message.request_id))
            run.wire.release(RequestId(message.request_id))

    async def _activation(self, run: WorkerRun, message: ActivationFrame) -> None:
        runner = run.runner
        assert runner is not None  # the inbox task starts only once the runner is loaded
        result: StepResult | None = None
        try:
            # One inbox task per run: the sequence's input buffer, reused frame after
            # frame, is never written while a forward reads it.
            frame = frame_from_wire(message, run.wire)
            began = time.perf_counter()
            if runner.last:
                result = await trio.to_thread.run_sync(runner.result, frame)
            else:
                hidden = await trio.to_thread.run_sync(runner.activations, frame)
            compute_us = int((time.perf_counter() - began) * 1e6)
        except (PipelineError, ValueError) as exc:
            code = (
                ErrorCode.ROLLBACK_TOO_DEEP
                if isinstance(exc, RollbackError)
                else ErrorCode.BAD_ACTIVATION
            )
            failed = frame_error(run, code, str(exc), message)
            await self._to_coordinator(run, failed)
            return
        if result is not None:
            if not result.tokens:
                return  # a non-final prefill chunk: the host does not wait for it
            target = run.coordinator
            outgoing: Message = result_to_wire(
                result,
                run_id=run.run_id,
                term=run.term,
                start_pos=frame.start_pos,
                stage_compute_us=message.stage_compute_us,
            )
        elif run.downstream is not None:
            target = run.downstream
            outgoing = frame_to_wire(
                frame,
                hidden,
                run_id=run.run_id,
                term=run.term,
                wire_dtype=run.wire_dtype,
                sequences=run.wire,
                stage_compute_us=(*message.stage_compute_us, compute_us),
            )
        else:
            return
        try:
            await self._send(target, outgoing)
        except SEND_ERRORS:
            # The next node is gone: the host learns it from membership and replans; tell it
            # now so the request fails at once (best effort: the host may be gone too).
            reason = f"stage after {self.node_id} ({target}) is unreachable"
            await self._to_coordinator(run, frame_error(run, ErrorCode.NOT_READY, reason, message))


def frame_error(run: WorkerRun, code: ErrorCode, reason: str, frame: ActivationFrame) -> Error:
    """The ``Error`` that fails ``frame``'s request at the coordinator."""
    return Error(
        code=code, message=reason, run_id=run.run_id, term=run.term, request_id=frame.request_id
    )
