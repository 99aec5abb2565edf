"""The generation loop of one request: a pure state machine and an async driver.

:class:`GenerationState` decides, token by token, what the client sees: it commits
tokens, detokenizes them incrementally, holds back text that might be the start of a stop
string, and finishes on EOS (``stop``), a stop string (``stop``) or the token budget
(``length``). It does no I/O, so its rules are tested directly.

:func:`generate` drives it over a :class:`~meshnode.node.pipeline.Pipeline`, as a ladder:
prefill the prompt in chunks, then either decode one token or, when a proposer offers
drafts, verify ``[last, d1 … dk]`` in one pass and commit what was accepted. Each pass
yields a :class:`Delta` for the client; a plain decode's next frame is queued first (on a
``QueuingPipeline``), so the next batched step never waits for one client's I/O, which
overlaps the forward instead. Leaving the loop for any reason (finish, error, client gone,
cancellation) drops a queued frame and releases the sequence on every stage.

A hybrid stage rolls its recurrent state back only as far as its snapshot ring reaches
(:mod:`meshnode.engine.recurrent`); a frame that starts further back fails there with
``RollbackError``, and the loop folds the history before it into every stage again from
position 0 (non-final prefill chunks) and sends the frame once more.

**Replay.** When a stage of the pipeline is lost (``StageLostError``: a dropped connection,
dead heartbeats, a missed pass deadline; :mod:`meshnode.node.remote`), nothing the client
saw is lost: the loop holds every committed token. It waits (at most ``REPLAY_WAIT_S``) for
the pipeline the coordinator brings up next, prefills the prompt on it again (its final
chunk tells the last stage where the prompt ends, for penalties and the grammar, whose
state then follows the committed tokens), then the committed tokens but the last as
non-final chunks, and goes on with the next step as if nothing happened: the cache holds
``history[:-1]`` exactly as it did. The step that was lost had committed nothing; the
proposer and the window keep their state (both follow the committed history). Greedy
output is the undisturbed run's, and seeded sampling too: the last stage draws the token
at position ``p`` from a counter-based generator keyed on (seed, ``p``), and the seed is
fixed here once per request. After ``MAX_REPLAYS`` replays, or when no pipeline comes in
time, the error ends the stream as before.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from meshnode.engine.recurrent import RollbackError
from meshnode.engine.sampling import random_seed
from meshnode.node.pipeline import (
    FrameKind,
    Pipeline,
    QueuedPass,
    QueuingPipeline,
    RequestId,
    StageLostError,
    StepFrame,
    StepResult,
    TokenLogprob,
)
from meshnode.serve.prefix import prefill_prompt
from meshnode.serve.stops import find_stop, first_stop, held_back
from meshnode.speculative.mtp import MtpProposer
from meshnode.speculative.telemetry import SpecStats
from meshnode.speculative.window import StepCosts, Window, WindowPolicy

if TYPE_CHECKING:
    from meshnode.engine.sampling import SamplingParams
    from meshnode.speculative.proposer import Proposer

#: Prompt tokens per prefill frame. Small enough that a long prompt yields the pipeline
#: to other sequences every few hundred milliseconds on a CPU and that a chunk's
#: activations (256 x hidden x 2 bytes, ~2 MiB at hidden 4096) stay far below the wire
#: protocol's frame limit; large enough that per-frame overhead stays negligible.
DEFAULT_PREFILL_CHUNK_TOKENS = 256
#: Longest wait of a request for the pipeline after a lost one. The coordinator replans in
#: ~4 s on loopback (issue 16); stages that must load their new layer ranges from disk take
#: longer, a large model on a CPU box up to a minute or two. A client waits no longer than
#: this for its next token.
REPLAY_WAIT_S = 120.0
#: Replays of one request. A mesh that keeps losing stages under a request ends it with
#: the error rather than holding the client forever; three covers a node that dies and a
#: second one that fails while the first is replaced.
MAX_REPLAYS = 3

log = logging.getLogger(__name__)


class FinishReason(enum.StrEnum):
    """Why a completion ended, as OpenAI names it."""

    STOP = "stop"
    LENGTH = "length"


class Detokenizer(Protocol):
    """Turns token ids into text incrementally, never splitting a UTF-8 character."""

    def push(self, token: int) -> str:
        """The text that ``token`` completes (possibly empty)."""
        ...

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes lossily)."""
        ...


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What one request asks of the generation loop (after validation and clamping)."""

    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None
    # The grammar the reply must follow (llguidance's serialized form; None: free text),
    # enforced by the last stage (meshnode.serve.structured, meshnode.engine.constraint).
    grammar: str | None = None
    cache_prompt: bool = True  # resume from the stages' cached prefix (llama-server's field)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step adds to the reply: text, the tokens behind it, and maybe the end."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class GenerationState:
    """Committed tokens and emitted text of one completion (pure; see module docstring)."""

    params: GenerationParams
    detokenizer: Detokenizer
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    #: The stop string that ended the reply (None: EOS, the budget, or not finished).
    stop_string: str | None = None
    _pending: str = ""

    @property
    def finished(self) -> bool:
        """Whether the completion has ended (further commits are an error)."""
        return self.finish_reason is not None

    def commit(
        self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None
    ) -> Delta:
        """Commit the tokens of one step, in order, until one of them finishes the reply.

        Tokens after the finishing one are dropped (a verify pass can overshoot a stop
        string or the budget). Returns the text the client may see now.
        """
        if self.finished:
            raise RuntimeError("commit after the completion finished")
        text: list[str] = []
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            text.append(self._commit_one(token))
            if self.finished:
                break
        kept_logprobs = tuple(logprobs[: len(kept)]) if logprobs else ()
        return Delta("".join(text), tuple(kept), kept_logprobs, self.finish_reason)

    def _commit_one(self, token: int) -> str:
        self.tokens.append(token)
        if token in self.params.eos_token_ids:
            # EOS counts as a completion token (it was generated) but is never shown.
            return self._finish(FinishReason.STOP, self._pending + self.detokenizer.flush())
        self._pending += self.detokenizer.push(token)
        cut = find_stop(self._pending, self.params.stop)
        if cut is not None:
            self.stop_string = first_stop(self._pending, self.params.stop)
            return self._finish(FinishReason.STOP, self._pending[:cut])
        if len(self.tokens) >= self.params.max_new_tokens:
            return self._finish(FinishReason.LENGTH, self._pending + self.detokenizer.flush())
        keep = held_back(self._pending, self.params.stop)
        ready, self._pending = (
            self._pending[: len(self._pending) - keep],
            self._pending[len(self._pending) - keep :],
        )
        return ready

    def _finish(self, reason: FinishReason, text: str) -> str:
        self.finish_reason = reason
        self._pending = ""
        return text


def prefill_chunks(prompt: Sequence[int], chunk_tokens: int) -> list[tuple[int, list[int]]]:
    """``(start_pos, tokens)`` chunks covering the prompt, in order."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk_tokens}")
    return [
        (start, list(prompt[start : start + chunk_tokens]))
        for start in range(0, len(prompt), chunk_tokens)
    ]


