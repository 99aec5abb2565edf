"""Continuous batching over a local pipeline: concurrent requests share each forward and
every stream's tokens are exactly those it gets alone.

The model is real (a tiny random Llama, in memory, with a wide logit spread so that a
batched product's float32 rounding never decides a greedy tie); the runner is the real
:class:`StageRunner`, which the tests subclass only to record what each step carried.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from contextlib import aclosing

import pytest
import trio

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.batcher import BatchLimits, next_decode, plan_batch
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import FrameKind, PipelineError, RequestId, StepFrame, StepResult
from meshnode.node.stage import StageError, StageRunner
from meshnode.serve.scheduler import Scheduler
from meshnode.speculative.ngram import NgramProposer
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.window import WindowPolicy
from tests.speculative.tinymodel import TinySource, tiny_config

CONTEXT = 160
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    [5, 9, 11, 5, 9, 11, 5, 9, 3, 7],
    [4, 4, 8],
    [12, 30, 7, 22, 19, 3, 40, 41, 2, 6, 17],
    [33],
    [6, 7, 8, 6, 7, 8, 6],
    [20, 21],
]


class SilentDetokenizer:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class RecordingRunner(StageRunner):
    """The real runner, remembering the frames of every batched forward."""

    def __init__(self, stage: Stage) -> None:
        super().__init__(stage, context_size=CONTEXT, max_sequences=8)
        self.steps: list[list[StepFrame]] = []
        self.refused: list[StepFrame] = []  # frames a step brought that did not fit
        self.released: dict[RequestId, int] = {}

    def results_batch(self, frames: Sequence[StepFrame]) -> list[StepResult]:
        self.steps.append(list(frames))
        return super().results_batch(frames)

    def release(self, request_id: RequestId) -> bool:
        self.released[request_id] = len(self.steps)  # steps run before the release
        return super().release(request_id)

    def admit(self, frame: StepFrame) -> None:
        try:
            super().admit(frame)
        except StageError:
            self.refused.append(frame)
            raise


@pytest.fixture(scope="module")
def stage() -> Stage:
    source = TinySource(tiny_config(48, 3), seed=0, logit_scale=8.0)
    config = ModelConfig.from_hf(source.config)
    return Stage(config, source, 0, config.num_layers, embed=True, head=True)


def _run(request: str, prompt: list[int], tokens: int, sampling: SamplingParams) -> GenerationRun:
    params = GenerationParams(max_new_tokens=tokens, sampling=sampling)
    state = GenerationState(params, SilentDetokenizer())
    return GenerationRun(RequestId(request), list(prompt), params, state)


async def _drive(
    pipeline: LocalPipeline,
    run: GenerationRun,
    *,
    speculation: Speculation | None = None,
    chunk_tokens: int = 256,
    started: trio.Event | None = None,
) -> list[int]:
    async for _ in generate(pipeline, run, speculation=speculation, chunk_tokens=chunk_tokens):
        if started is not None:
            started.set()
    return run.state.tokens


async def _solo(
    stage: Stage, prompt: list[int], tokens: int, sampling: SamplingParams
) -> list[int]:
    pipeline = LocalPipeline(StageRunner(stage, context_size=CONTEXT))
    return await _drive(pipeline, _run("solo", prompt, tokens, sampling))


async def _together(
    pipeline: LocalPipeline, runs: list[GenerationRun], speculation: Speculation | None = None
) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in runs]

    async def one(i: int) -> None:
        outputs[i] = await _drive(pipeline, runs[i], speculation=speculation)

    async with trio.open_nursery() as nursery:
        for i in range(len(runs)):
            nursery.start_soon(one, i)
    return outputs


@pytest.mark.parametrize(
    "sampling",
    [
        GREEDY,
        SamplingParams(temperature=0.9, top_k=20, seed=1234),
        SamplingParams(temperature=1.0, seed=99),  # whole vocabulary: the unmasked race
    ],
    ids=["greedy", "seeded", "seeded-untruncated"],
)
async def test_concurrent_streams_equal_their_solo_runs(
    stage: Stage, sampling: SamplingParams
) -> None:
    solo = [await _solo(stage, p, 24, sampling) for p in PROMPTS]
    runner = RecordingRunner(stage)
    pipeline = LocalPipeline(runner)
    runs = [_run(f"r{i}", p, 24, sampling) for i, p in enumerate(PROMPTS)]
    assert await _together(pipeline, runs) == solo
    # They shared forwards: every decode step carried all six sequences.
    decode_steps = [s for s in runner.steps if all(f.kind is FrameKind.DECODE for f in s)]
    assert decode_steps
    assert max(len(s) for s in decode_steps) == len(PROMPTS)
    assert len(runner.steps) < sum(r.timings.passes for r in runs) / 4
    assert runner.live_sequences == 0


async def test_streams_that_start_together_prefill_together(stage: Stage) -> None:
    """A burst of requests (here through the scheduler's admission, as the API admits
    them) is gathered into one first step: every prompt prefills in it, rather than the
    first alone and the others a whole step later."""
    runner = RecordingRunner(stage)
    pipeline = LocalPipeline(runner)
    scheduler = Scheduler()
    runs = [_run(f"r{i}", p, 4, GREEDY) for i, p in enumerate(PROMPTS)]

    async def one(run: GenerationRun) -> None:
        async with scheduler.admit():
            await _drive(pipeline, run)

    async with trio.open_nursery() as nursery:
        for run in runs:
            nursery.start_soon(one, run)
    first = runner.steps[0]
    assert {f.request_id for f in first} == {r.request_id for r in runs}
    assert all(f.kind is FrameKind.PREFILL and f.start_pos == 0 for f in first)


async def test_requests_join_and_leave_mid_batch(stage: Stage) -> None:
    """Short and long requests, some starting while others decode: each leaves when it
    is done, the newcomers join the running batch, and all equal their solo runs."""
    lengths = [6, 30, 12, 30]
    solo = [await _solo(stage, p, n, GREEDY) for p, n in zip(PROMPTS[:4], lengths, strict=True)]
    runner = RecordingRunner(stage)
    pipeline = LocalPipeline(runner)
    outputs: list[list[int]] = [[] for _ in lengths]

    async def one(i: int, after: trio.Event | None, started: trio.Event) -> None:
        if after is not None:
            await after.wait()
        run = _run(f"r{i}", PROMPTS[i], lengths[i], GREEDY)
        outputs[i] = await _drive(pipeline, run, started=started)

    events = [trio.Event() for _ in lengths]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, 0, None, events[0])
        nursery.start_soon(one, 1, None, events[1])
        nursery.start_soon(one, 2, events[1], events[2])  # joins once r1 decodes
        nursery.start_soon(one, 3, events[2], events[3])
    assert outputs == solo
    sizes = [len(s) for s in runner.steps]
    assert max(sizes) >= 3  # the newcomers decoded next to r1 (and r0 or r2)
    # r0 left after 6 tokens while r1 went on: later steps ran without it.
    last_r0 = max(i for i, s in enumerate(runner.steps) if any(f.request_id == "r0" for f in s))
    assert any(len(s) > 1 for s in runner.steps[last_r0 + 1 :])
    # r3 joined a running batch: its prefill shared a step with others' decode rows.
    joined = [s for s in runner.steps if any(f.request_id == "r3" and f.start_pos == 0 for f in s)]
    assert len(joined[0]) > 1


async def test_long_prefill_does_not_stall_decoders(stage: Stage) -> None:
    """A 96-token prompt read in 12 chunks of 8 (the step budget) while three requests
    decode: every step of its prefill also carries each decoder's row, so each decoder
    gains a token per chunk instead of waiting for the whole prompt."""
    chunk = 8
    long_prompt = [(7 * i) % 45 + 3 for i in range(96)]
    runner = RecordingRunner(stage)
    pipeline = LocalPipeline(runner, BatchLimits(max_frames=8, prefill_tokens=chunk))
    decoding = [trio.Event() for _ in range(3)]
    outputs: dict[str, list[int]] = {}

    async def decoder(i: int) -> None:
        run = _run(f"d{i}", PROMPTS[i], 40, GREEDY)
        outputs[f"d{i}"] = await _drive(pipeline, run, started=decoding[i])

    async def reader() -> None:
        for event in decoding:  # once all three decode
            await event.wait()
        run = _run("long", long_prompt, 4, GREEDY)
        outputs["long"] = await _drive(pipeline, run, chunk_tokens=chunk)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(decoder, i)
        nursery.start_soon(reader)
    prefill = [
        s
        for s in runner.steps
        if any(f.request_id == "long" and f.kind is FrameKind.PREFILL for f in s)
    ]
    assert len(prefill) == len(long_prompt) // chunk  # one chunk per step, never two
    for step in prefill:
        assert {str(f.request_id) for f in step} == {"d0", "d1", "d2", "long"}
        assert sum(len(f.tokens) for f in step if f.kind is FrameKind.PREFILL) == chunk
    assert outputs["long"] == await _solo(stage, long_prompt, 4, GREEDY)
    assert outputs["d0"] == await _solo(stage, PROMPTS[0], 40, GREEDY)


def _ngram(params: SamplingParams, capacity: int) -> Proposer:
    return NgramProposer()


async def test_batched_verify_windows_equal_plain_decoding(stage: Stage) -> None:
    """With n-gram speculation on, verify frames of several sequences share forwards
    (next to decode rows), and greedy output is still each request's solo plain output."""
    prompts = [PROMPTS[0], PROMPTS[4], [9, 10, 9, 10, 9, 10, 9], PROMPTS[2]]
    solo = [await _solo(stage, p, 30, GREEDY) for p in prompts]
    runner = RecordingRunner(stage)
    pipeline = LocalPipeline(runner)
    speculation = Speculation(_ngram, WindowPolicy("fixed", 3, 1, 3), strategy="ngram")
    runs = [_run(f"r{i}", p, 30, GREEDY) for i, p in enumerate(prompts)]
    assert await _together(pipeline, runs, speculation) == solo
    mixed = [s for s in runner.steps if sum(f.kind is FrameKind.VERIFY for f in s) >= 2]
    assert mixed, "no step carried two verify windows"
    assert sum(r.spec.accepted for r in runs) > 0


