"""Sampling: greedy, seeded reproducibility, truncation never emits excluded tokens,
penalties, stop strings, incremental detokenization."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.engine.backend import cpu_backend
from meshnode.engine.loader import LoadedModel, load_model
from meshnode.engine.sampling import (
    CounterRandom,
    Draw,
    Sampler,
    SamplingParams,
    apply_penalties,
    logits_to_probs,
)
from meshnode.engine.tokenizer import ChatTemplate, IncrementalDetokenizer, TemplateError
from meshnode.serve.local import GenerationResult, generate_local

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


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_gguf("Q8_0")), cpu_backend())


def _run(model: LoadedModel, **kw: Any) -> tuple[list[str], GenerationResult]:
    """The text pieces streamed and the result of ``meshnode generate``'s loop."""
    pieces: list[str] = []
    result = generate_local(
        model.stage, model.tokenizer, [1, 70, 71], on_text=pieces.append, **kw
    )
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