# ---------------------------------------------------------------------------------------
# The async driver


#: Called after each pipeline pass with its wall seconds and its result (which carries the
#: compute seconds, in all and by stage).
PassObserver = Callable[[float, StepResult], None]


#: Waits for the pipeline that replaces ``lost`` (the coordinator's next one) and returns
#: it; the generation loop bounds the wait (``REPLAY_WAIT_S``).
PipelineSource = Callable[[Pipeline], Awaitable[Pipeline]]


#: Builds one request's proposer from its sampling parameters and the context size (which
#: bounds a draft model's KV cache); ``None`` means this request does not speculate.
ProposerFactory = Callable[["SamplingParams", int], "Proposer | None"]


@dataclass(frozen=True, slots=True)
class Speculation:
    """How a request speculates: a fresh proposer per request and a window policy.

    ``strategy`` names it in telemetry. ``threaded`` runs ``propose`` in a worker thread:
    a model-based proposer computes forward passes, which must not block the event loop
    (an n-gram lookup is cheaper than the thread hop). ``costs`` are the node's measured
    step costs, shared by its requests, from which adaptive windows are sized
    (:mod:`meshnode.speculative.window`).
    """

    make_proposer: ProposerFactory
    window: WindowPolicy = field(default_factory=WindowPolicy)
    strategy: str = "custom"
    threaded: bool = False
    costs: StepCosts = field(default_factory=StepCosts)

    @classmethod
    def of(
        cls,
        proposer: Proposer,
        window: WindowPolicy,
        *,
        strategy: str = "custom",
        costs: StepCosts | None = None,
    ) -> Speculation:
        """Speculation with this one ``proposer``: for a single request (tests, benchmarks)."""

        def make(params: SamplingParams, capacity: int) -> Proposer:
            return proposer

        return cls(make, window, strategy=strategy, costs=StepCosts() if costs is None else costs)


@dataclass(slots=True)
class GenerationTimings:
    """Wall-clock marks of one request, from the trio clock (seconds)."""

    started: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    compute_s: float = 0.0
    passes: int = 0
    pass_s: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        return None if self.first_token is None else self.first_token - self.started

    def tpot_s(self, completion_tokens: int) -> float | None:
        """Mean time per completion token after the first (``None`` if undefined)."""
        if self.first_token is None or self.finished is None or completion_tokens < 2:
            return None
        return (self.finished - self.first_token) / (completion_tokens - 1)