@pytest.mark.parametrize("ahead", [False, True], ids=["stepwise", "ahead"])
async def test_a_stream_that_ends_while_others_decode_is_released_at_once(
    stage: Stage, ahead: bool
) -> None:
    """A short request ending while long ones go on decoding is released right after its
    last step (the stage's next turn is its release, before another step): its stream
    ends and its slot frees then, not when the task that leads the steps finishes.
    Running ahead, the steps that the compute thread began before the release was asked
    for come first (a few of this tiny model's sub-millisecond steps, one of them maybe
    carrying the short request's row that nobody claims)."""
    solo = await _solo(stage, PROMPTS[0], 40, GREEDY)
    runner = RecordingRunner(stage)
    pipeline = LocalPipeline(runner, BatchLimits(max_frames=8, ahead=ahead))
    short = _run("short", PROMPTS[1], 3, GREEDY)
    longs = [_run(f"long{i}", p, 40, GREEDY) for i, p in enumerate(PROMPTS[0:5:2])]
    async with trio.open_nursery() as nursery:
        for run in (*longs, short):
            nursery.start_soon(_drive, pipeline, run)
    carried = [
        i for i, step in enumerate(runner.steps) if any(f.request_id == "short" for f in step)
    ]
    released = runner.released[short.request_id]
    if ahead:
        assert carried[-1] + 1 <= released <= carried[-1] + 3
    else:
        assert released == carried[-1] + 1
    assert len(runner.steps) > released + 10  # the long streams went on after it
    assert longs[0].state.tokens == solo


