"""Sampling: greedy, seeded reproducibility, the exponential race samples the processed
distribution and shrugs off float noise, truncation never emits excluded tokens,
penalties, stop strings, incremental detokenization."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.engine import sampling
from meshnode.engine.backend import cpu_backend
from meshnode.engine.loader import LoadedModel, load_model
from meshnode.engine.sampling import (
    MAX_LOGIT_FACTOR,
    MIN_LOGIT_DIVISOR,
    CounterRandom,
    Draw,
    Sampler,
    SamplingParams,
    apply_penalties,
    logits_to_probs,
    race,
)
from meshnode.engine.tokenizer import ChatTemplate, IncrementalDetokenizer, TemplateError
from meshnode.serve.local import GenerationResult, generate_local
from tests.speculative.chisq import assert_fits, chi_square, critical_value

V = 50
LOGITS = np.random.default_rng(3).standard_normal(V).astype(np.float32) * 3


def _draws(params: SamplingParams, n: int = 200) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(LOGITS) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    assert _draws(SamplingParams(temperature=0.0), 3) == [int(LOGITS.argmax())] * 3
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.0))
    assert probs[int(LOGITS.argmax())] == 1.0


def test_seeded_runs_reproduce_and_seeds_differ() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    assert _draws(params) == _draws(params)
    assert _draws(params) != _draws(SamplingParams(temperature=1.0, seed=43))


def test_a_draw_depends_on_the_seed_and_position_only() -> None:
    """Counter-based: the token at a position is the same whatever was drawn before, so a
    sampler built elsewhere (another last stage, after a replay) continues the sequence."""
    params = SamplingParams(temperature=1.0, seed=42)
    forward = [Sampler(params).sample(LOGITS, (), p) for p in range(40)]
    one = Sampler(params)
    assert [one.sample(LOGITS, (), p) for p in range(40)] == forward
    backward = Sampler(params)
    assert [backward.sample(LOGITS, (), p) for p in reversed(range(40))][::-1] == forward
    later = Sampler(params)  # joins at position 25
    assert [later.sample(LOGITS, (), p) for p in range(25, 40)] == forward[25:]
    random = CounterRandom(42)
    assert len({random.uniform(p) for p in range(40)}) == 40  # each position its own number
    assert len(set(forward)) > 1
    assert len({random.uniform(3, draw) for draw in Draw}) == len(Draw)
    assert random.uniform(3) != CounterRandom(43).uniform(3)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.3, top_k=5, seed=2),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, seed=3),
    ],
    ids=["softmax", "top-k", "top-p-min-p"],
)
def test_the_race_samples_the_processed_distribution(params: SamplingParams) -> None:
    """Token frequencies over many positions fit ``logits_to_probs`` (chi-square at the
    1e-4 level, fixed seeds): the race over the kept set samples the softmax of the
    tempered logits, renormalised after truncation, and never a truncated token."""
    # A spread-out law, in shuffled id order: most ids are kept and every cell expects
    # several draws.
    weights = [0.25, 0.2, 0.15, 0.12, 0.1, 0.07, 0.05, 0.03, 0.015, 0.01, 0.004, 0.001]
    logits = np.log(np.random.default_rng(4).permutation(weights)).astype(np.float32)
    probs = logits_to_probs(logits, params)
    assert (probs > 0).sum() >= 5
    sampler = Sampler(params)
    counts = np.bincount([sampler.sample(logits, (), p) for p in range(8000)], minlength=12)
    assert_fits(counts, probs)
    uniform = np.full(12, 1 / 12)  # the check has power: the counts are far from uniform
    assert chi_square(counts, uniform) > critical_value(11)


def test_the_race_picks_by_exponential_over_weight() -> None:
    assert race([0.5, 0.0, 0.5], [1.0, 0.0, 2.0]) == 0  # a zero weight never wins
    assert race([0.2, 0.8], [1.0, 1.0]) == 1
    assert race([3.0, 1.0], [4.0, 1.0]) == 1  # 4/3 > 1/1: weights need no normalising
    assert race([1.0, 1.0], [2.0, 2.0]) == 0  # a tie goes to the lowest id
    assert race([0.0, 1.0, 1.0], [0.0, np.inf, np.inf]) == 1  # never a zero weight
    with pytest.raises(ValueError, match="no mass"):
        race([0.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="no mass"):
        CounterRandom(1).pick(np.zeros(4), 0)


def test_each_token_has_its_own_exponential_at_a_position() -> None:
    """Keyed on (seed, position, draw, token id): a shorter vocabulary is a prefix,
    positions and draws are independent streams, and the values are Exp(1)."""
    random = CounterRandom(42)
    full = random.exponentials(7, 1000)
    np.testing.assert_array_equal(random.exponentials(7, 10), full[:10])
    assert not np.isin(random.exponentials(8, 1000), full).any()
    assert not np.isin(random.exponentials(7, 1000, Draw.DRAFT), full).any()
    assert not np.isin(CounterRandom(43).exponentials(7, 1000), full).any()
    assert (full >= 0).all()
    assert abs(full.mean() - 1.0) < 0.1


def _reference_probs(logits: Any, params: SamplingParams, history: list[int]) -> np.ndarray:
    """The distribution as written before the in-place draw (one temporary per step)."""
    x = apply_penalties(np.asarray(logits), params, history)
    if params.greedy:
        probs = np.zeros_like(x)
        probs[int(np.argmax(x))] = 1.0
        return probs
    x = x / params.temperature
    probs = np.exp(x - x.max())
    keep = np.ones(probs.shape, dtype=bool)  # _truncate's masks, as before
    probs = probs / probs.sum()
    if 0 < params.top_k < probs.size:
        keep &= probs >= np.partition(probs, -params.top_k)[-params.top_k]
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        nucleus = np.empty_like(keep)
        nucleus[order] = (cum - probs[order]) < params.top_p
        keep &= nucleus
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    out: np.ndarray = probs / probs.sum()
    return out


def _reference_exponentials(seed: int, position: int, count: int, draw: Draw) -> np.ndarray:
    """The exponentials as drawn before: raw 64-bit outputs, shifted, converted, logged."""
    bits = np.random.Philox(key=seed, counter=(0, position, int(draw), 1))
    raw = bits.random_raw(count) >> np.uint64(11)
    out: np.ndarray = 53 * np.log(2) - np.log(raw.view(np.int64).astype(np.float64) + 1.0)
    return out


def _reference_race(weights: np.ndarray, exps: np.ndarray) -> int:
    """The race as written before: every time infinite, then the kept ids' quotients."""
    times = np.full(weights.shape, np.inf)
    with np.errstate(over="ignore"):
        np.divide(exps, weights, out=times, where=weights > 0)
    return int(np.argmin(times))


