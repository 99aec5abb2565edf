"""Window policy: fixed stays put; adaptive maximises tokens per second of measured cost."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from meshnode.speculative.window import (
    STALE_AFTER_STEPS,
    StepCosts,
    Window,
    WindowPolicy,
    best_window,
    expected_tokens,
)

ADAPTIVE = WindowPolicy("adaptive", initial_window=4, min_window=1, max_window=16)

# Step seconds by draft count as measured on the development CPU (benchmarks/engine.py,
# "k-token forward"): a GEMM of 5-9 rows costs about what one of 3-4 does.
CPU = {1: 1.2, 2: 1.44, 3: 1.9, 4: 1.97, 8: 1.75, 16: 2.24}
# A linear cost: each draft costs a tenth of the verify pass (a draft model).
LINEAR = {k: 1.0 + 0.1 * k for k in range(1, 17)}


def costs_of(table: dict[int, float]) -> StepCosts:
    costs = StepCosts()
    for drafts, seconds in table.items():
        costs.record(drafts, seconds)
    return costs


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0, 0.7) == 1.0
    assert expected_tokens(3, 0.5) == pytest.approx(1.875)
    assert expected_tokens(8, 1.0) == 9.0


def test_cost_estimates_interpolate_and_stay_flat_past_the_largest() -> None:
    costs = costs_of({2: 1.5, 6: 3.0})
    assert costs.estimate(2) == 1.5
    assert costs.estimate(4) == pytest.approx(2.25)  # between measured sizes: linear
    assert costs.estimate(10) == 3.0  # past the largest: optimistic, flat
    assert costs.estimate(1) == pytest.approx(1.0)  # below the smallest: by rows, 2 of 3
    costs.record(0, 0.9)  # a plain step
    assert costs.estimate(1) == pytest.approx(1.2)
    assert StepCosts().estimate(3) is None


def test_costs_are_averaged() -> None:
    costs = StepCosts()
    costs.record(4, 1.0)
    costs.record(4, 2.0)
    assert 1.0 < (costs.estimate(4) or 0) < 2.0


@pytest.mark.parametrize(
    ("table", "rate", "expected"),
    [
        (CPU, 0.7, 8),  # the flat part of the curve: take the big window that costs less
        (CPU, 0.9, 13),  # between measured sizes the cost is interpolated
        (CPU, 0.3, 1),  # few drafts survive: one row more is all that pays
        (LINEAR, 0.9, 10),
        (LINEAR, 0.2, 1),
        ({}, 0.9, 4),  # nothing measured: nothing to weigh, the window stays
        ({3: 1.0}, 0.9, 16),  # one size measured: larger ones may cost the same, try one
        ({k: 1.0 for k in range(1, 17)}, 0.0, 1),  # nothing survives: ties go to the smallest
    ],
)
def test_best_window(table: dict[int, float], rate: float, expected: int) -> None:
    assert best_window(ADAPTIVE, costs_of(table), rate, current=4) == expected


@given(
    rates=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    table=st.dictionaries(st.integers(1, 16), st.floats(0.1, 10), min_size=1),
)
# Equal costs, where the gain of one more draft falls under the rounding tolerance: comparing
# each size with the best so far picked 13 for the first rate and 12 for the second.
@example(rates=(0.101, 0.102), table={1: 1.0})
def test_a_higher_accept_rate_never_shrinks_the_window(
    rates: tuple[float, float], table: dict[int, float]
) -> None:
    low, high = sorted(rates)
    costs = costs_of(table)
    assert best_window(ADAPTIVE, costs, low, 4) <= best_window(ADAPTIVE, costs, high, 4)


def test_full_acceptance_grows_and_rejection_shrinks() -> None:
    costs = costs_of(LINEAR)
    window = Window(ADAPTIVE, costs)
    sizes = []
    for accepted_all in [True] * 6 + [False] * 6:
        size = window.size
        window.update(size, size if accepted_all else 0)
        sizes.append(window.size)
    assert sizes[:6] == sorted(sizes[:6])
    assert sizes[5] > ADAPTIVE.initial_window
    assert sizes[6:] == sorted(sizes[6:], reverse=True)
    assert sizes[-1] < ADAPTIVE.initial_window
    assert all(ADAPTIVE.min_window <= s <= ADAPTIVE.max_window for s in sizes)


def test_adaptive_window_tries_a_larger_size_and_keeps_it_only_if_it_pays() -> None:
    """Costs are learnt from the steps: a size that turns out dear is given up."""
    true_cost = {k: 1.0 + 0.01 * k if k <= 4 else 5.0 for k in range(1, 17)}
    window = Window(ADAPTIVE)
    window.update(4, 4, seconds=100.0)  # the first pass pays one-time work: not a cost
    assert window.costs.seconds == {}
    tried = set()
    for _ in range(12):
        size = window.size
        tried.add(size)
        window.update(size, size, seconds=true_cost[size])  # every draft accepted
    assert max(tried) > 4  # it explored beyond the initial window …
    assert window.size == 4  # … and came back to the best one


def test_plain_steps_and_fixed_policies_leave_the_window_alone() -> None:
    fixed = Window(WindowPolicy("fixed", initial_window=4, min_window=1, max_window=8))
    for proposed, accepted in [(4, 4), (4, 0), (3, 1)]:
        fixed.update(proposed, accepted, seconds=1.0)
        assert fixed.size == 4
    adaptive = Window(ADAPTIVE)
    adaptive.update(0, 0, seconds=1.0)
    assert adaptive.size == ADAPTIVE.initial_window
    assert adaptive.costs.seconds == {0: 1.0}  # a plain step's cost is size 0's


@pytest.mark.parametrize(
    ("kind", "initial", "low", "high"),
    [("adaptive", 1, 2, 4), ("adaptive", 5, 2, 4), ("adaptive", 0, 0, 4), ("sliding", 2, 1, 4)],
)
def test_invalid_policies_are_refused(kind: str, initial: int, low: int, high: int) -> None:
    with pytest.raises(ValueError, match="window"):
        WindowPolicy(kind, initial, low, high)  # type: ignore[arg-type]


def test_one_slow_step_does_not_rule_a_size_out_for_good() -> None:
    """A size measured once during a spike is tried again once its cost has gone stale."""
    window = Window(ADAPTIVE)
    window.update(4, 4, seconds=1.0)  # first pass: not counted
    window.update(4, 4, seconds=1.0)
    assert window.size == 16  # larger may cost the same: try it
    window.update(16, 16, seconds=50.0)  # … during a spike: 16 looks dear
    sizes = []
    for _ in range(STALE_AFTER_STEPS + 2):
        size = window.size
        sizes.append(size)
        window.update(size, size, seconds=1.0)  # in truth every size costs the same
    assert sizes[0] < 16
    assert sizes[-1] == 16
