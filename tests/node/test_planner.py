"""Planner: table-driven, deterministic, memory-weighted, stage 0 on the host."""

from __future__ import annotations

import pytest

from meshnode.errors import PlanError
from meshnode.node.planner import (
    ModelFootprint,
    NodeCapacity,
    Plan,
    StagePlan,
    plan,
    should_regrow,
)

MIB = 1 << 20
# 30 layers of 4 MiB, 1 KiB of KV per token per layer, a 10 MiB embedding and a 1 MiB head.
MODEL = ModelFootprint(
    layer_bytes=(4 * MIB,) * 30,
    embed_bytes=10 * MIB,
    head_bytes=1 * MIB,
    kv_bytes_per_token_per_layer=1024,
)
CONTEXT = 1024  # 1 MiB of KV per layer


def nodes(*spec: tuple[str, int]) -> list[NodeCapacity]:
    return [NodeCapacity(node_id=name, usable_memory_bytes=mib * MIB) for name, mib in spec]


@pytest.mark.parametrize(
    ("live", "split", "expected"),
    [
        # Everything fits on the host: one stage, whatever else is alive.
        (nodes(("h", 1000), ("a", 1000)), None, [("h", 0, 30)]),
        # The host alone is too small: the fewest stages that fit, memory-weighted.
        # (host 10 + 14 * 5 = 80 MiB, other 1 + 16 * 5 = 81 MiB: the smallest worst stage).
        (nodes(("h", 100), ("a", 100)), None, [("h", 0, 14), ("a", 14, 30)]),
        # Twice the memory takes about twice the layers (55/60 vs 106/120 MiB).
        (nodes(("h", 60), ("a", 120)), None, [("h", 0, 9), ("a", 9, 30)]),
        # --split forces the count even when fewer stages would fit.
        (
            nodes(("h", 1000), ("b", 1000), ("a", 1000)),
            3,
            [("h", 0, 9), ("a", 9, 20), ("b", 20, 30)],
        ),
        # Bigger nodes are chosen first among the others; the host stays stage 0.
        (nodes(("h", 100), ("small", 40), ("big", 200)), None, [("h", 0, 9), ("big", 9, 30)]),
    ],
)
def test_plans(
    live: list[NodeCapacity], split: int | None, expected: list[tuple[str, int, int]]
) -> None:
    result = plan(MODEL, live, host_id="h", context_tokens=CONTEXT, split=split)
    assert [(s.node_id, s.start, s.end) for s in result.stages] == expected
    assert result.stages[0].embed
    assert result.stages[-1].head
    memory = {node.node_id: node.usable_memory_bytes for node in live}
    assert all(stage.memory_bytes <= memory[stage.node_id] for stage in result.stages)


def test_contiguous_and_complete() -> None:
    live = nodes(("h", 70), ("a", 50), ("b", 90), ("c", 33))
    result = plan(MODEL, live, host_id="h", context_tokens=CONTEXT, split=4)
    starts = [s.start for s in result.stages]
    ends = [s.end for s in result.stages]
    assert starts[0] == 0
    assert ends[-1] == MODEL.n_layers
    assert starts[1:] == ends[:-1]
    assert all(s.end > s.start for s in result.stages)


def test_deterministic_whatever_the_input_order() -> None:
    live = nodes(("h", 70), ("a", 70), ("b", 70))
    first = plan(MODEL, live, host_id="h", context_tokens=CONTEXT, split=3)
    second = plan(MODEL, list(reversed(live)), host_id="h", context_tokens=CONTEXT, split=3)
    assert first == second


def test_rtt_breaks_memory_ties() -> None:
    live = [
        NodeCapacity("h", 100 * MIB),
        NodeCapacity("far", 100 * MIB, rtt_s=0.050),
        NodeCapacity("near", 100 * MIB, rtt_s=0.001),
    ]
    result = plan(MODEL, live, host_id="h", context_tokens=CONTEXT)
    assert result.node_ids == ("h", "near")


def test_tied_head_puts_the_embedding_on_the_last_stage_too() -> None:
    tied = ModelFootprint(
        layer_bytes=MODEL.layer_bytes,
        embed_bytes=MODEL.embed_bytes,
        head_bytes=MODEL.head_bytes,
        kv_bytes_per_token_per_layer=MODEL.kv_bytes_per_token_per_layer,
        tied_head=True,
    )
    result = plan(tied, nodes(("h", 100), ("a", 100)), host_id="h", context_tokens=CONTEXT)
    last = result.stages[-1]
    layers = last.end - last.start
    assert last.memory_bytes == layers * 5 * MIB + 10 * MIB + 1 * MIB


def test_impossible_fit_says_how_much_is_missing() -> None:
    # Needs 30 * 5 + 10 + 1 = 161 MiB; two nodes offer 120.
    with pytest.raises(PlanError, match="41 MiB missing"):
        plan(MODEL, nodes(("h", 60), ("a", 60)), host_id="h", context_tokens=CONTEXT)


def test_split_larger_than_the_mesh_is_refused() -> None:
    with pytest.raises(PlanError, match="--split 3"):
        plan(MODEL, nodes(("h", 1000), ("a", 1000)), host_id="h", context_tokens=CONTEXT, split=3)


def test_host_must_be_alive() -> None:
    with pytest.raises(PlanError, match="host"):
        plan(MODEL, nodes(("a", 1000)), host_id="h", context_tokens=CONTEXT)


def placed(*node_ids: str) -> Plan:
    """A plan over ``node_ids`` (layer ranges do not matter to ``should_regrow``)."""
    stages = tuple(
        StagePlan(node_id, i, i + 1, embed=i == 0, head=i == len(node_ids) - 1, memory_bytes=0)
        for i, node_id in enumerate(node_ids)
    )
    return Plan(stages=stages, context_tokens=CONTEXT)


@pytest.mark.parametrize(
    ("current", "wanted", "split", "degraded", "expected"),
    [
        # --split 2 shrank to the host alone after a loss; the worker is back: grow back.
        (placed("h"), placed("h", "a"), 2, True, True),
        # ... and the same when the one-stage plan was not marked degraded.
        (placed("h"), placed("h", "a"), 2, False, True),
        # The split's nodes are not all back yet: nothing to move to.
        (placed("h"), None, 2, True, False),
        # Already at the asked split, the planner now prefers other nodes (RTT noise): stay.
        (placed("h", "a"), placed("h", "b"), 2, True, False),
        # --split 3 degraded to 2 stages, 3 live again: grow back.
        (placed("h", "a"), placed("h", "a", "b"), 3, True, True),
        # No split, after a loss: the planner's choice is live again, move to it.
        (placed("h", "b"), placed("h", "a"), None, True, True),
        # No split, a healthy plan: a node joining does not re-place the model.
        (placed("h", "b"), placed("h", "a"), None, False, False),
        # The same nodes: nothing to do, degraded or not.
        (placed("h", "a"), placed("h", "a"), None, True, False),
    ],
)
def test_should_regrow(
    current: Plan, wanted: Plan | None, split: int | None, degraded: bool, expected: bool
) -> None:
    assert should_regrow(current, wanted, split=split, degraded=degraded) is expected
