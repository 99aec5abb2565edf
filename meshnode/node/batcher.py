"""Continuous batching on stage 0: the ready frames of many sequences, one forward per step.

Theory of operation. Each request's generation loop calls ``Pipeline.run`` with one frame
at a time, from its own task. The pipeline hands the frame to a :class:`Batcher` and
waits. Steps run one at a time; whichever waiting task finds no step running *leads* the
next one: it lets the other tasks that are about to submit do so (a few scheduler ticks,
never wall time), picks the frames of the step with :func:`plan_batch` (a pure function),
and runs the pipeline's step function on them, in which the stage computes all of them
as one multi-row forward. When the step ends every task whose frame it carried wakes with
its own outcome; finished sequences simply stop submitting and new ones start, so
requests join and leave between steps. A release (:meth:`Batcher.exclusive`) goes before
the next step, so a sequence that ends leaves at once while the others go on.

What a step takes (:func:`plan_batch`): frames in arrival order, at most one per sequence
and at most ``max_frames``; decode and verify frames (a few rows each) always fit, while
prefill chunks share a per-step token budget, so a long prompt advances one chunk per
step next to everybody's decode rows instead of stalling them for its whole prefill. With
``micro_batches > 1`` (a pipeline of several stages) a step takes about ``1 / n`` of the
live sequences, so that several micro-batches are in flight along the stages at once.

**Running ahead** (a pipeline that gives an :class:`Ahead`: the local one). A decode
frame that a generation loop put in line ahead (:meth:`Batcher.enqueue`) is followed, if
its sequence goes on, by the decode frame of the token it returns, and nothing else: the
loop queues exactly that frame before it hands the token to its client. So the step's
compute thread does not hand back to the event loop and wait for every loop to queue its
next frame: after a step it predicts those frames itself (:func:`next_decode`), posts the
step's outputs to the event loop, and runs the next step at once. The loops take their
outputs, and put their next frames in line, while that next step computes: a frame equal
to the prediction claims it (its output is the prediction's), so the commit, the client's
I/O, the wake-ups of every task and both thread hand-offs overlap a forward instead of
sitting between two. Only claimed predictions are followed: a sequence whose loop did not
come back during a step (it finished, its client is slow, or it sends something else) gets
no further rows, and its one row that nobody claimed is dropped. The thread stops at a
step boundary when a release waits (:meth:`Batcher.exclusive`: a finished sequence leaves
before the next step, as without running ahead), when a frame is in line that no
prediction covers (a newcomer's prefill: the next step is gathered as usual), or when
nothing is left to follow. A sequence's tokens are those of running it step by step: a
prediction is the very frame its loop would send, computed with the same positions and
counter-based sampling.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

from meshnode.node.pipeline import (
    MAX_SEQUENCES_PER_STAGE,
    FrameKind,
    PipelineError,
    Slot,
    StepFrame,
    StepResult,
)

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Frames per step: every live sequence's. Stage 0 admits no more sequences than a stage
#: holds (the scheduler's slots), and each has at most one frame ready at a time.
DEFAULT_MAX_FRAMES = MAX_SEQUENCES_PER_STAGE
#: Prompt tokens per step (all prefill chunks of the step together; the oldest chunk always
#: goes, so prefill always advances). One default prefill chunk: a step with a chunk and
#: eight decode rows costs about what the chunk alone costs, so decoders see at most one
#: chunk's delay per token while a long prompt is being read.
DEFAULT_PREFILL_TOKENS = 256
#: Scheduler ticks a step's leader waits for more frames, stopping early once a tick brings
#: none. Tasks whose frames just came back submit their next frame within a tick or two
#: (the generation loop does no I/O between passes); the bound keeps a step from waiting
#: on a client that is slow to read its stream.
GATHER_TICKS = 8
#: Ticks in a row that bring no frame before a step stops gathering. Two, because trio runs
#: the tasks of a tick in random order: the leader may run before the tasks that the last
#: step woke, and only the tick after that is sure to have seen them all.
QUIET_TICKS = 2


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one step may carry. ``enabled=False`` runs one frame per step, in arrival
    order (the behaviour before batching, kept for comparison: ``benchmarks/concurrency.py``),
    and never runs ahead.
    """

    enabled: bool = True
    max_frames: int = DEFAULT_MAX_FRAMES
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS
    micro_batches: int = 1
    #: Run ahead (module docstring): False (the default) never, every step handed back;
    #: None while one sequence decodes (the local pipeline); True wherever the pipeline
    #: can. Off by default because it did not pay on an idle 2-core machine: a lone
    #: stream ran 0.95x (q8) and 0.97x (exact) of stepwise at 1 kernel thread, its
    #: forward slowed by the event loop's work beside it, and 0.97-1.03x at 2.
    ahead: bool | None = False

    def __post_init__(self) -> None:
        if self.max_frames < 1 or self.prefill_tokens < 1 or self.micro_batches < 1:
            raise ValueError(f"invalid batch limits: {self}")


