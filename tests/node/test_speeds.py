"""SpeedBook: one-row passes only, medians, bounds; worth_replacing's margin."""

from __future__ import annotations

import pytest

from meshnode.node.planner import NodeSpeed
from meshnode.node.speeds import MIN_SAMPLES, SpeedBook, worth_replacing


def test_a_node_is_measured_after_enough_one_row_passes() -> None:
    book = SpeedBook()
    for _ in range(MIN_SAMPLES - 1):
        book.observe("a", 1000, 0.001, rows=1)
    assert book.speed("a") is None
    book.observe("a", 1000, 0.001, rows=1)
    assert book.speed("a") == NodeSpeed(1e6)
    assert dict(book.speeds()) == {"a": NodeSpeed(1e6)}


def test_the_median_ignores_one_slow_pass() -> None:
    book = SpeedBook()
    for seconds in (0.001, 0.001, 0.5, 0.001, 0.001):
        book.observe("a", 1000, seconds, rows=1)
    assert book.speed("a") == NodeSpeed(1e6)


def test_a_node_that_slows_down_is_followed_within_the_window() -> None:
    book = SpeedBook(window=8)
    for _ in range(8):
        book.observe("a", 1000, 0.001, rows=1)
    for _ in range(5):
        book.observe("a", 1000, 0.01, rows=1)
    assert book.speed("a") == NodeSpeed(1e5)


@pytest.mark.parametrize(
    ("weight_bytes", "seconds", "rows"),
    [
        (1000, 0.001, 8),  # batched: not a per-token rate
        (1000, 0.0, 1),  # no time
        (1000, -1.0, 1),  # a clock that went backwards
        (1000, float("nan"), 1),
        (0, 0.001, 1),  # a stage without weights
        (10**15, 1e-6, 1),  # faster than any memory: a lie
    ],
)
def test_impossible_or_batched_passes_are_dropped(
    weight_bytes: int, seconds: float, rows: int
) -> None:
    book = SpeedBook()
    for _ in range(MIN_SAMPLES):
        book.observe("a", weight_bytes, seconds, rows=rows)
    assert book.speed("a") is None


def test_forget() -> None:
    book = SpeedBook()
    for _ in range(MIN_SAMPLES):
        book.observe("a", 1000, 0.001, rows=1)
    book.forget("a")
    assert book.speed("a") is None


@pytest.mark.parametrize(
    ("current", "wanted", "expected"),
    [(1.0, 0.79, True), (1.0, 0.8, False), (1.0, 0.95, False), (1.0, 1.2, False)],
)
def test_worth_replacing_needs_a_real_gain(current: float, wanted: float, expected: bool) -> None:
    assert worth_replacing(current, wanted) is expected
