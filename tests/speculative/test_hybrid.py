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
from meshnode.engine.recurrent import HybridCache
from meshnode.engine.sampling import SamplingParams
from meshnode.speculative.generate import speculative_generate
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


def _run(stage: Stage, prompt: dict[str, Any], proposer: Any, window: int) -> Any:
    policy = WindowPolicy("fixed", window, 1, window)
    return speculative_generate(
        stage, prompt["prompt_ids"], GREEDY, proposer, max_new_tokens=32, window=policy
    )


@pytest.mark.parametrize("window", [1, 4, 16])
def test_partly_rejected_windows_keep_greedy_output(stage: Stage, window: int) -> None:
    for prompt in PROMPTS:
        proposer = PartlyRightProposer(prompt["prompt_ids"], prompt["gen_ids"])
        run = _run(stage, prompt, proposer, window)
        assert run.generated == prompt["gen_ids"], prompt["id"]
        assert 0 < run.stats.accepted < run.stats.proposed
        assert isinstance(run.cache, HybridCache)
        assert run.cache.restores > 0  # rejected rows were rolled back from the ring


@pytest.mark.parametrize("window", [1, 4, 16])
def test_ngram_speculation_keeps_greedy_output(stage: Stage, window: int) -> None:
    for prompt in PROMPTS[1:3]:  # the repetitive and the mixed prompt: n-gram proposes
        run = _run(stage, prompt, NgramProposer(NgramParams(1, 3)), window)
        assert run.generated == prompt["gen_ids"], prompt["id"]
