"""SpeedBook: one-row passes only, medians, bounds; worth_replacing's margin;
should_replace over plans."""

from __future__ import annotations

import dataclasses

import pytest

from meshnode.node.planner import ModelFootprint, NodeCapacity, NodeSpeed, plan
from meshnode.node.speeds import MIN_SAMPLES, SpeedBook, should_replace, worth_replacing


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
    [
        (1.0, 0.79, True),
        (1.0, 0.8, False),
        (1.0, 0.95, False),
        (1.0, 1.2, False),
        (0.02, 0.01, True),
        (0.008, 0.004, False),  # half the time, but 4 ms: not worth a Load of every stage
    ],
)
def test_worth_replacing_needs_a_real_gain(current: float, wanted: float, expected: bool) -> None:
    assert worth_replacing(current, wanted) is expected


# Eight layers of 1 MB, tiny embedding and head; three nodes of equal memory.
MODEL = ModelFootprint((10**6,) * 8, 1000, 1000, 0)
MEMORY = 10**8


def _nodes(rates: dict[str, float | None]) -> list[NodeCapacity]:
    return [
        NodeCapacity(n, MEMORY, speed=None if r is None else NodeSpeed(r)) for n, r in rates.items()
    ]


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        # the last node streams weights at a third of the others' rate: its layers move
        ({"h": 1e8, "a": 1e8, "s": 3e7}, True),
        # equal rates: the measured plan is the memory-weighted one
        ({"h": 1e8, "a": 1e8, "s": 1e8}, False),
        # one node unmeasured: memory weighting, nothing to move to
        ({"h": 1e8, "a": 1e8, "s": None}, False),
        # a tenth slower: the measured plan is faster, but not by the margin
        ({"h": 1e8, "a": 1e8, "s": 9e7}, False),
        # so fast that the whole gain is under MIN_GAIN_S a token
        ({"h": 1e10, "a": 1e10, "s": 3e9}, False),
    ],
)
def test_should_replace_a_memory_weighted_plan_only_for_a_real_gain(
    rates: dict[str, float | None], expected: bool
) -> None:
    unmeasured = _nodes(dict.fromkeys(rates))
    current = plan(MODEL, unmeasured, "h", 16, split=3)
    assert not current.measured
    nodes = _nodes(rates)
    wanted = plan(MODEL, nodes, "h", 16, split=3)
    assert should_replace(MODEL, current, wanted, nodes) is expected
    # once re-placed, the same measurements never move it again
    assert not should_replace(MODEL, wanted, wanted, nodes)


def test_should_replace_needs_every_stage_measured_and_a_plan() -> None:
    nodes = _nodes({"h": 1e8, "a": 1e8, "s": 3e7})
    current = plan(MODEL, _nodes({"h": None, "a": None, "s": None}), "h", 16, split=3)
    wanted = plan(MODEL, nodes, "h", 16, split=3)
    assert wanted.measured
    assert not should_replace(MODEL, current, None, nodes)
    gone = [dataclasses.replace(n, speed=None) if n.node_id == "a" else n for n in nodes]
    assert not should_replace(MODEL, current, wanted, gone)
