"""Grammars at the last stage: per-row masks in verify windows, rollback, and a split mesh.

The model is the tiny random GGUF of tests/engine (byte-level vocabulary), so every token
choice is the grammar's doing: unconstrained, its greedy output is not JSON at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import pytest
import trio
from meshnode_packaging.refs import open_ref
from meshnode_packaging.sources import ModelSource

from meshnode.engine.config import ModelConfig
from meshnode.engine.constraint import Grammars
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.engine.tokenizer import Tokenizer
from meshnode.node.pipeline import FrameKind, Pipeline, RequestId, Slot, StepFrame, StepResult
from meshnode.node.stage import StageError, StageRunner, step_results
from meshnode.serve.structured import JSON_LAYOUT
from tests.engine.tiny import write_tiny_model
from tests.node.inmemory import CONTEXT, InMemoryMesh, add_worker, serve

GREEDY = SamplingParams(temperature=0.0)
PROMPT = (1, 5, 9, 14, 3)
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
    },
    "required": ["id", "tags"],
    "additionalProperties": False,
}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_LAYOUT)
#: Tokens a constrained reply is decoded to (the schema's JSON ends well within them).
STEPS = 30


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    return open_ref(write_tiny_model(tmp_path_factory.mktemp("tiny"), "Q8_0"))


def runner(source: ModelSource, *, grammars: bool = True) -> StageRunner:
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, 0, config.num_layers, embed=True, head=True)
    made = Grammars(lambda: source.tokenizer_json, config.vocab_size, config.eos_token_ids)
    return StageRunner(stage, context_size=CONTEXT, grammars=made if grammars else None)


def frame(kind: FrameKind, start: int, tokens: list[int], **extra: object) -> StepFrame:
    return StepFrame(RequestId("r"), kind, start, tuple(tokens), GREEDY, **extra)  # type: ignore[arg-type]


def first_frame() -> StepFrame:
    return frame(FrameKind.PREFILL, 0, list(PROMPT), grammar=GRAMMAR, grammar_start=len(PROMPT))


async def constrained_greedy(pipeline: Pipeline | StageRunner) -> list[int]:
    """``STEPS`` tokens (or fewer, up to EOS) decoded one per pass under ``GRAMMAR``."""

    async def run(f: StepFrame) -> tuple[int, ...]:
        if isinstance(pipeline, StageRunner):
            return pipeline.result(f).tokens
        return (await pipeline.run(f)).tokens

    tokens = list(await run(first_frame()))
    while len(tokens) < STEPS and tokens[-1] != 2:
        tokens += await run(frame(FrameKind.DECODE, len(PROMPT) + len(tokens) - 1, tokens[-1:]))
    return tokens


def text_of(source: ModelSource, tokens: list[int]) -> str:
    return Tokenizer(source.tokenizer_json).decode([t for t in tokens if t != 2])


async def test_constrained_greedy_output_is_valid_json(source: ModelSource) -> None:
    tokens = await constrained_greedy(runner(source))
    assert tokens[-1] == 2  # the grammar closed the object, then allowed only EOS
    jsonschema.validate(json.loads(text_of(source, tokens)), SCHEMA)


async def test_a_forbidden_draft_is_rejected_and_the_grammar_rolls_back(
    source: ModelSource,
) -> None:
    reference = await constrained_greedy(runner(source))
    stage = runner(source)
    first = stage.result(first_frame()).tokens
    assert list(first) == reference[:1]
    # Drafts: two right tokens, then one the grammar forbids (a second "{"), then more.
    brace = reference[0]
    drafts = [reference[1], reference[2], brace, reference[4]]
    verify = frame(FrameKind.VERIFY, len(PROMPT), [reference[0], *drafts])
    result = stage.result(verify)
    assert result.accepted == 2
    assert list(result.tokens) == reference[1:4]  # the row after the rejection is masked
    # The grammar stands after the committed tokens only: the rest decodes as without drafts.
    tokens = [*first, *result.tokens]
    while len(tokens) < len(reference):
        step = frame(FrameKind.DECODE, len(PROMPT) + len(tokens) - 1, tokens[-1:])
        tokens += stage.result(step).tokens
    assert tokens == reference
    # A window of exactly the constrained continuation is accepted whole.
    again = runner(source)
    again.result(first_frame())
    window = frame(FrameKind.VERIFY, len(PROMPT), reference[:6])
    assert list(again.result(window).tokens) == reference[1:7]


async def test_grammar_frames_fail_clearly_where_no_grammar_applies(source: ModelSource) -> None:
    with pytest.raises(StageError, match="cannot enforce grammars"):
        runner(source, grammars=False).result(first_frame())
    stage = runner(source)
    stage.result(first_frame())
    # A token the grammar never allowed (a peer's bug): refused, not silently decoded on.
    with pytest.raises(StageError, match="not allowed by the grammar"):
        stage.result(frame(FrameKind.DECODE, len(PROMPT), [ord("x")]))


def test_a_grammar_violation_in_a_fused_batch_fails_only_its_sequence(
    source: ModelSource,
) -> None:
    """Three sequences decode in one forward; one brings a token its grammar forbids (a
    peer's bug). Only its frame fails; the others get the tokens they get alone."""

    def prefill(name: str, constrained: bool) -> StepFrame:
        extra = {"grammar": GRAMMAR, "grammar_start": len(PROMPT)} if constrained else {}
        return StepFrame(RequestId(name), FrameKind.PREFILL, 0, PROMPT, GREEDY, **extra)  # type: ignore[arg-type]

    def decode(name: str, token: int) -> StepFrame:
        return StepFrame(RequestId(name), FrameKind.DECODE, len(PROMPT), (token,), GREEDY)

    def step(stage: StageRunner, frames: list[StepFrame]) -> list[Slot[StepResult]]:
        slots: list[Slot[StepResult]] = [Slot(frame) for frame in frames]
        step_results(stage, slots)
        return slots

    names = {"bad": True, "ok": True, "plain": False}
    alone: dict[str, tuple[int, ...]] = {}
    for name, constrained in names.items():
        solo = runner(source)
        (first,) = solo.result(prefill(name, constrained)).tokens
        alone[name] = solo.result(decode(name, first)).tokens
        alone[name + "-first"] = (first,)
    stage = runner(source)
    assert stage.batches  # the frames below run as one forward
    firsts = step(stage, [prefill(name, constrained) for name, constrained in names.items()])
    assert [s.output.tokens for s in firsts if s.output] == [
        alone[name + "-first"] for name in names
    ]
    frames = [
        decode("bad", ord("x")),  # never allowed by the grammar: a JSON reply opens with "{"
        decode("ok", alone["ok-first"][0]),
        decode("plain", alone["plain-first"][0]),
    ]
    bad, ok, plain = step(stage, frames)
    assert isinstance(bad.error, StageError)
    assert "not allowed by the grammar" in str(bad.error)
    assert ok.error is None
    assert ok.output is not None
    assert plain.error is None
    assert plain.output is not None
    assert (ok.output.tokens, plain.output.tokens) == (alone["ok"], alone["plain"])


async def test_a_split_mesh_enforces_the_grammar_as_one_node_does(
    hub_ref: tuple[str, Path], tmp_path: Path, nursery: trio.Nursery
) -> None:
    ref, package = hub_ref
    single = await constrained_greedy(runner(open_ref(package)))
    mesh = InMemoryMesh(host_memory=1 << 34)
    add_worker(mesh, "w1", tmp_path / "w1", nursery)
    pipeline = await serve(mesh, ref, package, 2, nursery)
    run = mesh.workers["w1"].run
    assert run is not None
    assert run.runner is not None
    assert run.runner.last  # the worker decides tokens: the grammar crossed the wire
    # It fetched its part from the hub, the tokenizer included, and enforces the grammar.
    assert await constrained_greedy(pipeline) == single
    nursery.cancel_scope.cancel()
