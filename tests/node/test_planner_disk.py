"""Planner, larger than memory with measured disks (issue 34): the bytes past a node's
memory are timed at its disk's read rate; a missing disk rate means memory weighting."""

from __future__ import annotations

import random

import pytest

from meshnode.node.planner import NodeCapacity, NodeSpeed, Plan, plan, plan_seconds
from tests.node.test_planner import CONTEXT, MIB, MODEL

GB_S = 1e9


def node(name: str, mib: int, compute: float, disk: float) -> NodeCapacity:
    return NodeCapacity(name, mib * MIB, speed=NodeSpeed(compute * GB_S, disk * GB_S))


def bare(live: list[NodeCapacity]) -> list[NodeCapacity]:
    return [NodeCapacity(n.node_id, n.usable_memory_bytes) for n in live]


def token_s(result: Plan, live: list[NodeCapacity]) -> float:
    timed = plan_seconds(MODEL, live, result.stages)
    assert timed is not None
    return timed[0]


# The model needs 161 MiB at CONTEXT; these nodes offer 150 (test_planner_offload.SHORT).
@pytest.mark.parametrize(
    ("live", "most_offloaded"),
    [
        # equal compute, b's disk ten times a's: b reads the shortfall, not a
        ([node("h", 60, 1, 0.1), node("a", 60, 1, 0.1), node("b", 30, 1, 1.0)], "b"),
        ([node("h", 60, 1, 1.0), node("a", 60, 1, 0.05), node("b", 30, 1, 0.05)], "h"),
    ],
)
def test_the_fast_disk_reads_the_shortfall(live: list[NodeCapacity], most_offloaded: str) -> None:
    placed = plan(MODEL, live, "h", CONTEXT, disk_offload=True)
    weighted = plan(MODEL, bare(live), "h", CONTEXT, disk_offload=True)
    assert placed.measured
    assert not weighted.measured
    offload = {s.node_id: s.offload_bytes for s in placed.stages}
    assert max(offload, key=lambda n: offload[n]) == most_offloaded
    assert token_s(placed, live) < token_s(weighted, live)
    memory = {n.node_id: n.usable_memory_bytes for n in live}
    for stage in placed.stages:  # KV never on disk; offload is exactly what passes memory
        assert MODEL.kv_bytes(stage.start, stage.end, CONTEXT, "cpu") <= memory[stage.node_id]
        assert stage.offload_bytes == max(0, stage.memory_bytes - memory[stage.node_id])


def test_a_node_without_a_disk_rate_means_memory_weighting() -> None:
    live = [node("h", 60, 1, 1.0), node("a", 60, 1, 1.0)]
    live.append(NodeCapacity("b", 30 * MIB, speed=NodeSpeed(1 * GB_S)))  # disk not measured
    placed = plan(MODEL, live, "h", CONTEXT, disk_offload=True)
    assert not placed.measured
    assert placed == plan(MODEL, bare(live), "h", CONTEXT, disk_offload=True)


def test_never_slower_than_memory_weighting_from_disk() -> None:
    """A table of random meshes: the measured plan's token is never slower."""
    rng = random.Random(34)
    for _ in range(40):
        live = [
            node(name, rng.choice([30, 45, 60]), rng.uniform(0.2, 4), rng.uniform(0.02, 3))
            for name in ("h", "a", "b")
        ]
        placed = plan(MODEL, live, "h", CONTEXT, disk_offload=True)
        weighted = plan(MODEL, bare(live), "h", CONTEXT, disk_offload=True)
        assert token_s(placed, live) <= token_s(weighted, live)
        assert placed.measured == (placed.stages != weighted.stages)


@pytest.mark.parametrize("disk", [float("nan"), -1.0, float("inf")])
def test_a_disk_rate_must_be_finite_and_not_negative(disk: float) -> None:
    with pytest.raises(ValueError, match="disk_bytes_per_s"):
        NodeSpeed(1e9, disk)
