"""Speculative generation on tiny models: greedy parity, rollback, EOS, distribution."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt
import pytest

from meshnode.engine.generate import decode_one, prefill
from meshnode.engine.model import Stage
from meshnode.engine.sampling import Sampler, SamplingParams, logits_to_probs
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.serve.local import generate_tokens
from meshnode.speculative.auto import AutoNgramProposer
from meshnode.speculative.draft import StageProposer, layer_skip_stage
from meshnode.speculative.ngram import NgramParams, NgramProposer
from meshnode.speculative.proposer import Proposal, Proposer
from meshnode.speculative.telemetry import SpecStats, summarize
from meshnode.speculative.window import WindowPolicy
from tests.speculative.chisq import assert_fits
from tests.speculative.conftest import tiny_stage
from tests.speculative.tinymodel import TinySource, tiny_config

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    [5, 9, 13, 7, 5, 9],
    [3, 30, 17, 30, 4, 12, 40, 41, 42, 3, 30, 17],
    [11],
    [20, 21, 22, 23, 24, 25, 26, 27, 20, 21, 22, 23],
]
WINDOWS = {
    "fixed": WindowPolicy("fixed", initial_window=4, min_window=1, max_window=4),
    "adaptive": WindowPolicy("adaptive", initial_window=2, min_window=1, max_window=6),
}
MAX_NEW = 40


def plain_generate(
    stage: Stage, prompt: Sequence[int], params: SamplingParams, n: int, sampler: Sampler
) -> list[int]:
    """Reference: one token per forward, the engine's sampler (penalty context: output;
    each token drawn at its sequence position)."""
    cache = stage.new_cache(len(prompt) + n)
    logits = prefill(stage, cache, prompt)
    out: list[int] = []
    while True:
        out.append(sampler.sample(logits, out, len(prompt) + len(out)))
        if len(out) == n:
            return out
        logits = decode_one(stage, cache, out[-1], len(prompt) + len(out) - 1)


def speculative_generate(
    stage: Stage,
    prompt: Sequence[int],
    params: SamplingParams,
    proposer: Proposer,
    *,
    max_new_tokens: int,
    window: WindowPolicy,
    eos_ids: Sequence[int] = (),
) -> GenerationRun:
    """The API's generation loop over a local pipeline, speculating with ``proposer``."""
    return generate_tokens(
        stage,
        prompt,
        params,
        max_new_tokens=max_new_tokens,
        speculation=Speculation.of(proposer, window),
        eos_ids=eos_ids,
    )


def make_proposer(kind: str, target: Stage, draft: Stage, params: SamplingParams) -> Proposer:
    if kind == "ngram":
        return NgramProposer(NgramParams(min_n=1, max_n=3, max_proposal=8))
    if kind == "auto":
        return AutoNgramProposer(NgramParams(min_n=1, max_n=3, max_proposal=8))
    if kind == "draft":
        return StageProposer(draft, params, capacity=128)
    return StageProposer(layer_skip_stage(target, 2), params, capacity=128)


@pytest.mark.parametrize("window", sorted(WINDOWS))
@pytest.mark.parametrize("kind", ["ngram", "auto", "draft", "layer-skip"])
def test_greedy_parity(kind: str, window: str, target: Stage, draft: Stage) -> None:
    """Every strategy and window policy commits exactly the plain greedy tokens."""
    stats: list[SpecStats] = []
    for prompt in PROMPTS:
        expected = plain_generate(target, prompt, GREEDY, MAX_NEW, Sampler(GREEDY))
        proposer = make_proposer(kind, target, draft, GREEDY)
        run = speculative_generate(
            target, prompt, GREEDY, proposer, max_new_tokens=MAX_NEW, window=WINDOWS[window]
        )
        assert run.state.tokens == expected, f"prompt {prompt}"
        stats.append(run.spec)
    total = summarize(stats)
    # The comparison means something only if drafts were both accepted and rejected.
    assert 0 < total.accepted < total.proposed, total.as_dict()


