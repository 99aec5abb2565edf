"""N-gram index and proposer: longest-suffix lookup, incremental updates, overlap copy."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.speculative.ngram import NgramIndex, NgramParams, NgramProposer


def brute_force(history: list[int], min_n: int, max_n: int, count: int) -> list[int]:
    """Reference: rescan for the longest suffix with an earlier occurrence, latest wins."""
    end = len(history)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = history[end - n :]
        for start in range(end - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                out: list[int] = []
                for i in range(count):
                    src = start + n + i
                    out.append(history[src] if src < end else out[src - end])
                return out
    return []


def test_longest_suffix_wins_over_more_recent_short_match() -> None:
    proposer = NgramProposer(NgramParams(min_n=1, max_n=3, max_proposal=3))
    #           0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 10, 11, 3, 20, 2, 3]
    # Suffix (2, 3) occurred at 1..2 followed by 10; suffix (3,) last at 5 followed by 20.
    assert proposer.propose(history, 8).tokens == (10, 11, 3)


def test_latest_occurrence_wins() -> None:
    proposer = NgramProposer(NgramParams(min_n=2, max_n=2, max_proposal=2))
    history = [5, 6, 7, 9, 5, 6, 8, 9, 5, 6]
    assert proposer.propose(history, 4).tokens == (8, 9)


def test_no_match_gives_empty_proposal() -> None:
    proposer = NgramProposer(NgramParams(min_n=2, max_n=3))
    proposal = proposer.propose([1, 2, 3, 4, 5], 4)
    assert proposal.tokens == ()
    assert proposal.probs is None


def test_periodic_history_is_continued_past_its_end() -> None:
    proposer = NgramProposer(NgramParams(min_n=2, max_n=2, max_proposal=6))
    assert proposer.propose([7, 1, 2, 1, 2], 6).tokens == (1, 2, 1, 2, 1, 2)


def test_max_tokens_and_max_proposal_bound_the_proposal() -> None:
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramProposer(NgramParams(max_proposal=2)).propose(history, 8).tokens == (3, 4)
    assert NgramProposer(NgramParams(max_proposal=8)).propose(history, 3).tokens == (3, 4, 5)
    assert NgramProposer().propose(history, 0).tokens == ()


def test_index_is_extended_not_rebuilt() -> None:
    proposer = NgramProposer(NgramParams(min_n=1, max_n=2))
    history = [1, 2, 3]
    proposer.propose(history, 4)
    index = proposer.index
    history += [1, 2]
    assert proposer.propose(history, 4).tokens == (3, 1, 2, 3)
    assert proposer.index is index
    assert len(index) == 5


def test_diverged_history_rebuilds_the_index() -> None:
    proposer = NgramProposer(NgramParams(min_n=1, max_n=2, max_proposal=2))
    proposer.propose([1, 2, 3, 1], 2)
    assert proposer.propose([4, 5, 4], 2).tokens == (5, 4)


def test_repeats_counts_recurring_min_grams() -> None:
    index = NgramIndex(2, 3)
    index.extend([1, 2, 1, 2, 1, 2])
    # Inserted 2-grams (followed by a known token): (1,2) (2,1) (1,2)* (2,1)*  → 2 repeats.
    assert index.repeats == 2


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=60),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(1, 6),
)
def test_incremental_lookup_matches_brute_force(
    history: list[int], min_n: int, extra: int, count: int
) -> None:
    max_n = min_n + extra
    proposer = NgramProposer(NgramParams(min_n, max_n, max_proposal=count))
    # Feed the history in random-sized chunks, checking after every chunk.
    rng = random.Random(len(history))
    seen = 0
    while seen < len(history):
        seen = min(len(history), seen + rng.randint(1, 5))
        got = list(proposer.propose(history[:seen], count).tokens)
        assert got == brute_force(history[:seen], min_n, max_n, count)