@pytest.mark.parametrize("vocab", [50, 4099, 49152])
def test_the_in_place_draw_is_the_reference_draw(vocab: int) -> None:
    """The draw without temporaries (scratch arrays, in-place steps, the generator's
    doubles for the exponentials) gives bit for bit the numbers and the tokens of the
    expressions it replaced, so seeded streams are unchanged: every knob, float32 and
    float64 logits, penalties, greedy with and without them."""
    rng = np.random.default_rng(vocab)
    settings = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.3, top_k=7, seed=2),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, seed=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, seed=4),
        SamplingParams(temperature=0.0, seed=5),
        SamplingParams(temperature=0.0, frequency_penalty=0.9, seed=6),
        SamplingParams(temperature=0.05, seed=2**64 - 1),  # exp underflows: zero weights
    ]
    for params in settings:
        sampler = Sampler(params)
        seed = sampler.random.seed
        for position in range(12):
            logits = rng.standard_normal(vocab) * 4
            row = logits.astype(np.float32) if position % 2 else logits
            history = [int(t) for t in rng.integers(0, vocab, position)]
            probs = _reference_probs(row, params, history)
            np.testing.assert_array_equal(logits_to_probs(row, params, history), probs)
            exps = _reference_exponentials(seed, position, vocab, Draw(position % 3))
            got = sampler.random.exponentials(position, vocab, Draw(position % 3))
            np.testing.assert_array_equal(got, exps)
            expected = (
                int(np.argmax(probs))
                if params.greedy
                else _reference_race(
                    probs, _reference_exponentials(seed, position, vocab, Draw.TOKEN)
                )
            )
            assert sampler.sample(row, history, position) == expected


