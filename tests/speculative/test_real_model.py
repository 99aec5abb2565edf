"""Parity of speculative decoding on SmolLM2-135M: greedy against the golden references,
seeded sampling against the same request without speculation."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.engine.loader import LoadedModel
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.records import Speculation
from meshnode.serve.local import generate_tokens
from meshnode.speculative.auto import AutoNgramProposer
from meshnode.speculative.draft import StageProposer, layer_skip_stage
from meshnode.speculative.ngram import NgramProposer
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.window import WindowPolicy
from tests.speculative.conftest import tiny_stage
from tests.speculative.tinymodel import TinySource, tiny_config

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0.0)
ADAPTIVE = WindowPolicy("adaptive", initial_window=3, min_window=1, max_window=6)
FIXED = WindowPolicy("fixed", initial_window=4, min_window=1, max_window=4)


def golden_prompt(golden: dict[str, Any], index: int) -> tuple[list[int], list[int]]:
    prompt = golden["prompts"][index]
    return prompt["prompt_ids"], prompt["gen_ids"]


def run(
    model: LoadedModel, proposer: Proposer, prompt: list[int], n: int, window: WindowPolicy
) -> list[int]:
    result = generate_tokens(
        model.stage,
        prompt,
        GREEDY,
        max_new_tokens=n,
        speculation=Speculation.of(proposer, window),
        eos_ids=model.config.eos_token_ids,
    )
    return result.state.tokens


@pytest.mark.parametrize("index", [0, 3, 5])
@pytest.mark.parametrize("window", [FIXED, ADAPTIVE], ids=["fixed", "adaptive"])
def test_ngram_and_auto_reproduce_golden(
    smollm2: LoadedModel, golden: dict[str, Any], index: int, window: WindowPolicy
) -> None:
    prompt, expected = golden_prompt(golden, index)
    assert run(smollm2, NgramProposer(), prompt, len(expected), window) == expected
    assert run(smollm2, AutoNgramProposer(), prompt, len(expected), window) == expected


def test_layer_skip_reproduces_golden(smollm2: LoadedModel, golden: dict[str, Any]) -> None:
    prompt, expected = golden_prompt(golden, 0)
    proposer = StageProposer(layer_skip_stage(smollm2.stage, 27), GREEDY, capacity=256)
    assert run(smollm2, proposer, prompt, len(expected), ADAPTIVE) == expected


def test_tiny_random_draft_reproduces_golden(smollm2: LoadedModel, golden: dict[str, Any]) -> None:
    """A useless draft sharing the vocabulary: nearly everything rejected, output intact."""
    vocab = smollm2.config.vocab_size
    draft: Stage = tiny_stage(TinySource(tiny_config(vocab, 1, hidden=16), seed=0))
    prompt, expected = golden_prompt(golden, 3)
    proposer = StageProposer(draft, GREEDY, capacity=256)
    assert run(smollm2, proposer, prompt, 16, FIXED) == expected[:16]


#: Seeded sampling over the whole vocabulary (no nucleus to cut the tail off).
SAMPLED = SamplingParams(temperature=0.8, seed=1234)


def test_seeded_sampling_is_the_same_with_speculation_on_the_real_model(
    smollm2: LoadedModel, golden: dict[str, Any]
) -> None:
    """A verify pass computes its k + 1 rows in one forward, whose logits differ from
    one-token decodes' in the last bits; the token race does not move on that, so a seeded
    request over the whole vocabulary commits the same tokens with n-gram speculation as
    without (the drafts that match are accepted at the very draws plain sampling makes)."""
    prompt, _ = golden_prompt(golden, 3)
    eos = smollm2.config.eos_token_ids
    plain = generate_tokens(smollm2.stage, prompt, SAMPLED, max_new_tokens=64, eos_ids=eos)
    speculative = generate_tokens(
        smollm2.stage,
        prompt,
        SAMPLED,
        max_new_tokens=64,
        speculation=Speculation.of(NgramProposer(), FIXED),
        eos_ids=eos,
    )
    assert speculative.state.tokens == plain.state.tokens
    assert speculative.spec.proposed > 0  # verify passes ran
