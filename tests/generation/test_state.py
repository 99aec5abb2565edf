"""The pure generation state machine: stop strings, EOS, budget, hold-back."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from meshnode.engine.sampling import SamplingParams
from meshnode.generation.state import (
    FinishReason,
    GenerationParams,
    GenerationState,
    prefill_chunks,
)
from meshnode.generation.stops import find_stop, first_stop, held_back
from meshnode.node.pipeline import TokenLogprob

EOS = 0
# A toy vocabulary: each token id is one piece of text. Token 9 is the first half of a
# two-token character, to check that held-back bytes are flushed at the end.
PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "\n", 6: "##", 7: "#", 8: "END"}


@dataclass
class TableDetokenizer:
    """Detokenizes the toy vocabulary; token 9 holds back until the next token."""

    held: list[str] = field(default_factory=list)

    def push(self, token: int) -> str:
        if token == 9:
            self.held.append("?")
            return ""
        out = "".join(self.held) + PIECES[token]
        self.held.clear()
        return out

    def flush(self) -> str:
        out = "".join(self.held)
        self.held.clear()
        return out


def state(max_new: int = 100, stop: tuple[str, ...] = ()) -> GenerationState:
    params = GenerationParams(
        max_new_tokens=max_new,
        sampling=SamplingParams(temperature=0.0),
        stop=stop,
        eos_token_ids=frozenset({EOS}),
    )
    return GenerationState(params, TableDetokenizer())


def texts(st: GenerationState, steps: list[list[int]]) -> list[str]:
    return [st.commit(step).text for step in steps]


def test_plain_tokens_stream_as_they_come() -> None:
    st = state()
    assert texts(st, [[1], [2], [3, 4]]) == ["Hel", "lo", " world"]
    assert not st.finished
    assert st.tokens == [1, 2, 3, 4]


def test_eos_finishes_with_stop_and_counts_but_is_not_shown() -> None:
    st = state()
    delta = st.commit([1, EOS, 2])
    assert delta.text == "Hel"
    assert delta.tokens == (1, EOS)  # the token after EOS is dropped
    assert delta.finish_reason is FinishReason.STOP
    assert st.tokens == [1, EOS]


def test_budget_finishes_with_length_and_drops_overshoot() -> None:
    st = state(max_new=3)
    delta = st.commit([1, 2, 3, 4])
    assert (delta.text, delta.tokens, delta.finish_reason) == ("Hello wor", (1, 2, 3), "length")


def test_commit_after_finish_is_an_error() -> None:
    st = state(max_new=1)
    st.commit([1])
    with pytest.raises(RuntimeError, match="after the completion finished"):
        st.commit([2])


def test_stop_string_split_across_tokens_is_held_back_and_cut() -> None:
    st = state(stop=("###",))
    assert texts(st, [[1], [6]]) == ["Hel", ""]  # "##" could start "###"
    delta = st.commit([7, 2])
    assert delta.text == ""  # the stop string itself is never shown
    assert delta.finish_reason is FinishReason.STOP
    assert delta.tokens == (7,)


def test_held_back_text_is_released_when_the_stop_does_not_complete() -> None:
    st = state(stop=("###",))
    assert texts(st, [[6], [2]]) == ["", "##lo"]


def test_stop_inside_one_token_cuts_the_text_before_it() -> None:
    st = state(stop=("lo w",))
    delta = st.commit([1, 2, 3])
    assert delta.text == "Hel"
    assert delta.finish_reason is FinishReason.STOP


def test_length_finish_flushes_held_back_text() -> None:
    st = state(max_new=2, stop=("##x",))
    delta = st.commit([6, 9])
    assert delta.text == "##?"
    assert delta.finish_reason is FinishReason.LENGTH


def test_logprobs_are_cut_with_the_tokens() -> None:
    st = state(max_new=2)
    lps = [TokenLogprob(t, -0.5) for t in (1, 2, 3)]
    delta = st.commit([1, 2, 3], lps)
    assert delta.logprobs == tuple(lps[:2])


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("abc", ["x"], 0),
        ("abc", ["cd"], 1),
        ("abc", ["bcd", "cd"], 2),
        ("abc", ["abcd"], 3),
        ("", ["abc"], 0),
        ("abc", [], 0),
    ],
)
def test_held_back(text: str, stops: list[str], expected: int) -> None:
    assert held_back(text, stops) == expected


def test_find_stop_picks_the_earliest() -> None:
    assert find_stop("one two three", ["three", "two"]) == 4
    assert find_stop("one", ["x"]) is None


def test_first_stop_names_the_earliest_and_the_first_listed_on_a_tie() -> None:
    assert first_stop("one two three", ["three", "two"]) == "two"
    assert first_stop("one two", ["tw", "two"]) == "tw"
    assert first_stop("one two", ["two", "tw"]) == "two"
    assert first_stop("one", ["x"]) is None


def test_prefill_chunks_cover_the_prompt_in_order() -> None:
    assert prefill_chunks([1, 2, 3, 4, 5], 2) == [(0, [1, 2]), (2, [3, 4]), (4, [5])]
    assert prefill_chunks([1], 256) == [(0, [1])]
    with pytest.raises(ValueError, match="chunk size"):
        prefill_chunks([1], 0)


def test_the_state_records_which_stop_string_ended_the_reply() -> None:
    stopped = state(stop=("END", "wor"))
    stopped.commit([1, 2, 3])
    assert stopped.stop_string == "wor"
    by_eos = state(stop=("END",))
    by_eos.commit([1, EOS])
    assert by_eos.finish_reason == "stop"
    assert by_eos.stop_string is None


def test_params_within_the_context_clamp_the_budget_and_take_the_models_eos() -> None:
    """An endpoint's parameters (no budget, or one past the context) fitted to a prompt."""
    greedy = SamplingParams(temperature=0.0)
    asked = GenerationParams(None, greedy, ("\n",), top_logprobs=2)
    with pytest.raises(ValueError, match="budget"):
        _ = asked.budget  # not fitted yet: the loop must not guess one
    fitted = asked.within(40, frozenset({EOS}))
    assert (fitted.budget, fitted.eos_token_ids) == (40, frozenset({EOS}))
    assert (fitted.stop, fitted.top_logprobs, fitted.sampling) == (("\n",), 2, greedy)
    assert GenerationParams(500, greedy).within(40, frozenset()).budget == 40
    assert GenerationParams(8, greedy).within(40, frozenset()).budget == 8
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationParams(0, greedy)
