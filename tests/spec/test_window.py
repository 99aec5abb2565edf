"""Window policy: fixed stays put, adaptive grows on full acceptance and halves early."""

from __future__ import annotations

import pytest

from meshnode.spec.window import WindowPolicy, next_window

ADAPTIVE = WindowPolicy("adaptive", initial_window=4, min_window=2, max_window=6)


@pytest.mark.parametrize(
    ("window", "proposed", "accepted", "expected"),
    [
        (4, 4, 4, 5),  # full window accepted: grow by one
        (6, 6, 6, 6),  # … but never past max_window
        (4, 2, 2, 4),  # a short proposal fully accepted says nothing about the window
        (4, 4, 1, 2),  # rejected in the first half: halve
        (2, 2, 0, 2),  # … but never under min_window
        (6, 6, 2, 3),
        (4, 4, 2, 4),  # rejected at the half: keep
        (4, 4, 3, 4),
        (4, 0, 0, 4),  # a plain step: keep
    ],
)
def test_adaptive_updates(window: int, proposed: int, accepted: int, expected: int) -> None:
    assert next_window(ADAPTIVE, window, proposed, accepted) == expected


def test_adaptive_walks_within_bounds() -> None:
    window = ADAPTIVE.initial_window
    seen = set()
    for accepted_all in [True] * 5 + [False] * 5 + [True] * 2:
        window = next_window(ADAPTIVE, window, window, window if accepted_all else 0)
        seen.add(window)
    assert seen == {2, 3, 4, 5, 6}
    assert window == 4


@pytest.mark.parametrize(("proposed", "accepted"), [(4, 4), (4, 0), (3, 1), (0, 0)])
def test_fixed_never_moves(proposed: int, accepted: int) -> None:
    policy = WindowPolicy("fixed", initial_window=4, min_window=1, max_window=8)
    assert next_window(policy, 4, proposed, accepted) == 4


@pytest.mark.parametrize(
    ("kind", "initial", "low", "high"),
    [("adaptive", 1, 2, 4), ("adaptive", 5, 2, 4), ("adaptive", 0, 0, 4), ("sliding", 2, 1, 4)],
)
def test_invalid_policies_are_refused(kind: str, initial: int, low: int, high: int) -> None:
    with pytest.raises(ValueError, match="window"):
        WindowPolicy(kind, initial, low, high)  # type: ignore[arg-type]
