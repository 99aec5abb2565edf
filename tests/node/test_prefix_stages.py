"""Per-stage start positions (issue 30): each stage of a pipeline resumes a prompt from what
it and the stages after it hold, and sends the next stage only the rows it needs.

The host's :class:`~meshnode.node.prefix.ResumePoint` puts each later stage's start and
key on the prompt's frames (``StepFrame.resume``); :func:`~meshnode.node.pipeline.onward`
cuts a frame for the next stage (or drops a non-final piece that ends before it). Here
three real :class:`StageRunner`\\ s of the tiny random Llama in a row in this process,
each keyed by its own salt, driven by the real generation loop: after the first two
stages lost their pools, the last one resumes the prompt alone, and the tokens are one
whole-model stage's. A stage that misses its prefix refuses the rest of the prompt's
pieces as misses too, so the host hears a miss and prefills from 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import trio

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.prefix_cache import PrefixMissError, chain_keys
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame, StepResult, onward
from meshnode.node.prefix import ResumePoint, host_pools, note_pass, note_release
from meshnode.node.prefix_keep import held_keys, kept_keys
from meshnode.node.stage import StageRunner
from meshnode.node.wire import WireSequences, frame_from_wire, frame_to_wire, sampling_to_wire
from tests.node.test_prefix import SilentDetokenizer
from tests.speculative.tinymodel import TinySource, tiny_config

CONTEXT = 160
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(5 * i + 2) % 45 + 3 for i in range(3 * B + 5)]
SALTS = ["0" * 32, "1" * 32, "2" * 32]
TOKENS = 8


@pytest.fixture(scope="module")
def source() -> TinySource:
    return TinySource(tiny_config(48, 3), seed=3, logit_scale=8.0)


def _runner(source: TinySource, start: int, end: int, salt: str) -> StageRunner:
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, start, end, embed=start == 0, head=end == config.num_layers)
    return StageRunner(stage, context_size=CONTEXT, prefix_salt=salt)


def _single(source: TinySource) -> list[int]:
    """The whole model's greedy tokens after ``PROMPT``, on one stage, no cache."""
    runner = _runner(source, 0, 3, "")
    cache = runner.stage.new_cache(CONTEXT)
    logits = runner.stage.forward(np.asarray(PROMPT), 0, cache, out_rows=1)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < TOKENS:
        logits = runner.stage.forward(np.asarray(tokens[-1:]), cache.length, cache, out_rows=1)
        tokens.append(int(np.argmax(logits[-1])))
    return tokens


class Chain:
    """Stages in a row in this process, each frame cut for the next stage as a worker's
    relay cuts it (through the wire records), with the host's index of their pools."""

    def __init__(self, runners: list[StageRunner], held: Sequence[bytes] = ()) -> None:
        self.runners = runners
        blocks = [r.prefix.block for r in runners[1:]]
        self.prefix, self.kv_blocks = host_pools(runners[0], blocks, SALTS, held)
        self.sent: list[list[tuple[int, int]]] = [[] for _ in runners]  # (start, rows)
        self._wire = [WireSequences(8) for _ in runners]
        self._lock = trio.Lock()

    @property
    def context_size(self) -> int:
        return CONTEXT

    async def run(self, frame: StepFrame) -> StepResult:
        async with self._lock:
            result = self._through(frame)
        note_pass(self.prefix, frame)
        return result

    def _through(self, frame: StepFrame) -> StepResult:
        hidden: Any = None
        for i, runner in enumerate(self.runners):
            if i:
                message = frame_to_wire(frame, hidden, run_id="r", term=1, wire_dtype="f32")
                frame = frame_from_wire(message, self._wire[i])
            self.sent[i].append((frame.start_pos, len(frame.tokens)))
            if runner.last:
                return runner.result(frame)
            step = onward(frame, runner.activations(frame))
            if step is None:  # the next stage resumes past this piece
                assert not frame.final
                return StepResult(request_id=frame.request_id)
            frame, hidden = step
        raise AssertionError("no last stage")

    async def release(self, request_id: RequestId) -> None:
        async with self._lock:
            for runner in self.runners:
                runner.release(request_id)
        note_release(self.prefix, request_id)