def plan_batch(pending: Sequence[StepFrame], limits: BatchLimits, live: int) -> list[int]:
    """Indices into ``pending`` (in arrival order) of the frames the next step runs.

    ``live`` is the number of sequences the pipeline holds (for the micro-batch size).
    Never empty when ``pending`` is not.
    """
    cap = _frames_per_step(len(pending), limits, live)
    chosen: list[int] = []
    sequences: set[str] = set()
    prefill = 0
    for i, frame in enumerate(pending):
        if len(chosen) == cap:
            break
        if frame.request_id in sequences:
            continue  # one frame per sequence: the next one goes in a later step
        if frame.kind is FrameKind.PREFILL:
            if prefill and prefill + len(frame.tokens) > limits.prefill_tokens:
                continue
            prefill += len(frame.tokens)
        sequences.add(frame.request_id)
        chosen.append(i)
    return chosen


def _frames_per_step(pending: int, limits: BatchLimits, live: int) -> int:
    if not limits.enabled:
        return 1
    if limits.micro_batches == 1:
        return limits.max_frames
    # With n stages, n micro-batches keep every stage busy.
    share = math.ceil(max(live, pending) / limits.micro_batches)
    return max(1, min(limits.max_frames, share))


@dataclass(eq=False, slots=True)
class Queued(Generic[T]):
    """A frame a :class:`Batcher` holds in line (:meth:`Batcher.enqueue`), as the
    generation loop's ``QueuedPass``."""

    batcher: Batcher[T]
    slot: Slot[T]

    async def result(self) -> T:
        """The frame's output (:meth:`Batcher.wait`)."""
        return await self.batcher.wait(self.slot)

    def cancel(self) -> None:
        """Withdraw the frame if no step took it yet."""
        self.batcher.withdraw(self.slot)