async def test_the_next_decode_frame_is_in_line_before_the_client_sees_a_token(
    stage: Stage,
) -> None:
    """Each delta reaches the client with the sequence's next decode frame already queued
    at the batcher (the frame the loop would send next; running ahead, a step may be
    computing it already), so the next step does not wait for this client; but the
    budget's last frame, which the loop sends when the client is served (a frame in line
    promises the one after it); after the last token the sequence is gone."""
    pipeline = LocalPipeline(RecordingRunner(stage))
    run = _run("r0", PROMPTS[0], 6, GREEDY)
    seen = 0
    async with aclosing(generate(pipeline, run)) as deltas:
        async for _ in deltas:
            seen += 1
            queued = [f for f in pipeline.batcher.in_line() if f.request_id == "r0"]
            if len(run.state.tokens) >= 5:
                assert queued == []
                continue
            (frame,) = queued
            assert frame.kind is FrameKind.DECODE
            assert frame.start_pos == len(run.history) - 1
            assert frame.tokens == (run.history[-1],)
    assert seen == 6
    assert run.state.tokens == await _solo(stage, PROMPTS[0], 6, GREEDY)
    assert pipeline.runner.live_sequences == 0
    assert pipeline.batcher._pending == []


@pytest.mark.parametrize("pause", [0.0, 0.01], ids=["at-once", "after-a-step"])
async def test_a_client_that_stops_reading_takes_its_queued_frame_back(
    stage: Stage, pause: float
) -> None:
    """A client that leaves mid-stream, its generator closed with a frame in line (still
    waiting, or taken by the other stream's step during the pause), leaves no frame and
    no sequence behind: no later step brings its frame, and the stream beside it still
    equals its solo run."""
    solo = await _solo(stage, PROMPTS[2], 20, GREEDY)
    runner = RecordingRunner(stage)
    pipeline = LocalPipeline(runner)
    left = _run("left", PROMPTS[0], 20, GREEDY)
    stays = _run("stays", PROMPTS[2], 20, GREEDY)

    async def leaver() -> None:
        async with aclosing(generate(pipeline, left)) as deltas:
            async for _ in deltas:
                if len(left.state.tokens) == 3:
                    if pause:
                        await trio.sleep(pause)
                    break

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leaver)
        nursery.start_soon(_drive, pipeline, stays)
    assert stays.state.tokens == solo
    assert len(left.state.tokens) == 3
    assert runner.refused == []  # no step brought a frame of the released sequence
    assert runner.live_sequences == 0
    assert pipeline.batcher._pending == []


