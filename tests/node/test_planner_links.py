"""Planner with measured links (issue 34): a hop is its round trip plus the activations it
carries over the host's link to the node; a slow link loses layers, never correctness."""

from __future__ import annotations

import dataclasses
import random

import pytest

from meshnode.errors import PlanError
from meshnode.node.planner import (
    ModelFootprint,
    NodeCapacity,
    NodeSpeed,
    Plan,
    hop_seconds,
    plan,
    plan_seconds,
)

MIB = 1 << 20
GB_S = 1e9
MB_S = 1e6
# 30 layers of 4 MiB, 1 KiB of KV per token per layer, a 10 MiB embedding and a 1 MiB head;
# a token's activations are 64 KiB on the wire (a hidden size of 16,384 at f32): 65 ms
# over a 1 MB/s link, as long as a stage's compute here.
MODEL = ModelFootprint(
    layer_bytes=(4 * MIB,) * 30,
    embed_bytes=10 * MIB,
    head_bytes=1 * MIB,
    kv_bytes_per_token_per_layer=1024,
    activation_bytes_per_token=64 * 1024,
)
CONTEXT = 1024


def node(
    name: str, mib: int, rate: float | None, link: float = 0.0, rtt_s: float = 0.001
) -> NodeCapacity:
    speed = None if rate is None else NodeSpeed(rate * GB_S)
    return NodeCapacity(name, mib * MIB, rtt_s=rtt_s, speed=speed, link_bytes_per_s=link)


def layers(result: Plan) -> list[tuple[str, int]]:
    return [(s.node_id, s.end - s.start) for s in result.stages]


@pytest.mark.parametrize(
    ("rows", "link", "expected_s"),
    [
        (1, 0.0, 0.001),  # unmeasured: the round trip alone
        (1, 1 * MB_S, 0.001 + 65536 / 1e6),
        (256, 1 * MB_S, 0.001 + 256 * 65536 / 1e6),  # a prefill chunk of 256 rows
        (256, 1 * GB_S, 0.001 + 256 * 65536 / 1e9),
    ],
)
def test_a_hop_is_its_round_trip_plus_its_rows_over_the_link(
    rows: int, link: float, expected_s: float
) -> None:
    assert hop_seconds(MODEL, node("a", 100, 1.0, link), rows) == pytest.approx(expected_s)


@pytest.mark.parametrize(
    ("live", "split", "expected"),
    [
        # Two equal workers, one behind a 1 MB/s link: two stages go to the other one,
        # with speeds measured or not (memory ties; the quicker hop wins).
        (
            [node("h", 100, 1.0), node("a", 100, 1.0, 1 * MB_S), node("b", 100, 1.0, GB_S)],
            2,
            [("h", 15), ("b", 15)],
        ),
        (
            [node("h", 100, None), node("a", 100, None, 1 * MB_S), node("b", 100, None, GB_S)],
            2,
            [("h", 14), ("b", 16)],
        ),
        # No --split: the fewest stages that fit (two), on the nearer node.
        (
            [node("h", 100, 1.0), node("a", 100, 1.0, 1 * MB_S), node("b", 100, 1.0, GB_S)],
            None,
            [("h", 15), ("b", 15)],
        ),
        # A node ten times faster behind a slow link: a hop of 66 ms against the 0.1 s a
        # token of its 28 layers would save on the host: still worth it...
        ([node("h", 1000, 0.1), node("fast", 1000, 1.0, 1 * MB_S)], None, [("h", 2), ("fast", 28)]),
        # ...but not behind a link twenty times slower (1.3 s a token's hop, against the
        # host's 1.27 s alone).
        ([node("h", 1000, 0.1), node("fast", 1000, 1.0, 0.05 * MB_S)], None, [("h", 30)]),
        # The more memory wins over the quicker hop when memory is what is short.
        (
            [node("h", 60, None), node("a", 120, None, 1 * MB_S), node("b", 100, None, GB_S)],
            2,
            [("h", 9), ("a", 21)],
        ),
    ],
)
def test_link_aware_plans(
    live: list[NodeCapacity], split: int | None, expected: list[tuple[str, int]]
) -> None:
    result = plan(MODEL, live, host_id="h", context_tokens=CONTEXT, split=split)
    assert layers(result) == expected


def test_a_measured_link_never_gives_a_slower_plan_than_ignoring_it() -> None:
    """Planned with the links, a token is never predicted slower (with the links counted)
    than the plan made without them, on the same nodes."""
    rng = random.Random(11)
    compared = 0
    for _ in range(120):
        count = rng.randint(2, 4)
        live = [
            node(
                name,
                rng.randint(60, 400),
                rng.choice([0.05, 0.3, 1.0, rng.uniform(0.1, 3)]),
                link=0.0 if name == "h" else rng.choice([0.0, 0.1 * MB_S, 1 * MB_S, GB_S]),
                rtt_s=0.0 if name == "h" else rng.choice([0.0, 0.001, 0.05]),
            )
            for name in ["h", "a", "b", "c"][:count]
        ]
        blind = [dataclasses.replace(n, link_bytes_per_s=0.0) for n in live]
        split = rng.choice([None, count])
        try:
            without = plan(MODEL, blind, host_id="h", context_tokens=CONTEXT, split=split)
        except PlanError:
            continue
        with_links = plan(MODEL, live, host_id="h", context_tokens=CONTEXT, split=split)
        ours, theirs = (
            plan_seconds(MODEL, live, with_links.stages),
            plan_seconds(MODEL, live, without.stages),
        )
        assert ours is not None
        assert theirs is not None
        assert ours[0] <= theirs[0] + 1e-12, (live, layers(with_links), layers(without))
        compared += 1
    assert compared > 60


@pytest.mark.parametrize("link", [-1.0, float("nan"), float("inf")])
def test_a_link_must_be_a_finite_rate(link: float) -> None:
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        NodeCapacity("a", MIB, link_bytes_per_s=link)