def _inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The rule the race replaced: one uniform against the cumulative sum in id order."""
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


def test_float_noise_in_the_logits_rarely_changes_the_race() -> None:
    """A replayed pass's logits differ from the undisturbed run's by float noise (~2e-5 on
    SmolLM2, chunked prefill against decode). The race's winner moves only on a near-tie
    of the two best candidates; inverse-CDF sampling over the whole vocabulary moves
    whenever the uniform is near a boundary the noise shifts, many times as often (here,
    with noise 1e-4 on 2000 draws: 1 against 19)."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=1.0)
    random = CounterRandom(99)
    race_flips = cdf_flips = 0
    for position in range(2000):
        logits = (rng.standard_normal(4096) * 2).astype(np.float32)
        noisy = logits + (rng.standard_normal(4096) * 1e-4).astype(np.float32)
        a, b = logits_to_probs(logits, params), logits_to_probs(noisy, params)
        race_flips += random.pick(a, position) != random.pick(b, position)
        u = random.uniform(position)
        cdf_flips += _inverse_cdf(a, u) != _inverse_cdf(b, u)
    assert race_flips <= 2
    assert cdf_flips >= 5 * max(race_flips, 1)


def test_an_unseeded_sampler_picks_its_own_seed() -> None:
    params = SamplingParams(temperature=1.0)
    assert Sampler(params).random.seed != Sampler(params).random.seed
    assert _draws(params) != _draws(params)


def test_temperature_sharpens_the_distribution() -> None:
    hot = logits_to_probs(LOGITS, SamplingParams(temperature=2.0))
    cold = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    assert cold.max() > hot.max()
    assert abs(hot.sum() - 1) < 1e-9


@settings(max_examples=60, deadline=None)
@given(
    top_k=st.integers(0, V),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    temperature=st.floats(0.1, 3.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_truncation_never_emits_an_excluded_token(
    top_k: int, top_p: float, min_p: float, temperature: float, seed: int
) -> None:
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed
    )
    probs = logits_to_probs(LOGITS, params)
    base = logits_to_probs(LOGITS, SamplingParams(temperature=temperature))
    order = np.argsort(-base)
    allowed = set(range(V))
    if top_k:
        allowed &= {int(i) for i in order[:top_k]}
    cum = np.cumsum(base[order])
    if top_p < 1.0:  # top_p 1 keeps every token, even where the cumulative sum rounds to 1
        allowed &= {
            int(i) for i, c, p in zip(order, cum, base[order], strict=True) if c - p < top_p
        }
    allowed &= {i for i in range(V) if base[i] >= min_p * base.max()}
    assert {int(i) for i in np.flatnonzero(probs)} == allowed
    assert set(_draws(params, 50)) <= allowed


def test_penalties() -> None:
    logits = np.array([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits, SamplingParams(temperature=0.0, repetition_penalty=2.0), [0, 1])
    np.testing.assert_allclose(rep, [1.0, -4.0, 1.0, 0.5])
    pf = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    np.testing.assert_allclose(apply_penalties(logits, pf, [2, 2, 3]), [2.0, -2.0, 0.0, -0.25])
    # A penalty changes the greedy pick away from a repeated token.
    repeat = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    assert Sampler(repeat).sample(logits, [0]) == 2


def test_invalid_params_are_rejected() -> None:
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}, {"min_p": 2.0}):
        with pytest.raises(ValueError, match="must be"):
            SamplingParams(**bad)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", 1e-308),
        ("temperature", 1e300),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("repetition_penalty", 1e-308),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan),
        ("presence_penalty", -1e300),
        ("presence_penalty", math.nan),
        ("frequency_penalty", math.inf),
        ("top_p", math.nan),
        ("min_p", math.nan),
    ],
)
def test_the_record_itself_bounds_what_would_overflow_the_logits(name: str, value: float) -> None:
    """Issue 36's tiny divisors were refused only by the API; a peer's wire frame or a
    library caller builds the record directly, so it refuses them itself, naming the knob."""
    knob: dict[str, Any] = {name: value}
    with pytest.raises(ValueError, match=f"^{name} must be .*got {re.escape(repr(value))}$"):
        SamplingParams(**knob)


def test_the_bounds_themselves_are_accepted_and_keep_every_logit_finite() -> None:
    logits = np.array([3.4e38, -3.4e38, 0.0, 1.0], dtype=np.float32)
    history = [0, 1] * 1000
    for params in (
        SamplingParams(temperature=MIN_LOGIT_DIVISOR, repetition_penalty=MIN_LOGIT_DIVISOR),
        SamplingParams(temperature=MAX_LOGIT_FACTOR, repetition_penalty=MAX_LOGIT_FACTOR),
        SamplingParams(presence_penalty=MAX_LOGIT_FACTOR, frequency_penalty=-MAX_LOGIT_FACTOR),
    ):
        penalized = apply_penalties(logits, params, history)
        assert np.isfinite(penalized / params.temperature).all()
        assert Sampler(params).sample(logits, history) in range(4)


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_gguf("Q8_0")), cpu_backend())