def _frame(request: str, kind: FrameKind, tokens: int) -> StepFrame:
    final = kind is not FrameKind.PREFILL
    return StepFrame(RequestId(request), kind, 0, tuple(range(1, tokens + 1)), GREEDY, final=final)


D, V, P = FrameKind.DECODE, FrameKind.VERIFY, FrameKind.PREFILL


@pytest.mark.parametrize(
    ("pending", "limits", "live", "chosen"),
    [
        # decode and verify rows all go; prefill chunks share the token budget in order
        (
            [("a", D, 1), ("b", P, 8), ("c", V, 4), ("d", P, 8)],
            BatchLimits(prefill_tokens=8),
            4,
            [0, 1, 2],
        ),
        # the oldest prefill chunk always goes, even over the budget
        ([("b", P, 20), ("a", D, 1)], BatchLimits(prefill_tokens=8), 2, [0, 1]),
        # a later chunk that fits the rest of the budget still goes
        ([("b", P, 6), ("c", P, 4), ("d", P, 2)], BatchLimits(prefill_tokens=8), 3, [0, 2]),
        # one frame per sequence and step
        ([("a", P, 2), ("a", P, 2), ("b", D, 1)], BatchLimits(), 2, [0, 2]),
        # batching off: one frame per step, oldest first
        ([("b", P, 8), ("a", D, 1)], BatchLimits(enabled=False), 2, [0]),
        # three stages: about a third of the live sequences per micro-batch
        ([(f"s{i}", D, 1) for i in range(8)], BatchLimits(micro_batches=3), 8, [0, 1, 2]),
        ([("a", D, 1)], BatchLimits(micro_batches=3), 1, [0]),
        ([(f"s{i}", D, 1) for i in range(10)], BatchLimits(max_frames=4), 10, [0, 1, 2, 3]),
    ],
)
def test_plan_batch(
    pending: list[tuple[str, FrameKind, int]], limits: BatchLimits, live: int, chosen: list[int]
) -> None:
    frames = [_frame(*p) for p in pending]
    assert plan_batch(frames, limits, live) == chosen


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, SamplingParams(temperature=0.9, top_k=20, seed=77)],
    ids=["greedy", "seeded"],
)
async def test_decode_steps_run_ahead_and_streams_still_equal_their_solo_runs(
    stage: Stage, sampling: SamplingParams
) -> None:
    """Running ahead, the compute thread predicts each sequence's next decode frame and
    the loops claim them (their outputs computed before they asked); each stream's tokens
    are still its solo run's, as with steps handed back one by one, and no prediction is
    left behind once every sequence is released."""
    lengths = [24, 17, 24, 9]
    prompts = PROMPTS[: len(lengths)]
    solo = [await _solo(stage, p, n, sampling) for p, n in zip(prompts, lengths, strict=True)]
    for ahead in (True, False):
        pipeline = LocalPipeline(RecordingRunner(stage), BatchLimits(max_frames=8, ahead=ahead))
        pairs = enumerate(zip(prompts, lengths, strict=True))
        runs = [_run(f"r{i}", p, n, sampling) for i, (p, n) in pairs]
        assert await _together(pipeline, runs) == solo
        batcher = pipeline.batcher
        if ahead:
            assert batcher.claims > sum(lengths) / 2  # most decode frames were predicted
        else:
            assert batcher.claims == 0
        assert batcher._predicted == {}
        assert batcher._claimed == {}
        assert batcher.in_line() == []
        assert pipeline.runner.live_sequences == 0


