"""The remote pipeline: stage 0 in this process, the other stages across the mesh.

``run(frame)`` computes stage 0 locally, sends the hidden states downstream as an
``ActivationFrame`` and waits for the last stage's ``Prediction``, which comes straight back
to this node (DESIGN §2). A sequence has at most one frame in flight, so waiters are keyed
by request id. Non-final prefill chunks are sent without waiting: the session's FIFO order
and each stage's in-order processing keep them ahead of the final chunk, and an error in one
is reported with the request id and fails the waiter of the final chunk.

On the wire a sequence is named by a short id of this run (``r0``, ``r1``, …) rather than
the API's request id: every decode frame and every Prediction carries it, and ~30 bytes of
id would be a fifth of a decode frame's overhead (issue 5 budgets 128 bytes). The sending
side (wire ids, the frames waiting for an answer, tokens in flight and their deadlines) is
:class:`~meshnode.node.stage_link.StageLink`, which :class:`RemotePipeline` builds on.

When a stage is lost the pipeline is dead: every waiter wakes with a
:class:`~meshnode.node.pipeline.StageLostError`, every later ``run`` raises it at once, and
:attr:`RemotePipeline.failed` tells the coordinator, which replans while the generation
loops wait to replay their requests on the next pipeline. A stage is lost when

- its session ends or its heartbeats stop (the coordinator calls :meth:`RemotePipeline.fail`
  naming the node);
- a stage refuses a frame because it no longer holds the run (``UNKNOWN_RUN``,
  ``STALE_TERM``, ``NOT_READY``: a restarted node, a lost claim, an unreachable next stage);
- a pass misses its **deadline** (:class:`PassDeadline`): a step sent downstream whose
  predictions have not come back within ``base_s + per_token_s x tokens in flight``. The
  tokens in flight are those sent and not yet answered, this step's included, because
  every stage works through them in order. A stage that hangs while its heartbeats still
  flow can therefore hold no request forever;
- stage 0's own compute, here, misses the deadline of the step's tokens: the failure names
  this node, whose hung thread and runner are abandoned (:meth:`RemotePipeline._step`).

Where the pipeline cannot name the node (a downstream deadline, a refusal relayed by a
middle stage), the coordinator finds it out (:mod:`meshnode.node.coordinator`, "Blame").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import trio
from meshnode_protocol import (
    Error,
    ErrorCode,
    Message,
    Prediction,
    PredictionBatch,
    Release,
)

from meshnode.engine.prefix_cache import PrefixMissError
from meshnode.engine.recurrent import RollbackError
from meshnode.errors import MeshnodeError
from meshnode.net.stream import SEND_ERRORS
from meshnode.node.batcher import Batcher, BatchLimits
from meshnode.node.pipeline import (
    PipelineError,
    QueuedPass,
    RequestId,
    Slot,
    StageLostError,
    StepFrame,
    StepResult,
)
from meshnode.node.prefix import StagePrefix, host_pools, note_pass, note_release
from meshnode.node.speeds import PassMeter, SpeedBook
from meshnode.node.stage import StageRunner, step_activations, step_results
from meshnode.node.stage_link import PassDeadline as PassDeadline  # callers import it here
from meshnode.node.stage_link import SendFn, StageLink, Waiter
from meshnode.node.wire import result_from_wire

log = logging.getLogger(__name__)


DataReply = Prediction | PredictionBatch | Error

#: What a stage answers when it no longer holds the run a frame names (or cannot pass it
#: on): not this request's fault, but the pipeline's end.
RUN_LOST_CODES = frozenset({ErrorCode.UNKNOWN_RUN, ErrorCode.STALE_TERM, ErrorCode.NOT_READY})
#: Refusals the generation loop recovers from: a hybrid stage's rollback past its snapshot
#: ring (it refolds the history), a prefix a stage no longer holds (it prefills from 0).
RETRY_CODES: dict[int, type[RollbackError | PrefixMissError]] = {
    ErrorCode.ROLLBACK_TOO_DEEP: RollbackError,
    ErrorCode.PREFIX_MISS: PrefixMissError,  # hook (issue 30)
}


#: How often :func:`idle_by` looks again at requests in flight that hold no sequence yet.
IN_FLIGHT_POLL_S = 0.1


async def idle_by(
    pipeline: RemotePipeline,
    seconds: float,
    interrupt: Callable[[], Awaitable[object]],
    in_flight: Callable[[], int] = lambda: 0,
) -> bool | None:
    """True once no request holds a sequence of ``pipeline`` and none is ``in_flight``
    (checked last: no checkpoint follows it), False after ``seconds``, None as soon as
    ``interrupt()`` returns.

    ``in_flight()`` counts the frontend's requests, sequence or not: a request waiting to
    replay on this pipeline after a loss, or still being tokenized, holds no sequence yet,
    and re-placing then would refuse new requests and replay it a second time. Such
    requests release nothing here, so they are looked at every ``IN_FLIGHT_POLL_S``."""
    deadline = trio.current_time() + seconds

    def busy() -> bool:
        return bool(pipeline.runner.live_sequences or in_flight())

    async def idle() -> None:
        while busy():
            if pipeline.runner.live_sequences:
                await pipeline.wait_idle()
            else:
                await trio.sleep(IN_FLIGHT_POLL_S)

    while busy():
        if trio.current_time() >= deadline:
            return False
        if await _first_of(deadline, idle=idle, interrupt=interrupt) == "interrupt":
            return None
    return True


async def _first_of(deadline: float, **waits: Callable[[], Awaitable[object]]) -> str | None:
    """The name of the first of ``waits`` to return before trio time ``deadline``, or None."""
    first: list[str] = []
    with trio.move_on_at(deadline):
        async with trio.open_nursery() as nursery:

            async def race(name: str, wait: Callable[[], Awaitable[object]]) -> None:
                await wait()
                first.append(name)
                nursery.cancel_scope.cancel()

            for name, wait in waits.items():
                nursery.start_soon(race, name, wait)
    return first[0] if first else None


async def run_within(compute: Callable[[], None], seconds: float) -> threading.Event | None:
    """Run ``compute`` in a worker thread; None when it returned within ``seconds``, else
    the event its thread sets when it does return: Python cannot stop a thread, so it is
    abandoned (it keeps its thread, and whatever it computes on, until then)."""
    finished = threading.Event()

    def run() -> None:
        try:
            compute()
        finally:
            finished.set()

    with trio.move_on_after(seconds):
        await trio.to_thread.run_sync(run, abandon_on_cancel=True)
        return None
    return finished


def is_data_reply(message: Message) -> TypeGuard[DataReply]:
    """Whether ``message`` answers frames (a ``Prediction`` or ``PredictionBatch``, or an
    ``Error`` naming a request): the session hands those straight to
    :meth:`RemotePipeline.deliver`."""
    if isinstance(message, PredictionBatch):
        return True
    return isinstance(message, Prediction | Error) and bool(message.request_id)


def _checked(result: StepResult, vocab: int) -> StepResult:
    """``result`` if its ids fit the model's ``vocab``: they come from another node, and each
    becomes the next frame's input here (and a draft model's, and the detokenizer's)."""
    ids = (*result.tokens, *result.drafts)
    for lp in result.logprobs or ():
        ids += (lp.token, *(token for token, _ in lp.top))
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise PipelineError(f"token id {bad} is outside 0..{vocab - 1}")
    return result