async def _tokens(chain: Chain, request: str, chunk: int) -> tuple[list[int], GenerationRun]:
    params = GenerationParams(max_new_tokens=TOKENS, sampling=GREEDY)
    run = GenerationRun(
        RequestId(request), list(PROMPT), params, GenerationState(params, SilentDetokenizer())
    )
    out: list[int] = []
    async for delta in generate(chain, run, chunk_tokens=chunk):
        out += delta.tokens
    return out, run


def _hits(runner: StageRunner) -> int:
    return runner.kv_usage()["prefix_hit_tokens"]


@pytest.mark.parametrize("chunk", [256, 20], ids=["one-piece", "pieces"])
async def test_the_last_stage_resumes_alone_after_the_others_lost_their_pools(
    source: TinySource, chunk: int
) -> None:
    single = _single(source)
    cuts = [(0, 1), (1, 2), (2, 3)]
    first = Chain([_runner(source, a, b, s) for (a, b), s in zip(cuts, SALTS, strict=True)])
    assert (await _tokens(first, "calm", chunk))[0] == single
    last = first.runners[2]
    # The first two stages start afresh (a hung stage 0, a spare); the last kept its pool.
    fresh = [_runner(source, a, b, s) for (a, b), s in zip(cuts[:2], SALTS, strict=False)]
    held = kept_keys(fresh[0].prefix, [held_keys(fresh[1].prefix), held_keys(last.prefix)])
    second = Chain([*fresh, last], held)
    before = _hits(last)
    tokens, run = await _tokens(second, "stormy", chunk)
    assert tokens == single
    assert run.cached_tokens == 0  # stage 0 computed the whole prompt
    assert _hits(last) - before == 3 * B  # the last stage only the rows from 3 blocks on
    assert [_hits(r) for r in fresh] == [0, 0]

    def prompt_rows(stage: int) -> list[tuple[int, int]]:
        return [(at, rows) for at, rows in second.sent[stage] if at < len(PROMPT)]

    assert prompt_rows(2)[0][0] == 3 * B  # the last stage got only its suffix
    assert sum(rows for _, rows in prompt_rows(2)) == len(PROMPT) - 3 * B
    assert sum(rows for _, rows in prompt_rows(1)) == len(PROMPT)  # the middle one, all


async def test_a_stage_that_misses_refuses_the_rest_of_the_prompt(source: TinySource) -> None:
    """The host believes the last stage holds the prompt, but its pool is new: the last
    stage refuses its first piece and every later one as misses (not as an unknown
    sequence), and the loop prefills from 0 on every stage, with the same tokens."""
    single = _single(source)
    cuts = [(0, 1), (1, 2), (2, 3)]
    runners = [_runner(source, a, b, s) for (a, b), s in zip(cuts, SALTS, strict=True)]
    wrong = chain_keys(SALTS[2], PROMPT)  # believed, never held
    chain = Chain(runners, wrong)
    assert chain.prefix is not None
    point = chain.prefix.resume_point(RequestId("probe"), PROMPT)
    assert point.starts == (0, 0, 3 * B)
    chain.prefix.released(RequestId("probe"))
    piece = StepFrame(RequestId("m"), FrameKind.PREFILL, 0, tuple(PROMPT[:100]), GREEDY)
    miss = point.frame(dataclasses.replace(piece, final=False))
    with pytest.raises(PrefixMissError):
        chain._through(miss)
    later = StepFrame(
        RequestId("m"), FrameKind.PREFILL, 100, tuple(PROMPT[100:]), GREEDY, hidden=None
    )
    with pytest.raises(PrefixMissError):  # a later piece of the same request: a miss too
        runners[2].admit(dataclasses.replace(later, hidden=np.zeros((len(later.tokens), 32))))
    await chain.release(RequestId("m"))
    tokens, run = await _tokens(chain, "after", 20)
    assert tokens == single
    assert run.cached_tokens == 0


