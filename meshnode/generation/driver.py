"""The async driver of one request: the generation loop over a pipeline.

:func:`generate` drives a :class:`~meshnode.generation.state.GenerationState` over a
:class:`~meshnode.node.pipeline.Pipeline`, as a ladder: prefill the prompt in chunks, then
either decode one token or, when a proposer offers drafts, verify ``[last, d1 … dk]`` in
one pass and commit what was accepted. Each pass yields a :class:`Delta` for the client; a
plain decode's next frame is queued first (on a ``QueuingPipeline``), so the next batched
step never waits for one client's I/O, which overlaps the forward instead. Leaving the loop
for any reason (finish, error, client gone, cancellation) drops a queued frame and
releases the sequence on every stage.

A lost stage or a recurrent state that cannot roll back far enough costs the client
nothing: the driver replays the request (:mod:`meshnode.generation.replay`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from meshnode.engine.recurrent import RollbackError
from meshnode.engine.sampling import random_seed
from meshnode.generation.prefix import prefill_prompt
from meshnode.generation.records import (
    DEFAULT_PREFILL_CHUNK_TOKENS,
    GenerationRun,
    PassObserver,
    Speculation,
    frame_of,
)
from meshnode.generation.replay import (
    PipelineSource,
    next_pipeline,
    refold,
    replay_history,
)
from meshnode.generation.state import Delta, GenerationParams
from meshnode.node.pipeline import (
    FrameKind,
    Pipeline,
    QueuedPass,
    QueuingPipeline,
    StageLostError,
    StepFrame,
    StepResult,
)
from meshnode.speculative.mtp import MtpProposer
from meshnode.speculative.window import Window

if TYPE_CHECKING:
    from meshnode.speculative.proposer import Proposer


async def generate(
    pipeline: Pipeline,
    run: GenerationRun,
    *,
    speculation: Speculation | None = None,
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    on_pass: PassObserver | None = None,
    replacement: PipelineSource | None = None,
) -> AsyncGenerator[Delta, None]:
    """Drive ``run`` to completion over ``pipeline``, yielding one :class:`Delta` per pass.

    The prompt must fit the context with room for one token (the caller checks).
    ``on_pass(pass_s, result)`` is called after every pipeline pass (for metrics). With
    ``replacement``, a lost pipeline is replaced and the request replayed on the new one
    (module docstring). Raises :class:`~meshnode.node.pipeline.PipelineError` if a pass
    fails (a ``StageLostError`` once replays are spent or impossible). The sequence is
    released on the pipeline that holds it however the loop ends.
    """
    run.timings.started = trio.current_time()
    run.on_pass = on_pass
    run.chunk_tokens = chunk_tokens
    run.params = _seeded(run.params)
    if speculation is not None and speculation.strategy == "mtp":
        run.mtp_drafts = speculation.window.max_window
    driver = _Driver(pipeline, run, speculation, replacement)
    try:
        while not run.state.finished:
            delta = await driver.step()
            driver.queue_next()  # before the delta goes to the client: module docstring
            yield delta
        run.timings.finished = trio.current_time()
    finally:
        driver.drop_queued()
        with trio.CancelScope(shield=True):
            await driver.pipeline.release(run.request_id)


class _Driver:
    """The steps of one request over a pipeline that may be replaced under it."""

    def __init__(
        self,
        pipeline: Pipeline,
        run: GenerationRun,
        speculation: Speculation | None,
        replacement: PipelineSource | None,
    ) -> None:
        self.pipeline = pipeline
        self.run = run
        self.speculation = speculation
        self.replacement = replacement
        self.proposer: Proposer | None = None
        self.window: Window | None = None
        self.rebuild = False  # the pipeline is new: its stages hold nothing of the request
        self.queued: _Ahead | None = None  # the next decode frame, in line already
        self.queue = _queue_of(pipeline)

    def queue_next(self) -> None:
        """Put the next plain decode frame in line now, where the pipeline can (a
        :class:`QueuingPipeline`) and the next step is one (no drafts to propose, no
        history to replay): the frame :func:`_decode_step` would send; not the budget's
        last (a frame in line promises the next, which a local pipeline computes ahead)."""
        last = len(self.run.state.tokens) + 1 >= self.run.params.budget
        if self.run.state.finished or last or self.rebuild or self.queued or not self.queue:
            return
        if self.window is None and self.speculation is not None:
            self._speculate(self.speculation)
        if self.proposer is not None:
            return
        frame = frame_of(
            self.run, FrameKind.DECODE, len(self.run.history) - 1, [self.run.history[-1]]
        )
        self.queued = _Ahead(frame, self.queue(frame), trio.current_time())

    def drop_queued(self) -> None:
        """Take back a frame queued for a step that will not come (the loop ended)."""
        if self.queued is not None:
            self.queued.handle.cancel()
            self.queued = None

    async def step(self) -> Delta:
        """The next pass's delta: the prefill's first, then one decode or verify step;
        a lost pipeline is replaced and the step run again on the new one."""
        while True:
            try:
                if not self.run.state.tokens:  # nothing committed: the prefill (again)
                    self.rebuild = False
                    return await _prefill(self.pipeline, self.run, self.run.chunk_tokens)
                if self.rebuild:
                    await replay_history(self.pipeline, self.run)
                    self.rebuild = False
                if self.window is None and self.speculation is not None:
                    self._speculate(self.speculation)
                if self.queued is not None:  # a plain decode step, in line already
                    queued, self.queued = self.queued, None
                    _, delta = await _pass(self.pipeline, self.run, queued.frame, queued)
                    self.run.spec.record(0, 0, trio.current_time() - queued.since)
                    if delta is None:
                        raise RuntimeError("a decode pass returned no token")
                    return delta
                return await _decode_step(
                    self.pipeline, self.run, self.proposer, self.speculation, self.window
                )
            except StageLostError as exc:
                await self._replace(exc)

    def _speculate(self, speculation: Speculation) -> None:
        context = self.pipeline.context_size
        self.proposer = speculation.make_proposer(self.run.params.sampling, context)
        if self.proposer is not None:
            self.run.strategy = speculation.strategy
        self.window = Window(speculation.window, speculation.costs)

    async def _replace(self, lost: StageLostError) -> None:
        """Go on with the pipeline that replaces the lost one, or raise (replay module)."""
        self.pipeline = await next_pipeline(self.run, lost, self.pipeline, self.replacement)
        self.queue = _queue_of(self.pipeline)
        self.rebuild = True


def _seeded(params: GenerationParams) -> GenerationParams:
    """``params`` with a seed: one chosen here, once, when the request gave none, so the
    last stage's counter-based draws are the same wherever (and however often) the
    request runs."""
    if params.sampling.seed is not None:
        return params
    sampling = dataclasses.replace(params.sampling, seed=random_seed())
    return dataclasses.replace(params, sampling=sampling)


async def _pass(
    pipeline: Pipeline, run: GenerationRun, frame: StepFrame, queued: _Ahead | None = None
) -> tuple[StepResult, Delta | None]:
    """Run one frame (``queued``: already in line since then); commit its tokens if it
    returns any."""
    began = trio.current_time() if queued is None else queued.since
    try:
        result = await (pipeline.run(frame) if queued is None else queued.handle.result())
    except RollbackError:
        await refold(pipeline, run, frame.start_pos)
        result = await pipeline.run(frame)  # a second failure is a real one
    elapsed = trio.current_time() - began
    run.timings.passes += 1
    run.timings.pass_s += elapsed
    run.timings.compute_s += result.compute_s
    if run.on_pass is not None:
        run.on_pass(elapsed, result)
    if not result.tokens:
        return result, None
    delta = run.state.commit(result.tokens, result.logprobs)
    run.offered = (len(run.history), result.drafts)
    if run.timings.first_token is None:
        run.timings.first_token = trio.current_time()
    return result, delta


async def _prefill(pipeline: Pipeline, run: GenerationRun, chunk_tokens: int) -> Delta:
    # from the stages' cached prefix where they hold one (generation.prefix, issue 30)
    return await prefill_prompt(pipeline, run, chunk_tokens, _pass, frame_of)


async def _decode_step(
    pipeline: Pipeline,
    run: GenerationRun,
    proposer: Proposer | None,
    speculation: Speculation | None,
    window: Window | None,
) -> Delta:
    """One plain decode step, or one verify pass when the proposer offers drafts."""
    history = run.history
    last_pos = len(history) - 1  # the last committed token is not in the cache yet
    room = min(
        pipeline.context_size - last_pos - 1,  # positions left after `last`
        run.params.budget - len(run.state.tokens) - 1,  # tokens left after one
    )
    drafts: tuple[int, ...] = ()
    draft_probs = None
    began = trio.current_time()  # a step's cost includes proposing
    if proposer is not None and window is not None and room > 0:
        limit = min(window.size, room)
        if isinstance(proposer, MtpProposer):  # drafts the last stage sent with the prediction
            proposer.offer(*run.offered)
        if speculation is not None and speculation.threaded:
            proposal = await trio.to_thread.run_sync(proposer.propose, history, limit)
        else:
            proposal = proposer.propose(history, limit)
        drafts, draft_probs = proposal.tokens[:limit], proposal.probs
    if drafts:
        if draft_probs is not None:
            draft_probs = draft_probs[: len(drafts)]
        frame = frame_of(run, FrameKind.VERIFY, last_pos, [history[-1], *drafts], probs=draft_probs)
    else:
        frame = frame_of(run, FrameKind.DECODE, last_pos, [history[-1]])
    result, delta = await _pass(pipeline, run, frame)
    if delta is None:
        raise RuntimeError(f"a {frame.kind} pass returned no token")
    accepted = min(result.accepted, len(drafts))
    seconds = trio.current_time() - began
    run.spec.record(len(drafts), accepted, seconds)
    if proposer is not None and window is not None:
        proposer.on_result(len(drafts), accepted, seconds=seconds)
        window.update(len(drafts), accepted, seconds)
    return delta


def _queue_of(pipeline: Pipeline) -> Callable[[StepFrame], QueuedPass] | None:
    """The pipeline's ``queue`` where it has one (a :class:`QueuingPipeline`)."""
    return pipeline.queue if isinstance(pipeline, QueuingPipeline) else None


@dataclass(frozen=True, slots=True)
class _Ahead:
    """A decode frame queued before its step (:meth:`_Driver.queue_next`)."""

    frame: StepFrame
    handle: QueuedPass
    since: float  # trio clock: when it was queued
