"""Planner with the links between workers (issue 34): the hop between two worker stages is
the link they reported between them, not the host's link to the later one; a slow link
between two workers keeps them apart, or moves the cut, and never breaks a plan."""

from __future__ import annotations

import dataclasses
import random

import pytest

from meshnode.errors import PlanError
from meshnode.node.planner import (
    NodeCapacity,
    NodeLink,
    NodeSpeed,
    Plan,
    hop_link,
    hop_seconds,
    plan,
    plan_seconds,
)
from tests.node.test_planner_links import CONTEXT, GB_S, MB_S, MIB, MODEL, layers

SLOW = 0.05 * MB_S  # a token's 64 KiB take 1.3 s


def node(
    name: str,
    mib: int,
    rate: float | None,
    *links: NodeLink,
    link: float = GB_S,
    rtt_s: float = 0.001,
) -> NodeCapacity:
    speed = None if rate is None else NodeSpeed(rate * GB_S)
    return NodeCapacity(
        name, mib * MIB, rtt_s=rtt_s, speed=speed, link_bytes_per_s=link, links=links
    )


@pytest.mark.parametrize(
    ("into", "after", "expected"),
    [
        # from the host: the host's own link, whatever the worker says of it
        (node("b", 100, 1.0, NodeLink("h", 0.5, SLOW)), None, (0.001, GB_S)),
        # nothing reported between them: the host's link to the later one
        (node("b", 100, 1.0), node("a", 100, 1.0), (0.001, GB_S)),
        # one end reported: its figures
        (node("b", 100, 1.0), node("a", 100, 1.0, NodeLink("b", 0.004, SLOW)), (0.004, SLOW)),
        (node("b", 100, 1.0, NodeLink("a", 0.004, SLOW)), node("a", 100, 1.0), (0.004, SLOW)),
        # both ends: the slower figure of each (a can make the link slower, not faster)
        (
            node("b", 100, 1.0, NodeLink("a", 0.002, SLOW)),
            node("a", 100, 1.0, NodeLink("b", 0.009, 10 * GB_S)),
            (0.009, SLOW),
        ),
        # a round trip without a measured rate: the host's rate stands in for it
        (node("b", 100, 1.0), node("a", 100, 1.0, NodeLink("b", 0.004)), (0.004, GB_S)),
        # a report about another peer changes nothing
        (node("b", 100, 1.0), node("a", 100, 1.0, NodeLink("c", 0.5, SLOW)), (0.001, GB_S)),
    ],
)
def test_the_hop_between_two_workers_is_the_link_they_reported(
    into: NodeCapacity, after: NodeCapacity | None, expected: tuple[float, float]
) -> None:
    assert hop_link(into, after) == expected
    rtt, rate = expected
    assert hop_seconds(MODEL, into, 256, after=after) == pytest.approx(
        rtt + 256 * MODEL.activation_bytes_per_token / rate
    )


A_B_SLOW = NodeLink("b", 0.001, SLOW)


@pytest.mark.parametrize(
    ("live", "expected"),
    [
        # Three stages are needed (60 MiB each); by memory and id the plan is h, a, b...
        ([node("h", 60, None), node("a", 60, None), node("b", 60, None), node("c", 60, None)],
         [("h", 9), ("a", 11), ("b", 10)]),
        # ...but a reported a slow link to b: c follows a instead.
        ([node("h", 60, None), node("a", 60, None, A_B_SLOW), node("b", 60, None),
          node("c", 60, None)],
         [("h", 9), ("a", 11), ("c", 10)]),
        # The same measured: the slow link keeps a and b apart.
        ([node("h", 60, 1.0), node("a", 60, 1.0, A_B_SLOW), node("b", 60, 1.0),
          node("c", 60, 1.0)],
         [("h", 10), ("a", 10), ("c", 10)]),
        # A slow host and two fast workers that each hold half: three stages...
        ([node("h", 1000, 0.1), node("a", 80, 1.0), node("b", 80, 1.0)],
         [("h", 1), ("a", 15), ("b", 14)]),
        # ...until the link between the workers is slow: the cut moves to two stages (a
        # token's 1.3 s over the a-b link is longer than the host's 14 more layers).
        ([node("h", 1000, 0.1), node("a", 80, 1.0, A_B_SLOW), node("b", 80, 1.0)],
         [("h", 15), ("a", 15)]),
        # b says it too, with a faster figure: the slower one counts.
        ([node("h", 1000, 0.1), node("a", 80, 1.0, A_B_SLOW),
          node("b", 80, 1.0, NodeLink("a", 0.001, 10 * GB_S))],
         [("h", 15), ("a", 15)]),
    ],
)  # fmt: skip
def test_a_slow_link_between_two_workers_moves_the_plan(
    live: list[NodeCapacity], expected: list[tuple[str, int]]
) -> None:
    result = plan(MODEL, live, host_id="h", context_tokens=CONTEXT)
    assert layers(result) == expected