def test_greedy_parity_with_penalties(target: Stage, draft: Stage) -> None:
    """Each verify row is penalised with its own context, as a plain step would be."""
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2
    )
    for prompt in PROMPTS:
        expected = plain_generate(target, prompt, params, MAX_NEW, Sampler(params))
        for proposer in (NgramProposer(), StageProposer(draft, params, capacity=128)):
            run = speculative_generate(
                target, prompt, params, proposer, max_new_tokens=MAX_NEW, window=WINDOWS["fixed"]
            )
            assert run.state.tokens == expected


@pytest.mark.parametrize("kind", ["ngram", "auto", "mtp-like"])
def test_seeded_sampling_is_the_same_with_speculation_on_or_off(kind: str, target: Stage) -> None:
    """Deterministic drafts are verified with the draw plain sampling makes at each
    position: a seeded request commits the same tokens with or without speculation."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    proposers: dict[str, Proposer] = {
        "ngram": NgramProposer(NgramParams(min_n=1, max_n=3, max_proposal=8)),
        "auto": AutoNgramProposer(NgramParams(min_n=1, max_n=3, max_proposal=8)),
        # Greedy drafts from a smaller model: deterministic guesses, as MTP's are.
        "mtp-like": StageProposer(layer_skip_stage(target, 2), GREEDY, capacity=128),
    }
    stats: list[SpecStats] = []
    for prompt in PROMPTS:
        expected = plain_generate(target, prompt, params, MAX_NEW, Sampler(params))
        run = speculative_generate(
            target, prompt, params, proposers[kind], max_new_tokens=MAX_NEW,
            window=WINDOWS["fixed"],
        )  # fmt: skip
        assert run.state.tokens == expected, f"prompt {prompt}"
        stats.append(run.spec)
    total = summarize(stats)
    assert 0 < total.accepted < total.proposed, total.as_dict()


class Watching:
    """A proposer that checks, before each proposal, that a draft model's cache follows
    the committed tokens (it rolls back lazily, on its next catch-up)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.rejections = 0

    def propose(self, history: Sequence[int], max_tokens: int) -> Proposal:
        if isinstance(self.inner, StageProposer):
            self.inner.sync(history)
            assert self.inner.cached == list(history)
            assert self.inner.cache.length == len(history)
        return self.inner.propose(history, max_tokens)

    def on_result(self, proposed: int, accepted: int, *, seconds: float | None = None) -> None:
        self.rejections += accepted < proposed
        self.inner.on_result(proposed, accepted, seconds=seconds)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_rejected_windows_roll_back(kind: str, target: Stage, draft: Stage) -> None:
    """Windows rejected part-way leave no trace: the target's output is the plain greedy
    one, and the draft's cache holds exactly the committed tokens before each proposal."""
    expected = plain_generate(target, PROMPTS[1], GREEDY, MAX_NEW, Sampler(GREEDY))
    proposer = Watching(make_proposer(kind, target, draft, GREEDY))
    run = speculative_generate(
        target, PROMPTS[1], GREEDY, proposer, max_new_tokens=MAX_NEW, window=WINDOWS["fixed"]
    )
    assert run.state.tokens == expected
    assert proposer.rejections > 0


def test_eos_stops_and_trims(target: Stage) -> None:
    expected = plain_generate(target, PROMPTS[1], GREEDY, MAX_NEW, Sampler(GREEDY))
    eos = expected[7]
    stop_at = expected.index(eos) + 1
    run = speculative_generate(
        target,
        PROMPTS[1],
        GREEDY,
        NgramProposer(),
        max_new_tokens=MAX_NEW,
        window=WINDOWS["fixed"],
        eos_ids=[eos],
    )
    assert run.state.tokens == expected[:stop_at]


