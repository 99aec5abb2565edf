"""Planner, larger than memory (issue 34): weights past the mesh's memory served from the
memory-mapped file, spread over the nodes by memory; KV always in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from meshnode_packaging.refs import open_ref

from meshnode.engine.backend import CpuBackend
from meshnode.errors import PlanError
from meshnode.node.coordinator import Coordinator
from meshnode.node.mesh import CoordinatorSettings
from meshnode.node.planner import plan
from meshnode.node.remote import RemotePipeline
from tests.node.inmemory import BRING_UP_TIMEOUT_S, InMemoryMesh, decode, greedy_reference
from tests.node.inmemory import CONTEXT as TINY_CONTEXT
from tests.node.test_planner import CONTEXT, MIB, MODEL, nodes

# The model needs 161 MiB at CONTEXT (120 of layers, 30 of KV, 10 + 1 of embedding and
# head); these three nodes offer 150.
SHORT = nodes(("h", 60), ("a", 60), ("b", 30))


def test_without_disk_offload_a_short_mesh_waits_for_nodes() -> None:
    with pytest.raises(PlanError, match=r"11 MiB missing.*--no-disk-offload"):
        plan(MODEL, SHORT, "h", CONTEXT)


def test_disk_offload_places_the_model_on_every_node_and_offloads_only_weights() -> None:
    placed = plan(MODEL, SHORT, "h", CONTEXT, disk_offload=True)
    assert [s.node_id for s in placed.stages] == ["h", "a", "b"]
    assert placed.stages[0].start == 0
    assert placed.stages[-1].end == MODEL.n_layers
    for before, after in zip(placed.stages, placed.stages[1:], strict=False):
        assert before.end == after.start
    memory = {n.node_id: n.usable_memory_bytes for n in SHORT}
    offload = {s.node_id: s.offload_bytes for s in placed.stages}
    for stage in placed.stages:
        assert stage.offload_bytes == max(0, stage.memory_bytes - memory[stage.node_id])
        kv = MODEL.kv_bytes(stage.start, stage.end, CONTEXT, "cpu")
        assert kv <= memory[stage.node_id]  # KV never on disk
        assert stage.offload_bytes <= sum(MODEL.layer_bytes[stage.start : stage.end]) + 11 * MIB
    # the shortfall is covered, and shared by memory: no node offloads past its fair share
    # of it by more than a layer
    assert sum(offload.values()) >= 11 * MIB
    fraction = max(s.memory_bytes / memory[s.node_id] for s in placed.stages)
    assert fraction < 161 / 150 + 4 * MIB / (30 * MIB)


def test_a_mesh_whose_memory_cannot_even_hold_the_kv_is_refused() -> None:
    tiny = nodes(("h", 8), ("a", 8))  # 16 MiB for 30 MiB of KV
    with pytest.raises(PlanError, match="not even with disk offload"):
        plan(MODEL, tiny, "h", CONTEXT, disk_offload=True)


def test_a_mesh_that_fits_never_offloads() -> None:
    roomy = nodes(("h", 100), ("a", 100))
    assert plan(MODEL, roomy, "h", CONTEXT, disk_offload=True) == plan(MODEL, roomy, "h", CONTEXT)
    assert all(s.offload_bytes == 0 for s in plan(MODEL, roomy, "h", CONTEXT).stages)


async def test_a_host_short_of_memory_serves_from_disk_with_read_ahead(
    hub_ref: tuple[str, Path],
) -> None:
    """Alone, with memory for its KV and half its weights: with disk offload the host serves it (the
    one-node tokens), reading its layers ahead; the status shows the offloaded bytes."""
    ref, package = hub_ref
    source = open_ref(package)
    mesh = InMemoryMesh(host_memory=0)  # set below, from the host's own footprint
    served: list[RemotePipeline] = []
    ready = trio.Event()

    def on_pipeline(pipeline: RemotePipeline | None) -> None:
        if pipeline is not None:
            served.append(pipeline)
            ready.set()

    settings = CoordinatorSettings(model_ref=ref, context_size=TINY_CONTEXT, disk_offload=True)
    coordinator = Coordinator(
        mesh, settings, source=source, backend=CpuBackend("native"), on_pipeline=on_pipeline
    )
    mesh.coordinator = coordinator
    footprint = coordinator.footprint
    kv = footprint.kv_bytes(0, footprint.n_layers, coordinator.context_size, "cpu")
    mesh.host_memory = kv + sum(footprint.fixed_layer_bytes) + sum(footprint.layer_bytes) // 2
    async with trio.open_nursery() as nursery:
        nursery.start_soon(coordinator.run)
        with trio.move_on_after(BRING_UP_TIMEOUT_S):
            await ready.wait()
        assert ready.is_set(), coordinator.status()["error"]  # no plan: it says why
        (stage,) = coordinator.status()["stages"]
        assert stage["offload_bytes"] > 0
        assert served[0].runner.stage.read_ahead is not None
        assert await decode(served[0]) == greedy_reference(package)
        nursery.cancel_scope.cancel()