def test_the_slow_link_is_counted_in_the_predicted_token_time() -> None:
    """plan_seconds (the re-placement's yardstick) counts the hop between the workers."""
    fast = [node("h", 1000, 0.1), node("a", 80, 1.0), node("b", 80, 1.0)]
    slow = [fast[0], node("a", 80, 1.0, A_B_SLOW), fast[2]]
    stages = plan(MODEL, fast, host_id="h", context_tokens=CONTEXT).stages
    before, after = plan_seconds(MODEL, fast, stages), plan_seconds(MODEL, slow, stages)
    assert before is not None
    assert after is not None
    transfer = MODEL.activation_bytes_per_token / SLOW
    assert after[0] == pytest.approx(before[0] + transfer - MODEL.activation_bytes_per_token / GB_S)
    assert after[1] == pytest.approx(transfer)  # the link is the slowest stage now


def _plan(live: list[NodeCapacity], split: int | None) -> Plan | None:
    try:
        return plan(MODEL, live, host_id="h", context_tokens=CONTEXT, split=split)
    except PlanError:
        return None


def test_links_between_workers_never_give_a_slower_plan_than_ignoring_them() -> None:
    """Planned with the workers' links, a token is never predicted slower (with those links
    counted) than the plan made without them, on the same nodes."""
    rng = random.Random(34)
    names = ["h", "a", "b", "c", "d"]
    compared = 0
    for _ in range(120):
        count = rng.randint(3, 5)
        live = []
        for name in names[:count]:
            reports = [
                NodeLink(peer, rng.choice([0.0, 0.001, 0.05]), rng.choice([0.0, SLOW, GB_S]))
                for peer in names[1:count]
                if peer != name and rng.random() < 0.5
            ]
            rate = rng.choice([0.05, 0.3, 1.0, rng.uniform(0.1, 3)])
            mib = rng.randint(40, 300)
            live.append(node(name, mib, rate, *reports, link=rng.choice([0.0, MB_S, GB_S])))
        split = rng.choice([None, count])
        blind = _plan([dataclasses.replace(n, links=()) for n in live], split)
        linked = _plan(live, split)
        assert (blind is None) == (linked is None)  # links never decide whether it fits
        if blind is None or linked is None:
            continue
        ours, theirs = (
            plan_seconds(MODEL, live, linked.stages),
            plan_seconds(MODEL, live, blind.stages),
        )
        assert ours is not None
        assert theirs is not None
        assert ours[0] <= theirs[0] + 1e-12, (live, layers(linked), layers(blind))
        compared += 1
    assert compared > 60


@pytest.mark.parametrize(
    ("rtt_s", "rate"), [(-1.0, 0.0), (float("nan"), 0.0), (0.0, float("inf")), (0.0, -5.0)]
)
def test_a_node_link_must_be_finite_and_not_negative(rtt_s: float, rate: float) -> None:
    with pytest.raises(ValueError, match="must be >= 0 and finite"):
        NodeLink("a", rtt_s, rate)