#: Bound on waiting for the fast streams while the slow one is away (they take a fraction
#: of a second alone; a busy machine slows them many times over).
STREAM_TIMEOUT_S = 120.0


@pytest.mark.parametrize("ahead", [False, True], ids=["stepwise", "ahead"])
async def test_a_slow_client_next_to_fast_ones_misses_nothing(stage: Stage, ahead: bool) -> None:
    """A stream whose client takes its tokens slowly (its loop comes back long after each
    step) next to streams that decode at once: the slow loop claims the predictions made
    for it late, or sends its frames in line again; every stream equals its solo run and
    the fast ones are not held to the slow one's pace."""
    solo = [await _solo(stage, p, 20, GREEDY) for p in PROMPTS[:3]]
    runner = RecordingRunner(stage)
    pipeline = LocalPipeline(runner, BatchLimits(max_frames=8, ahead=ahead))
    runs = [_run(f"r{i}", p, 20, GREEDY) for i, p in enumerate(PROMPTS[:3])]
    outputs: list[list[int]] = [[] for _ in runs]
    fast_done = trio.Event()

    async def slow() -> None:
        async for _ in generate(pipeline, runs[0]):
            # Away after its first token until both fast streams have finished: were they
            # held to this loop's pace, they could not finish and the wait would time out.
            # (An event, not a sleep: under load a step can take longer than any sleep.)
            with trio.fail_after(STREAM_TIMEOUT_S):
                await fast_done.wait()
        outputs[0] = runs[0].state.tokens

    async def fast(i: int) -> None:
        outputs[i] = await _drive(pipeline, runs[i])
        if all(outputs[1:]):
            fast_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow)
        for i in (1, 2):
            nursery.start_soon(fast, i)
    assert outputs == solo
    # the fast streams finished in fewer steps than the slow one took
    last_fast = max(i for i, s in enumerate(runner.steps) if any(f.request_id == "r1" for f in s))
    assert last_fast < len(runner.steps) - 3
    assert pipeline.batcher._predicted == {}
    assert runner.live_sequences == 0


class FailingRunner(RecordingRunner):
    """Raises an unexpected error in its ``fail_at``-th step and every one after it (a bug
    that stays, not a frame's fault).

    It keeps failing because a step run ahead whose predictions no loop had claimed yet is
    dropped and its frames run again (``Batcher._line_up``): on a busy machine the loops
    are late, so a failure in that one step alone may reach no stream at all. A bug that
    stays reaches every stream, whatever the timing."""

    def __init__(self, stage: Stage, fail_at: int) -> None:
        super().__init__(stage)
        self.fail_at = fail_at

    def results_batch(self, frames: Sequence[StepFrame]) -> list[StepResult]:
        if len(self.steps) >= self.fail_at:
            self.steps.append(list(frames))
            raise RuntimeError("boom")
        return super().results_batch(frames)


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "stepwise"])
async def test_a_step_that_fails_fails_its_streams_and_hangs_nothing(
    stage: Stage, ahead: bool
) -> None:
    """Steps that raise (here from the sixth on, running ahead or not) fail every stream
    they carry with a PipelineError, nobody waits forever, and every sequence is released."""
    runner = FailingRunner(stage, fail_at=5)
    pipeline = LocalPipeline(runner, BatchLimits(max_frames=8, ahead=ahead))
    runs = [_run(f"r{i}", p, 20, GREEDY) for i, p in enumerate(PROMPTS[:3])]
    errors: list[BaseException] = []

    async def one(run: GenerationRun) -> None:
        try:
            await _drive(pipeline, run)
        except (PipelineError, RuntimeError) as exc:
            errors.append(exc)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for run in runs:
                nursery.start_soon(one, run)
    assert len(errors) == len(runs)
    solo = await _solo(stage, PROMPTS[0], 20, GREEDY)
    # the prefill and 4 decodes at most (the failed step's outputs are lost); running
    # ahead, a loop that was late took fewer before the error reached it
    assert 1 <= len(runs[0].state.tokens) <= 5
    assert runs[0].state.tokens == solo[: len(runs[0].state.tokens)]
    if ahead:  # no leader task to raise it in: every stream gets the pipeline's error
        assert all(isinstance(e, PipelineError) and "boom" in str(e) for e in errors)
    assert runner.live_sequences == 0
    assert pipeline.batcher._predicted == {}