def _outcome(
    message: Prediction | Error, vocab: int
) -> tuple[StepResult | None, MeshnodeError | None]:
    """What a frame's answer means for its waiter: a result, or the error it raises."""
    if isinstance(message, Prediction):
        try:
            return _checked(result_from_wire(message), vocab), None
        except (PipelineError, ValueError) as exc:  # ValueError: lists of unequal length
            return None, PipelineError(f"the last stage sent a bad Prediction: {exc}")
    if (retry := RETRY_CODES.get(message.code)) is not None:
        return None, retry(message.message)  # the generation loop handles these
    return None, PipelineError(f"a stage failed: {message.message}")


@dataclass(eq=False, slots=True)
class _Queued:
    """A frame in line at stage 0's batcher (:meth:`RemotePipeline.queue`)."""

    pipeline: RemotePipeline
    frame: StepFrame
    slot: Slot[Waiter]

    async def result(self) -> StepResult:
        pipeline = self.pipeline
        if pipeline.failure is not None:
            pipeline.batcher.withdraw(self.slot)
            raise pipeline._lost()
        return await pipeline._answer(self.frame, await pipeline.batcher.wait(self.slot))

    def cancel(self) -> None:
        self.pipeline.batcher.withdraw(self.slot)


class RemotePipeline(StageLink):
    """A :class:`~meshnode.node.pipeline.Pipeline` over the stages of one run."""

    def __init__(
        self,
        runner: StageRunner,
        *,
        run_id: str,
        term: int,
        stage_nodes: Sequence[str],
        send: SendFn,
        wire_dtype: str,
        batch_limits: BatchLimits | None = None,
        deadline: PassDeadline | None = None,
        speeds: SpeedBook | None = None,
        stage_weight_bytes: Sequence[int] = (),
        prefix_blocks: Sequence[int] = (),  # each other stage's Ready.prefix_block
        prefix_seeds: Sequence[str] = (),  # each stage's Load.prefix_seed (none: the run id)
        prefix_held: Sequence[bytes] = (),  # blocks the stages kept of the run before
    ) -> None:
        super().__init__(
            run_id=run_id,
            term=term,
            stage_nodes=stage_nodes,
            send=send,
            wire_dtype=wire_dtype,
            max_sequences=runner.max_sequences,
            deadline=deadline,
        )
        self.runner = runner
        # With n stages, n micro-batches in flight keep every stage busy (batcher docstring).
        limits = batch_limits or BatchLimits(
            max_frames=runner.max_sequences, micro_batches=len(self.stage_nodes)
        )
        self.batcher: Batcher[Waiter] = Batcher(
            self._step, limits, live=lambda: runner.live_sequences
        )
        # One-row passes' stage times, as decode rates the planner can use (node/speeds.py):
        # each stage's weight bytes over its compute time.
        self.measured = PassMeter(speeds, self.stage_nodes, stage_weight_bytes)
        self.failed = trio.Event()  # set with ``failure``: the coordinator watches it
        self._released = trio.Event()  # set by every release; wait_idle re-checks
        # Set when stage 0's compute missed its deadline: its thread's end (``_step``).
        self._hung: threading.Event | None = None
        self.prefix, self.kv_blocks = host_pools(  # hook (issue 30)
            runner, prefix_blocks, prefix_seeds or run_id, prefix_held
        )

    @property
    def context_size(self) -> int:
        return int(self.runner.context_size)

    async def run(self, frame: StepFrame) -> StepResult:
        if self.failure is not None:
            raise self._lost()
        return await self._answer(frame, await self.batcher.submit(frame))

    def queue(self, frame: StepFrame) -> QueuedPass:
        return _Queued(self, frame, self.batcher.enqueue(frame))

    async def _answer(self, frame: StepFrame, waiter: Waiter) -> StepResult:
        """Wait for the prediction of a frame that stage 0 has sent on (``waiter``)."""
        try:
            with trio.move_on_at(waiter.deadline_at):
                await waiter.done.wait()
            if not waiter.done.is_set():
                self.fail(f"a pass did not come back within {waiter.deadline_s:.0f} s")
        finally:
            if waiter.wire_id is not None:
                self._waiters.pop(waiter.wire_id, None)
        if waiter.result is None:
            raise waiter.error or PipelineError("the frame's waiter woke without a result")
        note_pass(self.prefix, frame)  # hook (issue 30): every stage stored its blocks
        if waiter.local_s is None:  # a one-stage run: the result is all there is
            return waiter.result
        # The other stages report their compute (the last its own, the middle ones through
        # the frame); stage 0's is measured here. A member's list is cut to the run's
        # stages: each entry becomes a metrics series (issue 36, item 10).
        stages = (waiter.local_s, *waiter.result.stage_compute_s)[: len(self.stage_nodes)]
        self.measured.observe(stages, waiter.rows)
        return dataclasses.replace(
            waiter.result,
            request_id=frame.request_id,
            compute_s=sum(stages),
            stage_compute_s=stages,
        )

    async def _step(self, slots: list[Slot[Waiter]]) -> None:
        """One batched step of stage 0; the frames go on downstream as one message.

        Stage 0's compute has the deadline of the step's tokens. A forward that hangs here
        is this node's own, which no probe can blame and no plan can leave out: its thread
        and the runner are abandoned, and the pipeline fails naming this node, so the
        coordinator brings up a fresh stage 0 and the requests replay there.
        """
        inner: list[Slot[Any]] = [Slot(slot.frame) for slot in slots]
        step: Callable[[StageRunner, list[Slot[Any]]], None] = (
            step_results if self.runner.last else step_activations
        )
        seconds = self.deadline.seconds(sum(len(slot.frame.tokens) for slot in slots))
        began = time.perf_counter()
        if self.failure is None:
            self._hung = await run_within(lambda: step(self.runner, inner), seconds)
            if self._hung is not None:
                host = self.stage_nodes[0]
                reason = f"stage 0 on this node ({host}) did not finish a pass within"
                self.fail(f"{reason} {seconds:.0f} s", node=host)
        if self.failure is not None:
            for slot in slots:
                slot.error = self._lost()
            return
        if self.runner.last:  # a one-stage run
            for slot, done in zip(slots, inner, strict=True):
                slot.error = done.error
                if done.output is not None:
                    slot.output = Waiter()
                    slot.output.finish(done.output)
            return
        local_s = time.perf_counter() - began
        rows = sum(len(slot.frame.tokens) for slot in slots)
        messages = []
        for slot, done in zip(slots, inner, strict=True):
            slot.error = done.error
            if done.output is not None:
                slot.output, message = self._outgoing(slot.frame, done.output, local_s)
                slot.output.rows = rows
                if message is not None:  # None: stage 1 resumes past it (issue 30)
                    messages.append(message)
        if messages:
            await self._forward_step(slots, messages, self._set_deadline(slots))

    @property
    def stage0_hung(self) -> bool:
        """Whether a stage-0 compute that missed its deadline is still running (its
        thread, and the runner it holds, are not freed until it returns)."""
        return self._hung is not None and not self._hung.is_set()

    async def wait_idle(self) -> None:
        """Return once no request holds a sequence of this pipeline (all were released)."""
        while self.runner.live_sequences:
            self._released = trio.Event()
            await self._released.wait()

    async def keep_prefix(self) -> StagePrefix | None:
        """Stage 0's prefix pool, its sequences released, for the next run to take over
        (:mod:`meshnode.node.prefix_keep`); None when a stage-0 forward hangs (its thread
        may still write to the pool). Call once the pipeline has ended."""
        async with self.batcher.exclusive():
            if self._hung is not None:
                return None
            self.runner.release_all()
        return self.runner.prefix

    async def release(self, request_id: RequestId) -> None:
        # Between steps, so a release never races the worker thread's use of the cache;
        # an abandoned thread may still use the runner: it is left alone (``_step``).
        async with self.batcher.exclusive():
            if self._hung is None:
                self.runner.release(request_id)
        self._released.set()
        note_release(self.prefix, request_id)  # hook (issue 30)
        wire_id = self._wire_ids.pop(request_id, None)
        if wire_id is None:
            return  # never crossed the wire: no other stage holds it
        self._waiters.pop(wire_id, None)
        self._unanswered.pop(wire_id, None)
        self._wire.release(wire_id)
        message = Release(request_id=str(wire_id), run_id=self.run_id, term=self.term)
        for node in self.stage_nodes[1:]:
            # A stage that is gone has freed everything already.
            with contextlib.suppress(*SEND_ERRORS):
                await self._send(node, message)

    def deliver(self, peer: str, message: DataReply) -> None:
        """Wake the waiters of a data reply from ``peer``; anything else is dropped: a reply
        of another run (late), a prediction not from the last stage, an ``Error`` not
        from a stage of this pipeline (wire ids are guessable; the sender is not)."""
        if message.run_id != self.run_id or not self.may_reply(peer, message):
            log.debug("dropped %s from %s", type(message).__name__, peer)
            return
        self._progress_s = trio.current_time()
        if isinstance(message, PredictionBatch):
            for prediction in message.predictions:
                self._wake(prediction)
        else:
            self._wake(message)

    def _wake(self, message: Prediction | Error) -> None:
        wire_id = RequestId(message.request_id)
        waiter = self._waiters.get(wire_id)
        if waiter is None or waiter.done.is_set():
            return
        self._unanswered.pop(wire_id, None)
        if isinstance(message, Error) and message.code in RUN_LOST_CODES:
            self.fail(f"a stage no longer runs this pipeline: {message.message}")
            return
        waiter.result, waiter.error = _outcome(message, self.runner.stage.config.vocab_size)
        waiter.done.set()

    def may_reply(self, peer: str, message: DataReply) -> bool:
        """Predictions come from the last stage; a frame's failure from any remote stage."""
        if isinstance(message, Prediction | PredictionBatch):
            return peer == self.stage_nodes[-1]
        return peer in self.stage_nodes[1:]

    def fail(self, reason: str, *, node: str | None = None, left: bool = False) -> None:
        """The pipeline is dead: wake every waiter with a StageLostError (``reason``, the
        first one given, and ``node`` when known); later calls to ``run`` fail at once.
        ``left``: ``node`` said goodbye, which is news (INFO), not a failure (WARNING)."""
        if self.failure is None:
            log.log(logging.INFO if left else logging.WARNING, "run %s: %s", self.run_id, reason)
            self.failure = StageLostError(reason, node=node, left=left)
            self.failed.set()
        elif self.failure.node is None:
            self.failure.node = node
        if self._sending is not None:
            self._sending.cancel()
        for waiter in self._waiters.values():
            if not waiter.done.is_set():
                waiter.error = self._lost()
                waiter.done.set()

    def _lost(self) -> StageLostError:
        """A fresh error for one waiter (each raise gets its own traceback)."""
        assert self.failure is not None
        return StageLostError(str(self.failure), node=self.failure.node, left=self.failure.left)
