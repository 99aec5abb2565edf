"""The host's part of ``GET /v1/mesh/status`` (``meshnode status``, the web console): the
coordinator's run, why it is not serving, and each stage of its plan with its progress,
memory, measured speeds and the hop into it.

Read-only: built from the coordinator's state each time the status is asked for.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

from meshnode.node.bringup import BringUp, StageState
from meshnode.node.claims import ClaimBook
from meshnode.node.decisions import CoordinatorState
from meshnode.node.links import STATUS_PREFILL_ROWS, link_status
from meshnode.node.mesh import CoordinatorSettings, MeshView
from meshnode.node.planner import ModelFootprint, NodeCapacity, Plan, StagePlan
from meshnode.node.speeds import SpeedBook


class Shown(Protocol):
    """What the status reads of the coordinator."""

    mesh: MeshView
    settings: CoordinatorSettings
    footprint: ModelFootprint
    context_size: int
    speeds: SpeedBook
    claims: ClaimBook
    decided: CoordinatorState
    run_id: str
    calibration: str


def host_status(
    coordinator: Shown,
    term: int,
    state: str,
    placed: Plan | None,
    run: BringUp | None,
    *,
    retry_at: float | None,
) -> dict[str, Any]:
    """The status of ``coordinator`` at ``term`` in ``state``, serving (or bringing up, in
    ``run``) the plan ``placed``; ``retry_at``: the trio time of its next try, while it
    backs off."""
    now = trio.current_time()
    decided = coordinator.decided
    nodes = {n.node_id: coordinator.claims.linked(n) for n in coordinator.mesh.live_nodes()}
    planned = placed.stages if placed else ()
    stages = [
        stage_status(stage, run, coordinator, nodes, planned[i - 1] if i else None)
        for i, stage in enumerate(planned)
    ]
    return {
        "model": coordinator.settings.model_ref,
        "run_id": coordinator.run_id,
        "term": term,
        "state": state,
        "error": str(decided.error or ""),
        "retry_in_s": retry_in(retry_at, now),
        "last_failure": str(decided.last_failure or ""),
        "context_size": coordinator.context_size,
        "wire_dtype": coordinator.settings.wire_dtype,
        "stages": stages,
        # what the serving plan's layer split follows: "speed" once every node is
        # measured and that is faster (docs/architecture.md, "Placement"), else "memory"
        "placed_by": "speed" if placed and placed.measured else "memory",
        "calibration": coordinator.calibration,
        "cooling_off": decided.cooling_off(now),
    }


def retry_in(retry_at: float | None, now: float) -> float | None:
    """Seconds until the next bring-up while backing off (``None``: not backing off)."""
    return None if retry_at is None else round(max(0.0, retry_at - now), 1)


def stage_status(
    stage: StagePlan,
    run: BringUp | None,
    coordinator: Shown,
    nodes: dict[str, NodeCapacity],
    before: StagePlan | None,
) -> dict[str, Any]:
    """One stage of the plan as the status shows it: its layers, its state and progress in
    ``run``, its memory and speeds, and the hop into it from the stage ``before`` (among
    the live ``nodes``, with the links they reported)."""
    footprint, speed = coordinator.footprint, coordinator.speeds.speed(stage.node_id)
    node = nodes.get(stage.node_id)
    done, total = run.progress.get(stage.node_id, (0, 0)) if run else (0, 0)
    return {
        "node_id": stage.node_id,
        "layers": [stage.start, stage.end],
        "embed": stage.embed,
        "head": stage.head,
        "state": run.stage_state.get(stage.node_id, StageState.PLANNED)
        if run
        else StageState.PLANNED,
        "bytes_done": done,
        "bytes_total": total,
        "memory_bytes": stage.memory_bytes,
        # recurrent state + snapshot ring reserved for every live sequence
        "recurrent_bytes": sum(footprint.fixed_layer_bytes[stage.start : stage.end]),
        # the stage's decode rate measured while serving (weight bytes a second), if any
        "decode_bytes_per_s": None if speed is None else round(speed.decode_bytes_per_s),
        # what the node measured of itself as it prepared (node/claims.py), or why not
        "self_measured": coordinator.claims.shown(stage.node_id),
        # weight bytes past the node's memory, read from disk as it computes (planner)
        "offload_bytes": stage.offload_bytes,
        # the hop into the stage from the one before: the link's rate (the host's own into
        # stage 1; between two workers the one they reported), a token's and a prefill
        # chunk's hop time (node/links.py)
        **(_hop(footprint, node, before, nodes) if node and before else {}),
    }


def _hop(
    footprint: ModelFootprint,
    node: NodeCapacity,
    before: StagePlan,
    nodes: dict[str, NodeCapacity],
) -> dict[str, Any]:
    after = None if before.start == 0 else nodes.get(before.node_id)
    return {"hop_from": before.node_id, **link_status(footprint, node, STATUS_PREFILL_ROWS, after)}