class SteadyRunner(RecordingRunner):
    """Each step takes at least 4 ms, as a real model's forward does (the tiny model's
    take microseconds, less than the event loop needs to hand a token to a client)."""

    def results_batch(self, frames: Sequence[StepFrame]) -> list[StepResult]:
        began = time.perf_counter()
        out = super().results_batch(frames)
        time.sleep(max(0.0, 0.004 - (time.perf_counter() - began)))
        return out


async def test_no_row_is_computed_past_a_streams_budget(stage: Stage) -> None:
    """Running ahead stops following a sequence at its budget's last frame (the loop
    sends that one unqueued, promising nothing after it): with steps as long as a real
    model's, every stream is carried at the positions its tokens need (the prefill's and
    one per decode), and ran ahead for the rest.

    On a busy machine two things the design allows can happen, and nothing more: a step
    run ahead whose predictions no loop had claimed yet is dropped and its frames run
    again (``Batcher._line_up``), so a position may be carried twice; and a loop that is
    late to claim its budget's last frame has that prediction followed once more
    (``Batcher._following``: a late loop misses no step), one row past the budget that
    nobody claims. Never two."""
    budgets = [5, 9, 12]
    runner = SteadyRunner(stage)
    pipeline = LocalPipeline(runner, BatchLimits(max_frames=8, ahead=True))
    pairs = enumerate(zip(PROMPTS[: len(budgets)], budgets, strict=True))
    runs = [_run(f"r{i}", p, n, GREEDY) for i, (p, n) in pairs]
    await _together(pipeline, runs)
    for run, budget in zip(runs, budgets, strict=True):
        frames = [f for s in runner.steps for f in s if f.request_id == run.request_id]
        assert len(run.state.tokens) == budget
        prompt = len(run.prompt)
        wanted = {0} | set(range(prompt, prompt + budget - 1))  # prefill, one per decode
        carried = {f.start_pos for f in frames}
        assert wanted <= carried <= wanted | {prompt + budget - 1}
    # most decode frames were computed ahead (not the first after a prefill, nor the
    # first after another stream's release, which the next step gathers as usual)
    assert pipeline.batcher.claims > (sum(budgets) - len(budgets)) / 2


def _decode(tokens: tuple[int, ...], kind: FrameKind = FrameKind.DECODE) -> StepFrame:
    return StepFrame(RequestId("s"), kind, 10, tokens, GREEDY)


def _result(tokens: tuple[int, ...]) -> StepResult:
    return StepResult(request_id=RequestId("s"), accepted=0, tokens=tokens)


def test_next_decode_is_the_frame_a_plain_decode_loop_sends_next() -> None:
    """The prediction of a decode frame is the decode of the token it returned at the
    next position; nothing follows a verify or prefill frame, a grammar's sequence, or
    the model's EOS (where a reply most likely ends)."""
    frame = _decode((7,))
    assert next_decode(frame, _result((9,))) == StepFrame(RequestId("s"), D, 11, (9,), GREEDY)
    assert next_decode(frame, _result((2,)), frozenset({2})) is None
    assert next_decode(_decode((7, 8), V), _result((8, 9))) is None
    prefill = StepFrame(RequestId("s"), P, 0, (1, 2, 3), GREEDY)
    assert next_decode(prefill, _result((9,))) is None
    grammar = dataclasses.replace(frame, grammar="g")
    assert next_decode(grammar, _result((9,))) is None


async def test_steps_run_ahead_only_when_the_limits_ask(stage: Stage) -> None:
    """By default no step runs ahead; ``BatchLimits(ahead=None)`` runs a lone
    sequence's decode steps ahead and hands several sequences' back step by step (the
    work of their loops would slow the forwards more than it saves between them on the
    kernels' cores); ``ahead=True`` runs them ahead too. Every stream equals its solo
    run either way."""
    default = LocalPipeline(SteadyRunner(stage))
    await _drive(default, _run("solo", PROMPTS[0], 8, GREEDY))
    assert default.batcher.claims == 0
    alone = LocalPipeline(SteadyRunner(stage), BatchLimits(ahead=None))
    await _drive(alone, _run("solo", PROMPTS[0], 8, GREEDY))
    assert alone.batcher.claims > 0
    solo = [await _solo(stage, p, 8, GREEDY) for p in PROMPTS[:3]]
    for ahead in (None, True):
        pipeline = LocalPipeline(SteadyRunner(stage), BatchLimits(max_frames=8, ahead=ahead))
        runs = [_run(f"r{i}", p, 8, GREEDY) for i, p in enumerate(PROMPTS[:3])]
        assert await _together(pipeline, runs) == solo
        assert (pipeline.batcher.claims > 0) == bool(ahead)
