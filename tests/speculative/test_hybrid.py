"""Speculation on the tiny Qwen3.5 hybrid: greedy output equals the reference whatever the
window and however much of each window is accepted, because rejected rows are rolled back
in the recurrent state by the snapshot ring (single node here; the pipeline in
tests/serve/test_hybrid_pipeline.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.node.stage import StageRunner
from meshnode.serve.local import generate_tokens
from meshnode.speculative.ngram import NgramParams, NgramProposer
from meshnode.speculative.proposer import Proposal
from meshnode.speculative.window import WindowPolicy
from tests.engine.hybrid_model import HybridFolder, hybrid_golden

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = hybrid_golden()["prompts"]


class PartlyRightProposer:
    """Drafts the reference continuation but breaks it after ``step % (k + 1)`` tokens, so
    successive windows are rejected at every offset (all, part-way, none)."""

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        self.truth = [*prompt, *continuation]
        self.steps = 0

    def propose(self, history: Sequence[int], max_tokens: int) -> Proposal:
        ahead = self.truth[len(history) : len(history) + max_tokens]
        good = self.steps % (max_tokens + 1)
        self.steps += 1
        drafts = [*ahead[:good], *((t + 1) % 512 for t in ahead[good:])]
        return Proposal(tuple(drafts))

    def on_result(self, proposed: int, accepted: int, *, seconds: float | None = None) -> None:
        pass


@pytest.fixture(scope="module")
def stage() -> Stage:
    source = HybridFolder()
    return Stage(ModelConfig.from_hf(source.config), source, 0, 8, embed=True, head=True)


def _run(
    stage: Stage, prompt: dict[str, Any], proposer: Any, window: int
) -> tuple[GenerationRun, StageRunner]:
    """The API's generation loop over one local stage; the run and the stage's runner."""
    policy = WindowPolicy("fixed", window, 1, window)
    runner = StageRunner(stage, context_size=len(prompt["prompt_ids"]) + 32, max_sequences=1)
    run = generate_tokens(
        runner,
        prompt["prompt_ids"],
        GREEDY,
        max_new_tokens=32,
        speculation=Speculation.of(proposer, policy),
    )
    return run, runner


@pytest.mark.parametrize("window", [1, 4, 16])
def test_partly_rejected_windows_keep_greedy_output(stage: Stage, window: int) -> None:
    for prompt in PROMPTS:
        proposer = PartlyRightProposer(prompt["prompt_ids"], prompt["gen_ids"])
        run, runner = _run(stage, prompt, proposer, window)
        assert run.state.tokens == prompt["gen_ids"], prompt["id"]
        assert 0 < run.spec.accepted < run.spec.proposed
        assert runner.memory()["ring_restores"] > 0  # rejected rows rolled back from the ring


@pytest.mark.parametrize("window", [1, 4, 16])
def test_ngram_speculation_keeps_greedy_output(stage: Stage, window: int) -> None:
    for prompt in PROMPTS[1:3]:  # the repetitive and the mixed prompt: n-gram proposes
        run, _ = _run(stage, prompt, NgramProposer(NgramParams(1, 3)), window)
        assert run.state.tokens == prompt["gen_ids"], prompt["id"]