def test_budget_is_never_exceeded(target: Stage) -> None:
    for budget in (1, 2, 5):
        run = speculative_generate(
            target,
            PROMPTS[3],
            GREEDY,
            NgramProposer(),
            max_new_tokens=budget,
            window=WINDOWS["fixed"],
        )
        assert len(run.state.tokens) == budget


def test_layer_skip_on_a_headless_stage_zero_matches(target_source: TinySource) -> None:
    """Stage 0 of a split holds no head: the draft loads only the final norm/head."""
    full = tiny_stage(target_source)
    split = tiny_stage(target_source, end=3, head=False)
    a, b = layer_skip_stage(full, 2), layer_skip_stage(split, 2, target_source)
    ids = np.array(PROMPTS[1])
    np.testing.assert_allclose(
        b.forward(ids, 0, b.new_cache(32)), a.forward(ids, 0, a.new_cache(32)), rtol=1e-5
    )
    assert b.weights.layers[0] is split.weights.layers[0]  # shared, not reloaded
    with pytest.raises(ValueError, match="needs the model source"):
        layer_skip_stage(split, 2)
    with pytest.raises(ValueError, match="needs stage 0 holding them"):
        layer_skip_stage(split, 4, target_source)


# -- sampling: the speculative output law is the target's -------------------------------

SAMPLE_VOCAB = 10
SAMPLED = SamplingParams(temperature=1.0)


def exact_law(stage: Stage, prompt: list[int], depth: int) -> npt.NDArray[np.float64]:
    """P(token at position ``depth`` after the prompt), summing over the tokens before it."""

    def rec(prefix: list[int], weight: float, out: npt.NDArray[np.float64]) -> None:
        probs = logits_to_probs(
            stage.forward(np.array(prefix), 0, stage.new_cache(len(prefix)), out_rows=1)[0],
            SAMPLED,
            prefix[len(prompt) :],
        )
        if len(prefix) - len(prompt) == depth:
            out += weight * probs
            return
        for token in np.flatnonzero(probs > 1e-12):
            rec([*prefix, int(token)], weight * float(probs[token]), out)

    out = np.zeros(SAMPLE_VOCAB)
    rec(prompt, 1.0, out)
    return out


@pytest.fixture(scope="module")
def sample_models() -> tuple[Stage, Stage]:
    target = tiny_stage(TinySource(tiny_config(SAMPLE_VOCAB, 2, hidden=16), 3, logit_scale=2.5))
    draft = tiny_stage(TinySource(tiny_config(SAMPLE_VOCAB, 1, hidden=16), 4, logit_scale=2.5))
    return target, draft


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_sampling_follows_the_target_law(kind: str, sample_models: tuple[Stage, Stage]) -> None:
    """Chi-square: tokens 2 and 3 (both decided by verify passes) against the exact law,
    and plain sampling from the engine's sampler against the same law."""
    target, draft = sample_models
    prompt, trials = [1, 4, 1], 1500
    rng = np.random.default_rng(2024)
    counts = np.zeros((2, SAMPLE_VOCAB), dtype=np.int64)
    plain = np.zeros((2, SAMPLE_VOCAB), dtype=np.int64)

    def make(params: SamplingParams) -> Proposer:
        if kind == "draft":
            return StageProposer(draft, params, capacity=16)
        return NgramProposer(NgramParams(min_n=1, max_n=2))

    for _ in range(trials):
        # Counter-based draws repeat at the same positions: each trial has its own seeds.
        params, other = (replace(SAMPLED, seed=int(rng.integers(2**63))) for _ in range(2))
        run = speculative_generate(
            target, prompt, params, make(params), max_new_tokens=3, window=WINDOWS["fixed"]
        )
        reference = plain_generate(target, prompt, other, 3, Sampler(other))
        for depth in (1, 2):
            counts[depth - 1, run.state.tokens[depth]] += 1
            plain[depth - 1, reference[depth]] += 1
    for depth in (1, 2):
        law = exact_law(target, prompt, depth)
        assert_fits(counts[depth - 1], law)
        assert_fits(plain[depth - 1], law)