def _run(model: LoadedModel, **kw: Any) -> tuple[list[str], GenerationResult]:
    """The text pieces streamed and the result of ``meshnode generate``'s loop."""
    pieces: list[str] = []
    result = generate_local(model.stage, model.tokenizer, [1, 70, 71], on_text=pieces.append, **kw)
    return pieces, result


def test_generate_seeded_reproduces_and_streams_the_whole_text(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    deltas, a = _run(tiny, params=params, max_tokens=12)
    _, b = _run(tiny, params=params, max_tokens=12)
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) == 12
    assert a.finish_reason == "length"
    assert "".join(deltas) == a.text == tiny.tokenizer.decode(a.token_ids)


def test_generate_stops_on_eos_and_on_stop_strings(tiny: LoadedModel) -> None:
    _, greedy = _run(tiny, params=SamplingParams(temperature=0.0), max_tokens=10)
    first = greedy.token_ids[0]
    _, eos = _run(tiny, params=SamplingParams(temperature=0.0), max_tokens=10, eos_ids=[first])
    assert eos.token_ids == []
    assert eos.finish_reason == "stop"
    stop = greedy.text[2:4]
    deltas, cut = _run(tiny, params=SamplingParams(temperature=0.0), max_tokens=10, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == greedy.text[: greedy.text.find(stop)]
    assert "".join(deltas) == cut.text


@pytest.mark.real_model
def test_incremental_detokenizer_never_splits_a_character(smollm2: LoadedModel) -> None:
    text = "Grüße 🚀 日本語のテキスト — naïve café ✓"
    ids = smollm2.tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm2.tokenizer)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len([p for p in pieces if p])  # some tokens were partial characters


def test_chat_template_is_sandboxed() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "x"}])
    raising = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(TemplateError, match="no system role"):
        raising.render([])


def test_any_integer_seed_is_folded_into_the_generators_range() -> None:
    assert SamplingParams(seed=-1).seed == 2**64 - 1
    assert SamplingParams(seed=5).seed == 5
    a = Sampler(SamplingParams(temperature=1.0, seed=-1))
    b = Sampler(SamplingParams(temperature=1.0, seed=2**64 - 1))
    logits = np.linspace(-1.0, 1.0, 32, dtype=np.float32)
    assert [a.sample(logits, []) for _ in range(8)] == [b.sample(logits, []) for _ in range(8)]


def test_the_compiled_philox_is_numpys() -> None:
    """The race's own Philox4x64-10 (meshnode.engine.cpu.draws) against NumPy's, at the
    counters and keys a draw uses: the block of ids 4 j .. 4 j + 3 is the (j + 1)-th."""
    from meshnode.engine.cpu.draws import philox_block

    out = np.zeros(4, np.uint64)
    for seed, position, draw, block in [(0, 0, 0, 0), (7, 3, 2, 5), (2**64 - 1, 2**40, 1, 999)]:
        bits = np.random.Philox(key=seed, counter=(0, position, draw, 1))
        want = bits.random_raw(4 * (block + 1))[4 * block :]
        u64 = np.uint64
        philox_block(u64(block + 1), u64(position), u64(draw), u64(1), u64(seed), u64(0), out)
        np.testing.assert_array_equal(out, want)


@given(
    st.lists(st.sampled_from([0.0, 1e-9, 0.001, 0.01, 0.05, 0.2]), min_size=1, max_size=600),
    st.sampled_from([0.1, 0.5, 0.9, 0.999]),
)
@settings(max_examples=150, deadline=None)
def test_the_nucleus_without_a_full_sort_is_the_sorted_one(
    weights: list[float], top_p: float
) -> None:
    """Partial selection (the most likely ids, ties included, then more) keeps exactly the
    ids the full stable sort keeps, ties at the cut and sums that never reach top_p too."""
    probs = np.array(weights)
    probs = probs / probs.sum() if probs.sum() > 0 else np.full(probs.size, 1 / probs.size)
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    want = np.empty(probs.size, dtype=bool)
    want[order] = (cum - probs[order]) < top_p
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling, "NUCLEUS_FIRST_TRY", 4)  # several tries on short rows
        np.testing.assert_array_equal(sampling._nucleus(probs, top_p), want)
