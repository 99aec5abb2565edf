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
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

from meshnode.errors import MeshnodeError
from meshnode.node.pipeline import FrameKind, PipelineError, StepFrame
from meshnode.node.stage import MAX_SEQUENCES_PER_STAGE

T = TypeVar("T")

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
    order (the behaviour before batching, kept for comparison: ``benchmarks/concurrency.py``).
    """

    enabled: bool = True
    max_frames: int = DEFAULT_MAX_FRAMES
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS
    micro_batches: int = 1

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
class Slot(Generic[T]):
    """One frame waiting for a step; the step function fills ``output`` or ``error``."""

    frame: StepFrame
    output: T | None = None
    error: MeshnodeError | None = None  # raised in the task that submitted the frame
    done: bool = False


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


@dataclass(eq=False, slots=True)
class _Turn:
    """Who may run now: a step's leader or an exclusive caller (release)."""

    busy: bool = False
    over: trio.Event = field(default_factory=trio.Event)  # set when the current holder ends


class Batcher(Generic[T]):
    """Groups concurrent :meth:`submit` calls into steps (see the module docstring)."""

    def __init__(
        self, step: StepFn[T], limits: BatchLimits, live: Callable[[], int] = lambda: 0
    ) -> None:
        self.limits = limits
        self._step = step
        self._live = live
        self._pending: list[Slot[T]] = []
        self._turn = _Turn()
        self._exclusive = 0  # tasks waiting for exclusive(): steps wait for them
        self.steps = 0  # steps run so far (tests and telemetry)

    async def submit(self, frame: StepFrame) -> T:
        """Run ``frame`` in a step; its output. Raises the error the step set for it
        (a PipelineError, or the engine's RollbackError)."""
        return await self.wait(self.enqueue(frame))

    def enqueue(self, frame: StepFrame) -> Slot[T]:
        """Put ``frame`` in line for the next steps at once, without waiting: a step led
        by any task may take it. :meth:`wait` gives its output; :meth:`withdraw` takes it
        back while no step has taken it."""
        slot: Slot[T] = Slot(frame)
        self._pending.append(slot)
        return slot

    async def wait(self, slot: Slot[T]) -> T:
        """The output of an enqueued ``slot``, leading steps until one has run it (as
        :meth:`submit`). Cancelled before any step took it, the slot is withdrawn."""
        try:
            while not slot.done:
                if self._turn.busy or self._exclusive:  # a release waiting goes first
                    await self._turn.over.wait()
                    continue
                async with self._holding():
                    await self._run_step()
        finally:
            self.withdraw(slot)
        if slot.error is not None:
            raise slot.error
        assert slot.output is not None, "a step left a slot without output or error"
        return slot.output

    def withdraw(self, slot: Slot[T]) -> None:
        """Take ``slot`` out of line if no step has taken it yet (else its step runs it and
        its output is dropped)."""
        if slot in self._pending:
            self._pending.remove(slot)

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the stage between steps (no step runs inside the ``async with``). It
        comes before the next step (a step gathering when it is asked for gives way):
        a sequence that finishes while others decode is released at once. Before, the
        task that led a step led the next one at once whenever its own sequence went
        on, and a finished sequence stayed unreleased (its stream not ended, its slot
        held) until the leader's sequence finished."""
        self._exclusive += 1
        try:
            while self._turn.busy:
                await self._turn.over.wait()
        except BaseException:
            self._exclusive -= 1
            if not self._turn.busy:  # leaders deferring to us wait on this turn's end
                self._end_turn()
            raise
        self._exclusive -= 1
        async with self._holding():
            yield

    @asynccontextmanager
    async def _holding(self) -> AsyncIterator[None]:
        self._turn.busy = True
        try:
            yield
        finally:
            self._end_turn()

    def _end_turn(self) -> None:
        over, self._turn = self._turn.over, _Turn()
        over.set()

    async def _run_step(self) -> None:
        await self._gather()
        if self._exclusive:
            return  # a sequence that just finished is being released: that goes first
        batch = self._take()
        if not batch:
            return
        self.steps += 1
        try:
            with trio.CancelScope(shield=True):
                await self._step(batch)
        finally:
            for slot in batch:
                if slot.output is None and slot.error is None:
                    slot.error = PipelineError("the batched step failed")
                slot.done = True

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
        frames = [slot.frame for slot in self._pending]
        chosen = plan_batch(frames, self.limits, self._live())
        batch = [self._pending[i] for i in chosen]
        taken = set(chosen)
        self._pending = [s for i, s in enumerate(self._pending) if i not in taken]
        return batch
