"""Leaving a serving run: the coordinator's watch over a placed pipeline (steps 4 to 6 of
:mod:`meshnode.node.coordinator`'s theory of operation) and the blame of a loss that names
no node (its "Blame").

The watch wakes on events only (the membership changed, the pipeline failed, every stage
timed more passes, a cool-off or a suspect's grace ended) and decides, each time, between
a loss (a stage's node is gone or hung), growing back to the nodes the planner wants
(:func:`~meshnode.node.planner.should_regrow`), re-placing by measured speed
(:func:`~meshnode.node.calibration.faster_by_measure`), and serving on. The decisions
themselves are pure (:mod:`meshnode.node.decisions`, :mod:`meshnode.node.watch`); this
module runs them against the live coordinator (:class:`Watching`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from meshnode.node.bringup import BringUp
from meshnode.node.calibration import Placing, faster_by_measure, wanted_plan
from meshnode.node.decisions import (
    BackOff,
    CoordinatorState,
    Failure,
    MembershipChanged,
    Probed,
    Replan,
)
from meshnode.node.planner import NodeCapacity, Plan, should_regrow
from meshnode.node.remote import RemotePipeline
from meshnode.node.speeds import SERVE_BEFORE_REPLACING_S
from meshnode.node.watch import earliest, watch_stages

log = logging.getLogger("meshnode.coordinator")


class Watching(Placing, Protocol):
    """What the watch reads and calls of the coordinator, beyond :class:`Placing`."""

    run_id: str
    decided: CoordinatorState

    def decide(self, event: Any) -> BackOff | Replan | None: ...

    async def wait_changed(
        self,
        pipeline: RemotePipeline | None = None,
        measured: int = 0,
        until: float | None = None,
        *,
        links: bool = False,
    ) -> bool: ...


async def watch(
    coordinator: Watching, placed: Plan, pipeline: RemotePipeline, *, regrow_now: bool = True
) -> Failure | None:
    """The first loss of a stage (``node`` None when the pipeline failed without
    naming it), or ``None`` once the plan should grow back
    (:func:`~meshnode.node.planner.should_regrow`); with ``regrow_now`` false, growing
    back waits for the next membership change or the end of a cool-off. ``None`` too
    once the measured speeds, or links measured since it began, call for re-placing (the
    coordinator's step 6; a node that joined meanwhile is introduced to the others first,
    :meth:`~meshnode.node.warm.SpeedQueries.introduce`)."""
    mesh, grace = coordinator.mesh, coordinator.settings.suspect_grace_s
    queries = coordinator.queries
    links_weighed = queries.reports  # the link news weighed already (at calibration)
    while True:
        await queries.introduce(mesh, coordinator.candidates(mesh.live_nodes()))
        live = mesh.live_nodes()
        seen = watch_stages(placed, pipeline, mesh, live, grace)
        if seen.failed is not None:
            action = coordinator.decide(seen.failed)
            assert isinstance(action, Replan)
            return action.loss
        # While a stage is suspect the live nodes leave it out: no plan to move to.
        if not seen.spared and regrow_now and wants_regrow(coordinator, placed, live):
            coordinator.why_replace = "the planned nodes are back"
            return None
        now = trio.current_time()
        due = not seen.spared and pipeline.measured.due(now)  # step 6
        # While a stage is spared, its suspect's look_at wakes the watch instead.
        links_at = None if seen.spared else links_due_at(pipeline, queries.reports != links_weighed)
        links = links_at is not None and links_at <= now
        if links:
            links_weighed = queries.reports
        if (due or links) and faster_by_measure(coordinator, placed, coordinator.candidates(live)):
            coordinator.why_replace = (
                "the measured speeds place the layers faster"
                if due
                else "the links measured since place the layers faster"
            )
            return None
        until = earliest(seen.look_at, None if links else links_at)
        to_weigh = pipeline.measured.to_weigh
        changed = await coordinator.wait_changed(pipeline, to_weigh, until, links=True)
        regrow_now = True
        if changed:
            coordinator.decide(MembershipChanged())  # give failed nodes another go


async def blame(
    coordinator: Watching, placed: Plan, pipeline: RemotePipeline, run: BringUp
) -> Failure:
    """The loss of a pipeline that failed without naming its node: probe the stages;
    the decisions blame from what the host observed (the coordinator's "Blame")."""
    reason = str(pipeline.failure)
    answers = await run.probe(placed)
    min_busy_ms = int(pipeline.deadline.base_s * 1000 / 2)
    stages = tuple(placed.node_ids[1:])
    now = trio.current_time()
    action = coordinator.decide(Probed(reason, stages, answers, min_busy_ms, now))
    assert isinstance(action, Replan)
    loss = action.loss
    log.warning("run %s: %s; probe: %s; blamed: %s", coordinator.run_id, reason, answers, loss.node)
    return loss


def links_due_at(pipeline: RemotePipeline, news: bool) -> float | None:
    """When link ``news`` may re-place ``pipeline``: once it has served
    ``SERVE_BEFORE_REPLACING_S``, as measured speeds may (None: no news)."""
    return pipeline.measured.created + SERVE_BEFORE_REPLACING_S if news else None


def wants_regrow(coordinator: Watching, placed: Plan, live: list[NodeCapacity]) -> bool:
    """Whether the plan over the ``live`` nodes now is one to grow back to."""
    wanted = wanted_plan(coordinator, coordinator.candidates(live))
    degraded = coordinator.decided.recovering
    return should_regrow(placed, wanted, split=coordinator.settings.split, degraded=degraded)
