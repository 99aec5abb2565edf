"""Acceptance rules: greedy exactness, speculative sampling preserves the target law."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from meshnode.engine.sampling import CounterRandom, Draw, Sampler, SamplingParams
from meshnode.speculative.acceptance import (
    accept_greedy,
    accept_sampling,
    greedy_targets,
    sample_row,
)
from tests.speculative.chisq import assert_fits, chi_square, critical_value

F64 = npt.NDArray[np.float64]


def one_hot_rows(ids: list[int], vocab: int = 6) -> F64:
    rows = np.full((len(ids), vocab), 0.01)
    rows[np.arange(len(ids)), ids] = 1.0
    normalized: F64 = rows / rows.sum(axis=1, keepdims=True)
    return normalized


@pytest.mark.parametrize(
    ("argmaxes", "drafts", "expected"),
    [
        ([1, 2, 3, 4], [1, 2, 3], (3, [1, 2, 3, 4])),  # all accepted + bonus
        ([1, 2, 3, 4], [1, 5, 3], (1, [1, 2])),  # mismatch at 1: the target's token
        ([1, 2, 3, 4], [0, 2, 3], (0, [1])),
        ([3], [], (0, [3])),  # no drafts: a plain greedy step
    ],
)
def test_greedy(argmaxes: list[int], drafts: list[int], expected: tuple[int, list[int]]) -> None:
    assert accept_greedy(one_hot_rows(argmaxes), drafts) == expected


def test_greedy_takes_lowest_id_on_ties() -> None:
    rows = np.array([[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]])
    assert accept_greedy(rows, [1]) == (0, [0])
    assert accept_greedy(rows, [0]) == (1, [0, 1])


def test_row_count_must_be_k_plus_one() -> None:
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_greedy(one_hot_rows([1, 2]), [1, 2])
    with pytest.raises(ValueError, match="draft probs"):
        accept_sampling(one_hot_rows([1, 2]), [1], one_hot_rows([1, 2]), CounterRandom(0), 0)


def test_sample_row_follows_the_row() -> None:
    random = CounterRandom(1)
    probs = np.array([0.5, 0.0, 0.2, 0.3])
    counts = np.bincount([sample_row(probs * 3.0, random, p) for p in range(4000)], minlength=4)
    assert_fits(counts, probs)


def test_certain_drafts_are_always_accepted() -> None:
    target = np.zeros((3, 5))
    target[[0, 1, 2], [2, 3, 4]] = 1.0
    for seed in range(20):
        assert accept_sampling(target, [2, 3], None, CounterRandom(seed), 5) == (2, [2, 3, 4])


def test_impossible_draft_is_rejected_and_never_resampled() -> None:
    target = np.array([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    for seed in range(50):
        accepted, tokens = accept_sampling(target, [0], None, CounterRandom(seed), 5)
        assert accepted == 0
        assert tokens[0] in (1, 2)


class MarkovModel:
    """A context-of-one "language model": ``table[prev]`` is the next-token law."""

    def __init__(self, rng: np.random.Generator, vocab: int, concentration: float) -> None:
        self.table = rng.dirichlet(np.full(vocab, concentration), size=vocab)

    def rows(self, prev: int, tokens: list[int]) -> F64:
        return self.table[[prev, *tokens]]


def speculative_two(
    target: MarkovModel,
    draft: MarkovModel | None,
    start: int,
    k: int,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """The first two tokens after ``start`` from repeated verify passes."""
    random = CounterRandom(int(rng.integers(2**63)))
    out: list[int] = []
    while len(out) < 2:
        prev = out[-1] if out else start
        drafts: list[int] = []
        q_rows = []
        for _ in range(k):
            if draft is None:  # a deterministic (one-hot) guess: "repeat the previous token"
                drafts.append(drafts[-1] if drafts else prev)
                continue
            q = draft.table[drafts[-1] if drafts else prev]
            # As the draft model draws: its own draw at the draft's position.
            drafts.append(sample_row(q, random, len(out) + len(drafts), Draw.DRAFT))
            q_rows.append(q)
        q_probs = np.array(q_rows) if draft is not None else None
        rows = target.rows(prev, drafts)
        # Row 0 decides output position len(out); each trial has its own seed.
        _, tokens = accept_sampling(rows, drafts, q_probs, random, len(out))
        out += tokens
    return out[0], out[1]


@pytest.mark.parametrize(("with_draft", "k"), [(True, 3), (False, 2), (True, 1)])
def test_speculative_sampling_matches_the_target_joint_law(with_draft: bool, k: int) -> None:
    vocab, start, trials = 5, 0, 12_000
    rng = np.random.default_rng(1234 + k)
    target = MarkovModel(rng, vocab, concentration=0.8)
    draft = MarkovModel(rng, vocab, concentration=0.8) if with_draft else None
    counts = np.zeros(vocab * vocab, dtype=np.int64)
    for _ in range(trials):
        a, b = speculative_two(target, draft, start, k, rng)
        counts[a * vocab + b] += 1
    joint = (target.table[start][:, None] * target.table).reshape(-1)
    assert_fits(counts, joint)


def test_chi_square_detects_a_wrong_law() -> None:
    """The check has power: plain draft sampling (no correction) is caught."""
    vocab, trials = 5, 12_000
    rng = np.random.default_rng(7)
    target = MarkovModel(rng, vocab, concentration=0.8)
    draft = MarkovModel(rng, vocab, concentration=0.8)
    random = CounterRandom(7)
    draws = [sample_row(draft.table[0], random, p) for p in range(trials)]
    counts = np.bincount(draws, minlength=5)
    assert chi_square(counts, target.table[0]) > critical_value(vocab - 1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.2),
    ],
)
def test_greedy_targets_pick_what_a_plain_greedy_step_would(params: SamplingParams) -> None:
    """Row i's argmax is the plain greedy token after the generated tokens and drafts < i."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    generated = [7, 7, 3, 12, 5, 9]  # 3 generated tokens, then 3 drafts
    target = greedy_targets(logits, params, generated, first=3)
    sampler = Sampler(params)
    for i in range(4):
        assert int(np.argmax(target[i])) == sampler.sample(logits[i], generated[: 3 + i])
    if not params.penalized:
        assert target is logits  # no float64 copy of the vocabulary per row