@dataclass(slots=True)
class GenerationRun:
    """The state of one request's driver, readable while it runs and after."""

    request_id: RequestId
    prompt: list[int]
    params: GenerationParams
    state: GenerationState
    spec: SpecStats = field(default_factory=SpecStats)
    timings: GenerationTimings = field(default_factory=GenerationTimings)
    on_pass: PassObserver | None = None
    strategy: str = "off"
    # MTP: drafts each frame asks of the last stage, and the latest ones it sent back with
    # the history length they follow (handed to the MtpProposer before it proposes).
    mtp_drafts: int = 0
    offered: tuple[int, tuple[int, ...]] = (0, ())
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    refolds: int = 0  # frames that started behind a snapshot ring: history prefilled again
    replays: int = 0  # pipelines lost under this request and replaced (module docstring)
    cached_tokens: int = 0  # prompt tokens resumed from the stages' prefix cache

    @property
    def history(self) -> list[int]:
        """Prompt followed by the committed tokens."""
        return self.prompt + self.state.tokens


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
        last = len(self.run.state.tokens) + 1 >= self.run.params.max_new_tokens
        if self.run.state.finished or last or self.rebuild or self.queued or not self.queue:
            return
        if self.window is None and self.speculation is not None:
            self._speculate(self.speculation)
        if self.proposer is not None:
            return
        frame = _frame(
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
                    await _replay_history(self.pipeline, self.run)
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
        """Go on with the pipeline that replaces the lost one, or raise ``lost``."""
        run = self.run
        if self.replacement is None or run.replays >= MAX_REPLAYS:
            raise lost
        run.replays += 1
        log.warning(
            "request %s: %s; replaying it (%d of %d) on the next pipeline",
            run.request_id,
            lost,
            run.replays,
            MAX_REPLAYS,
        )
        with trio.move_on_after(REPLAY_WAIT_S):
            self.pipeline = await self.replacement(self.pipeline)
            self.queue = _queue_of(self.pipeline)
            self.rebuild = True
            return
        raise StageLostError(f"{lost}; no pipeline came back within {REPLAY_WAIT_S:.0f} s")


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
        await _refold(pipeline, run, frame.start_pos)
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


async def _refold(pipeline: Pipeline, run: GenerationRun, end: int) -> None:
    """Prefill ``history[:end]`` again from position 0 on every stage, asking no token: a
    stage's recurrent state could not be rolled back to ``end`` from its snapshot ring."""
    run.refolds += 1
    for start, tokens in prefill_chunks(run.history[:end], run.chunk_tokens):
        await pipeline.run(_frame(run, FrameKind.PREFILL, start, tokens, final=False))


async def _replay_history(pipeline: Pipeline, run: GenerationRun) -> None:
    """Put the request back on a new pipeline: the prompt as at the start (its final chunk
    returns the first committed token again), then the committed tokens but the last as
    non-final chunks, so the cache holds ``history[:-1]`` as the next step expects."""
    chunks = prefill_chunks(run.prompt, run.chunk_tokens)
    first = None
    for i, (start, tokens) in enumerate(chunks):
        final = i == len(chunks) - 1
        result = await pipeline.run(_frame(run, FrameKind.PREFILL, start, tokens, final=final))
        first = result.tokens[0] if final and result.tokens else first
    if first != run.state.tokens[0]:
        log.warning(
            "request %s: the replayed prompt gives token %s, not %d as before",
            run.request_id,
            first,
            run.state.tokens[0],
        )
    generated = run.state.tokens[:-1]
    for start, tokens in prefill_chunks(generated, run.chunk_tokens):
        at = len(run.prompt) + start
        await pipeline.run(_frame(run, FrameKind.PREFILL, at, tokens, final=False))


async def _prefill(pipeline: Pipeline, run: GenerationRun, chunk_tokens: int) -> Delta:
    # Hook (issue 30): from the stages' cached prefix where they hold one (serve.prefix).
    return await prefill_prompt(pipeline, run, chunk_tokens, _pass, _frame)


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
        run.params.max_new_tokens - len(run.state.tokens) - 1,  # tokens left after one
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
        frame = _frame(run, FrameKind.VERIFY, last_pos, [history[-1], *drafts], probs=draft_probs)
    else:
        frame = _frame(run, FrameKind.DECODE, last_pos, [history[-1]])
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


def _frame(
    run: GenerationRun,
    kind: FrameKind,
    start_pos: int,
    tokens: Sequence[int],
    *,
    final: bool = True,
    probs: object = None,
) -> StepFrame:
    return StepFrame(
        request_id=run.request_id,
        kind=kind,
        start_pos=start_pos,
        tokens=tuple(tokens),
        sampling=run.params.sampling,
        final=final,
        draft_probs=probs,
        top_logprobs=run.params.top_logprobs,
        mtp_drafts=run.mtp_drafts,
        grammar=run.params.grammar,
        grammar_start=len(run.prompt),
    )