#: Runs one step: fills every slot's ``output`` or ``error``. Called with no other step
#: running; it is shielded from cancellation (the step serves other requests too).
StepFn = Callable[[list["Slot[T]"]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Ahead(Generic[T]):
    """What running ahead (module docstring) needs of a pipeline: ``compute`` runs one
    step in the calling (worker) thread, filling every slot's ``output`` or ``error``;
    ``follow(frame, output)`` is the frame a sequence's loop sends next after ``frame``
    gave ``output``, if it goes on and sends a frame known in advance (else None).
    ``rows``: the most frames a step ahead carries (None: any); a step that would carry
    more is handed back instead."""

    compute: Callable[[list[Slot[T]]], None]
    follow: Callable[[StepFrame, T], StepFrame | None]
    rows: int | None = None


def next_decode(
    frame: StepFrame, result: StepResult, ends: frozenset[int] = frozenset()
) -> StepFrame | None:
    """The decode frame that follows a decode ``frame`` which returned ``result``: the
    generation loop's next one if the sequence goes on (:meth:`Batcher.enqueue`). None
    after a token of ``ends`` (the model's EOS: the reply most likely ends there), for
    other frames, and for a sequence under a grammar (a row past the grammar's end would
    fail, and a failed frame sends its whole step's frames through one by one)."""
    if frame.kind is not FrameKind.DECODE or frame.grammar is not None:
        return None
    if len(result.tokens) != 1 or result.tokens[0] in ends:
        return None
    return dataclasses.replace(frame, start_pos=frame.end_pos, tokens=result.tokens)


class Batcher(Generic[T]):
    """Groups concurrent :meth:`submit` calls into steps (see the module docstring)."""

    def __init__(
        self,
        step: StepFn[T],
        limits: BatchLimits,
        live: Callable[[], int] = lambda: 0,
        ahead: Ahead[T] | None = None,
    ) -> None:
        """``step`` runs a step from the event loop; with ``ahead`` (and the limits'
        ``ahead``) steps run ahead in a worker thread instead (module docstring)."""
        self.limits = limits
        self._step = step
        self._live = live
        runs_ahead = limits.enabled and limits.ahead is not False and limits.micro_batches == 1
        self._ahead = ahead if runs_ahead else None
        self._pending: list[Slot[T]] = []
        # The line and the predictions are read by the compute thread between steps.
        self._lock = threading.Lock()
        # Predictions not claimed yet, by sequence and position (at most two a sequence:
        # a loop that comes late finds its outputs there), until its release (forget).
        self._predicted: dict[tuple[str, int], Slot[T]] = {}
        self._undelivered: list[list[Slot[T]]] = []  # steps taken, outputs not yet posted
        self._claimed: dict[str, Slot[T]] = {}  # claimed predictions, their outputs not taken
        self._busy = False  # a step (or a run of steps ahead) or an exclusive holder runs
        self._changed = trio.Event()  # set, and replaced, when a step or a turn ends
        self._exclusive = 0  # tasks waiting for exclusive(): steps wait for them
        self.steps = 0  # steps run so far (tests and telemetry)
        self.claims = 0  # frames whose output a step ahead computed (tests and telemetry)

    async def submit(self, frame: StepFrame) -> T:
        """Run ``frame`` in a step; its output. Raises the error the step set for it
        (a PipelineError, or the engine's RollbackError)."""
        return await self.wait(self._line_up(frame, follows=False))

    def enqueue(self, frame: StepFrame) -> Slot[T]:
        """Put ``frame`` in line for the next steps at once, without waiting: a step led
        by any task may take it, or it claims the equal frame a step runs ahead already.
        :meth:`wait` gives its output; :meth:`withdraw` takes it back while no step has
        taken it. The caller promises that, if its sequence goes on after this frame, its
        next frame is the one ``Ahead.follow`` gives (the generation loop's plain decode)."""
        return self._line_up(frame, follows=True)

    def _line_up(self, frame: StepFrame, *, follows: bool) -> Slot[T]:
        with self._lock:
            slot = self._predicted.pop((frame.request_id, frame.start_pos), None)
            # a prediction that missed (or whose step failed) is dropped: the frame runs
            if slot is None or slot.frame != frame or slot.error is not None:
                slot = Slot(frame)
                self._pending.append(slot)
            else:
                self._claimed[frame.request_id] = slot
                self.claims += 1
                slot.unclaimed = -1  # a loop's frame now: followed only if it says so
            slot.follows = follows
            return slot

    async def wait(self, slot: Slot[T]) -> T:
        """The output of an enqueued ``slot``, leading steps until one has run it (as
        :meth:`submit`). Cancelled before any step took it, the slot is withdrawn."""
        try:
            while not slot.done:
                if self._busy or self._exclusive:  # a release waiting goes first
                    await self._changed.wait()
                    continue
                await self._lead()
        finally:
            self.withdraw(slot)
            if self._claimed.get(slot.frame.request_id) is slot:
                del self._claimed[slot.frame.request_id]
        if slot.error is not None:
            raise slot.error
        assert slot.output is not None, "a step left a slot without output or error"
        return slot.output

    def withdraw(self, slot: Slot[T]) -> None:
        """Take ``slot`` out of line if no step has taken it yet (else its step runs it and
        its output is dropped)."""
        with self._lock:
            if slot in self._pending:
                self._pending.remove(slot)

    def forget(self, request_id: str) -> None:
        """Drop the predictions of a sequence that was released (call it between steps:
        :meth:`exclusive`)."""
        with self._lock:
            for key in [key for key in self._predicted if key[0] == request_id]:
                del self._predicted[key]

    def in_line(self) -> list[StepFrame]:
        """Frames whose outputs tasks have yet to take: in line, in a step, or claimed
        predictions (tests)."""
        with self._lock:
            unclaimed = {id(slot) for slot in self._predicted.values()}
            taken = [s for step in self._undelivered for s in step if id(s) not in unclaimed]
            claimed = [s for s in self._claimed.values() if s not in taken]
            return [slot.frame for slot in (*self._pending, *taken, *claimed)]

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the stage between steps (no step runs inside the ``async with``). It
        comes before the next step (a step gathering when it is asked for gives way, and
        steps running ahead stop at the next step's end): a sequence that finishes while
        others decode is released at once. Before, the task that led a step led the next
        one at once whenever its own sequence went on, and a finished sequence stayed
        unreleased (its stream not ended, its slot held) until the leader's finished."""
        self._exclusive += 1
        try:
            while self._busy:
                await self._changed.wait()
        except BaseException:
            self._exclusive -= 1
            self._notify()  # leaders deferring to us go on
            raise
        self._exclusive -= 1
        self._busy = True
        try:
            yield
        finally:
            self._end_turn()

    def _end_turn(self) -> None:
        self._busy = False
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def _lead(self) -> None:
        """Lead the next step: gather, take the frames, run them (or start running ahead:
        the turn then ends in :meth:`_posted`)."""
        self._busy = True
        try:
            await self._gather()
            # A sequence that just finished is being released: that goes first.
            batch = [] if self._exclusive else self._take()
        except BaseException:
            self._end_turn()
            raise
        if batch and self._ahead is not None:
            with self._lock:
                self._undelivered.append(batch)
            token = trio.lowlevel.current_trio_token()
            trio.lowlevel.start_thread_soon(
                lambda: self._run_ahead(batch, token), lambda _: None, name="meshnode-step"
            )
            return
        try:
            if batch:
                await self._run_step(batch)
        finally:
            self._end_turn()

    async def _run_step(self, batch: list[Slot[T]]) -> None:
        self.steps += 1
        try:
            with trio.CancelScope(shield=True):
                await self._step(batch)
        finally:
            _settle(batch)

    def _run_ahead(self, batch: list[Slot[T]], token: trio.lowlevel.TrioToken) -> None:
        """The compute thread: steps, each one's outputs posted to the event loop, until
        nothing is left to follow or the loop needs the stage (module docstring)."""
        assert self._ahead is not None
        while batch:
            following: list[Slot[T]] = []
            try:
                self._ahead.compute(batch)
                following = self._following(batch)
            except BaseException as exc:  # it cannot propagate from this thread: to its tasks
                log.exception("a batched step failed")
                _fail(batch, exc)
            self.steps += 1
            try:
                token.run_sync_soon(self._posted, not following)
            except trio.RunFinishedError:  # the event loop is gone: nobody waits
                return
            batch = following

    def _following(self, batch: list[Slot[T]]) -> list[Slot[T]]:
        """The next step ahead (in the compute thread, after ``batch``): the predictions
        of the frames that follow the ones their loops claimed or put in line ahead, and,
        once, of a prediction not claimed yet (its loop may only be late: it claims both,
        and misses no step); none when a release waits or a frame no prediction covers is
        in line."""
        assert self._ahead is not None
        with self._lock:
            if self._exclusive or self._pending:
                return []
            following: list[Slot[T]] = []
            for slot in batch:
                if slot.error is not None or slot.output is None:
                    continue
                if not slot.follows and slot.unclaimed != 0:
                    continue
                frame = self._ahead.follow(slot.frame, slot.output)
                if frame is not None:
                    unclaimed = 0 if slot.follows else slot.unclaimed + 1
                    following.append(Slot(frame, unclaimed=unclaimed))
            rows = self._ahead.rows
            if not following or (rows is not None and len(following) > rows):
                return []
            for prediction in following:
                self._predicted[prediction.frame.request_id, prediction.frame.start_pos] = (
                    prediction
                )
            self._undelivered.append(following)
            return following

    def _posted(self, last: bool) -> None:
        """A step ahead has its outputs (in the event loop): its tasks wake."""
        with self._lock:
            batch = self._undelivered.pop(0)
        _settle(batch)
        if last:
            self._end_turn()
        else:
            self._notify()

    async def _gather(self) -> None:
        """Let tasks that are about to submit do so (see GATHER_TICKS)."""
        quiet = 0
        for _ in range(GATHER_TICKS):
            if not self.limits.enabled:
                return
            if self._continuing() >= self._live() and not self._starting():
                return  # every live sequence has its frame here: nothing more to wait for
            before = len(self._pending)
            await trio.lowlevel.checkpoint()
            quiet = quiet + 1 if len(self._pending) == before else 0
            if quiet == QUIET_TICKS:
                return

    def _continuing(self) -> int:
        """Pending frames of sequences that already exist (a new one starts at 0)."""
        return sum(1 for slot in self._pending if slot.frame.start_pos > 0)

    def _starting(self) -> bool:
        """Whether a new sequence's first frame is pending: requests come in bursts (a
        client's parallel calls, the queue's next ones), and the others of a burst are a
        tick or two behind it. Gathering them (until the ticks go quiet) prefills them in
        one step instead of leaving all but the first to wait for the next one."""
        return any(slot.frame.start_pos == 0 for slot in self._pending)

    def _take(self) -> list[Slot[T]]:
        with self._lock:
            frames = [slot.frame for slot in self._pending]
            chosen = plan_batch(frames, self.limits, self._live())
            batch = [self._pending[i] for i in chosen]
            taken = set(chosen)
            self._pending = [s for i, s in enumerate(self._pending) if i not in taken]
            return batch


def _settle(batch: list[Slot[T]]) -> None:
    """Mark a step's slots done; a slot the step left without output fails."""
    for slot in batch:
        if slot.output is None and slot.error is None:
            slot.error = PipelineError("the batched step failed")
        slot.done = True


def _fail(batch: list[Slot[T]], exc: BaseException) -> None:
    for slot in batch:
        if slot.output is None and slot.error is None:
            error = PipelineError(f"the batched step failed: {exc!r}")
            error.__cause__ = exc
            slot.error = error