def test_a_frame_is_cut_for_the_next_stage() -> None:
    key = bytes(range(16))
    frame = StepFrame(
        RequestId("r"), FrameKind.PREFILL, 10, tuple(range(10, 20)), GREEDY, final=False,
        resume=((10, None), (14, key)),
    )  # fmt: skip
    hidden = np.arange(10.0)[:, None]
    step = onward(frame, hidden)
    assert step is not None
    same, rows = step
    assert (same.start_pos, same.tokens, same.prefix_key) == (10, frame.tokens, None)
    assert same.resume == ((14, key),)
    assert rows is hidden or np.array_equal(rows, hidden)
    step = onward(same, rows)
    assert step is not None
    cut, rows = step
    assert (cut.start_pos, cut.tokens, cut.prefix_key, cut.resume) == (
        14,
        tuple(range(14, 20)),
        key,
        (),
    )
    assert np.array_equal(rows[:, 0], np.arange(4.0, 10.0))
    ahead = dataclasses.replace(frame, resume=((20, key),))  # the next stage starts after it
    assert onward(ahead, hidden) is None
    plain = dataclasses.replace(frame, resume=())
    assert onward(plain, hidden) == (plain, hidden)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"resume": ((9, None),)}, "in order"),  # before the frame
        ({"resume": ((12, None), (11, None))}, "in order"),
        ({"resume": ((12, b"short"),)}, "16-byte"),
        ({"start_pos": 0, "resume": ((0, bytes(16)),)}, "16-byte"),
        ({"final": True, "resume": ((20, None),)}, "reaches every stage"),
        ({"kind": FrameKind.DECODE, "tokens": (1,), "final": True, "resume": ((10, None),)},
         "prefill"),
    ],
)  # fmt: skip
def test_a_frame_says_where_later_stages_start_only_in_order(
    changes: dict[str, Any], reason: str
) -> None:
    frame = StepFrame(RequestId("r"), FrameKind.PREFILL, 10, tuple(range(10)), GREEDY, final=False)
    with pytest.raises(ValueError, match=reason):
        dataclasses.replace(frame, **changes)


def test_the_host_puts_each_stage_s_start_on_the_prompt_s_pieces() -> None:
    k1, k2 = bytes(16), bytes(range(16))
    point = ResumePoint((0, B, 3 * B), (None, k1, k2))

    def piece(at: int, n: int) -> StepFrame:
        frame = StepFrame(RequestId("r"), FrameKind.PREFILL, at, (1,) * n, GREEDY, final=False)
        return point.frame(frame)

    assert piece(0, 20).resume == ((B, k1), (3 * B, k2))
    assert piece(0, 20).prefix_key is None
    assert piece(B + 8, 20).resume == ((B + 8, None), (3 * B, k2))  # stage 1 continues it
    assert piece(3 * B, 5).resume == ((3 * B, None), (3 * B, k2))
    assert piece(3 * B + 5, 5).resume == ()  # every stage holds the sequence by now
    same = ResumePoint((2 * B, 2 * B), (k1, k2))
    first = same.frame(StepFrame(RequestId("r"), FrameKind.PREFILL, 2 * B, (1,), GREEDY))
    assert (first.prefix_key, first.resume) == (k1, ((2 * B, k2),))
    alone = ResumePoint((2 * B,), (k1,))  # one salt for every stage (an older host)
    first = alone.frame(StepFrame(RequestId("r"), FrameKind.PREFILL, 2 * B, (1,), GREEDY))
    assert (first.prefix_key, first.resume) == (k1, ())


def test_the_grammar_reaches_a_stage_whose_first_frame_is_cut_from_a_later_piece() -> None:
    """Stage 1 continues the request at 16 (not its first frame) and cuts the last stage's
    first frame from it at 20: the grammar the last stage keeps must travel with it."""
    key = bytes(range(16))
    piece = StepFrame(
        RequestId("r"), FrameKind.PREFILL, 16, tuple(range(8)), GREEDY, final=True,
        grammar="g", grammar_start=24, resume=((20, key),),
    )  # fmt: skip
    hidden = np.zeros((8, 4), dtype=np.float32)
    to_stage1 = frame_to_wire(piece, hidden, run_id="r", term=1, wire_dtype="f32")
    assert (to_stage1.grammar, to_stage1.grammar_start) == ("g", 24)
    known = WireSequences(1)  # stage 1 holds the request: it saw its sampling before
    known.sampling_of(dataclasses.replace(to_stage1, sampling=sampling_to_wire(GREEDY)))
    at_stage1 = frame_from_wire(to_stage1, known)
    step = onward(at_stage1, hidden)
    assert step is not None
    to_last = frame_to_wire(*step, run_id="r", term=1, wire_dtype="f32")
    assert (to_last.start_pos, to_last.prefix_key, to_last.grammar) == (20, key.hex(), "g")
    plain = frame_to_wire(
        dataclasses.replace(piece, resume=()), hidden, run_id="r", term=1, wire_dtype="f32"
    )
    assert plain.grammar is None  # a continuation alone: the grammar travelled already
