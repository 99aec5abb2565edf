"""The remote pipeline's link to its stage 1 (:mod:`meshnode.node.remote`): what stage 0
sends downstream and how it keeps track of it.

Each sequence crosses the wire under a short id of the run (``r0``, ``r1``, …; the
remote module's docstring says why); each frame sent waits for the last stage's answer in
a :class:`Waiter` with a deadline (:class:`PassDeadline`) that counts every token still in
flight ahead of it; a step that cannot even be sent before its deadline fails the
pipeline, and so does a send to a stage 1 that is gone. :class:`StageLink` holds that
state and the sending; :class:`~meshnode.node.remote.RemotePipeline` builds on it with
stage 0's compute, the answers and the pipeline's failure.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from meshnode_protocol import ActivationBatch, ActivationFrame, Message

from meshnode.errors import MeshnodeError
from meshnode.net.stream import SEND_ERRORS
from meshnode.node.pipeline import (
    PipelineError,
    RequestId,
    Slot,
    StageLostError,
    StepFrame,
    StepResult,
    onward,
)
from meshnode.node.wire import WireSequences, frame_to_wire

SendFn = Callable[[str, Message], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class PassDeadline:
    """How long a step sent downstream may take to come back before it counts as a stage
    failure: ``base_s + per_token_s * tokens_in_flight`` seconds.

    The base covers a pass of a few tokens on a cold stage (its first pass compiles the
    native kernels: seconds, up to a minute on a slow CPU) with a wide margin; 0.25 s per
    token is 4 tokens/s, slower than a CPU stage that serves at all reads a prompt. A
    deadline is a backstop for a stage that hangs, not a latency target.
    """

    base_s: float = 60.0
    per_token_s: float = 0.25

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.per_token_s >= 0):
            raise ValueError(f"invalid pass deadline: {self}")

    def seconds(self, tokens_in_flight: int) -> float:
        """The deadline of a step sent while ``tokens_in_flight`` tokens are unanswered."""
        return self.base_s + self.per_token_s * tokens_in_flight


@dataclass(eq=False, slots=True)
class Waiter:
    """A frame of stage 0's step, waiting for the last stage's answer."""

    done: trio.Event = field(default_factory=trio.Event)
    result: StepResult | None = None
    # Why the frame failed (a PipelineError, or the engine's RollbackError), raised by the waiter.
    error: MeshnodeError | None = None
    wire_id: RequestId | None = None  # set while it waits for the last stage
    local_s: float | None = None  # stage 0's compute, when the other stages follow
    rows: int = 0  # the rows of the step this frame went in (every stage computes them all)
    # When the pass counts as lost (trio clock), and the deadline's length for the message.
    deadline_at: float = math.inf
    deadline_s: float = math.inf

    def finish(self, result: StepResult) -> None:
        self.result = result
        self.done.set()


class StageLink:
    """The sending side of a remote pipeline (module docstring): short wire ids, the frames
    waiting for an answer, the tokens in flight and their deadlines. ``fail`` and
    ``_lost`` are the pipeline's."""

    def __init__(
        self,
        *,
        run_id: str,
        term: int,
        stage_nodes: Sequence[str],
        send: SendFn,
        wire_dtype: str,
        max_sequences: int,
        deadline: PassDeadline | None = None,
    ) -> None:
        self.run_id = run_id
        self.term = term
        self.stage_nodes = tuple(stage_nodes)
        self.wire_dtype = wire_dtype
        self._send = send
        self._waiters: dict[RequestId, Waiter] = {}  # by wire id
        self._wire_ids: dict[RequestId, RequestId] = {}  # request id -> wire id
        self._next_wire_id = itertools.count()
        # Per-sequence outgoing activation buffers, reused by every decode step.
        self._wire = WireSequences(max_sequences)
        self.deadline = deadline or PassDeadline()
        # Tokens sent and not yet answered, by wire id (a sequence's prefill chunks add up
        # until its final chunk's prediction): what a new step waits behind.
        self._unanswered: dict[RequestId, int] = {}
        # The last reply's trio time, or the first send's since none was unanswered.
        self._progress_s = 0.0
        self._sending: trio.CancelScope | None = None  # the step being sent, if any
        # Set once, by the first failure: every later run fails with it (remote's docstring).
        self.failure: StageLostError | None = None

    def fail(self, reason: str, *, node: str | None = None, left: bool = False) -> None:
        raise NotImplementedError  # the pipeline's (RemotePipeline.fail)

    def _lost(self) -> StageLostError:
        raise NotImplementedError  # the pipeline's (RemotePipeline._lost)

    @property
    def stalled_since(self) -> float | None:
        """Since when passes sent downstream have gone unanswered (trio time: the last
        reply, or the first send after none was in flight); None while none is in flight."""
        return self._progress_s if self._unanswered else None

    def _set_deadline(self, slots: list[Slot[Waiter]]) -> float:
        """Give the step's waiters their deadline, from now and behind every token in
        flight; when it falls (trio clock)."""
        seconds = self.deadline.seconds(sum(self._unanswered.values()))
        at = trio.current_time() + seconds
        for slot in slots:
            if slot.output is not None and slot.output.wire_id is not None:
                slot.output.deadline_at, slot.output.deadline_s = at, seconds
        return at

    def _outgoing(
        self, frame: StepFrame, hidden: Any, local_s: float
    ) -> tuple[Waiter, ActivationFrame | None]:
        """The waiter of ``frame``, which stage 0 computed into ``hidden``, and the message
        for stage 1: None when stage 1 resumes the sequence past the frame (a non-final
        prompt piece only stage 0 needs, :func:`~meshnode.node.pipeline.onward`)."""
        wire_id = self._wire_id(frame.request_id)
        if (next_step := onward(frame, hidden)) is None:
            waiter = Waiter()
            waiter.finish(StepResult(request_id=frame.request_id))
            return waiter, None
        sent, hidden = next_step
        message = frame_to_wire(
            dataclasses.replace(sent, request_id=wire_id),
            hidden,
            run_id=self.run_id,
            term=self.term,
            wire_dtype=self.wire_dtype,
            sequences=self._wire,
        )
        waiter = Waiter(local_s=local_s)
        if not self._unanswered:
            self._progress_s = trio.current_time()
        self._unanswered[wire_id] = self._unanswered.get(wire_id, 0) + len(sent.tokens)
        if frame.final:
            waiter.wire_id = wire_id
            self._waiters[wire_id] = waiter
        else:
            # A non-final prefill chunk is not waited for: the session's FIFO order and each
            # stage's in-order processing keep it ahead of the final chunk.
            waiter.local_s = None
            waiter.finish(StepResult(request_id=frame.request_id))
        return waiter, message

    async def _forward_step(
        self, slots: list[Slot[Waiter]], messages: list[ActivationFrame], deadline_at: float
    ) -> None:
        """Send a step downstream: one frame as itself, several as one ``ActivationBatch``."""
        outgoing: Message = messages[0]
        if len(messages) > 1:
            outgoing = ActivationBatch(run_id=self.run_id, term=self.term, frames=tuple(messages))
        # A stage that takes nothing more (its inbox full, the next one hung) must not hold
        # this step, and every request behind it, past the deadline; nor past a failure.
        with trio.move_on_at(deadline_at) as sending:
            self._sending = sending
            try:
                await self._forward(outgoing)
            except PipelineError as exc:
                for slot in slots:
                    if slot.output is not None and not slot.output.done.is_set():
                        slot.output.error = exc
                        slot.output.done.set()
        self._sending = None
        if sending.cancelled_caught and self.failure is None:
            self.fail("a pass could not be sent to stage 1 before its deadline")

    def _wire_id(self, request_id: RequestId) -> RequestId:
        wire_id = self._wire_ids.get(request_id)
        if wire_id is None:
            wire_id = self._wire_ids[request_id] = RequestId(f"r{next(self._next_wire_id)}")
        return wire_id

    async def _forward(self, message: Message) -> None:
        node = self.stage_nodes[1]
        try:
            await self._send(node, message)
        except SEND_ERRORS as exc:
            reason = f"stage node {node} is unreachable"
            self.fail(reason, node=node)
            raise self._lost() from exc
