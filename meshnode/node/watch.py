"""The coordinator's waits while it serves: for the membership to change, for a pipeline
to fail or go idle, for the requests in flight to drain before a re-placement, and how a
pipeline ended (:mod:`meshnode.node.coordinator`'s module docstring, steps 4 and 5).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Set
from dataclasses import dataclass

import trio

from meshnode.node.decisions import StageFailed
from meshnode.node.membership import suspect_lost_at
from meshnode.node.mesh import MeshView
from meshnode.node.planner import NodeCapacity, Plan
from meshnode.node.remote import RemotePipeline

log = logging.getLogger("meshnode.coordinator")

# Longest wait for the requests in flight before a regrow: a request is bounded by its
# context, and a few minutes covers the default context decoded on a slow CPU mesh.
REGROW_DRAIN_TIMEOUT_S = 300.0


async def settled(
    pipeline: RemotePipeline, run_id: str, *, idle: bool, why: str, waited_s: float
) -> bool:
    """Whether the model may be re-placed (``why``: the planned nodes are back, or the
    measured speeds call for it) now that the API answers 503: at once when ``pipeline``
    went ``idle`` (no checkpoint since: no request came); else once the requests in flight
    finish, False when they have not within ``REGROW_DRAIN_TIMEOUT_S`` (put off)."""
    if idle:
        log.info("%s: re-placing between requests", why)
        return True
    log.info(
        "%s and requests kept coming for %.0f s: draining %s to re-place", why, waited_s, run_id
    )
    with trio.move_on_after(REGROW_DRAIN_TIMEOUT_S):
        await pipeline.wait_idle()
        return True
    log.warning("requests in flight after %.0f s: re-placement put off", REGROW_DRAIN_TIMEOUT_S)
    return False


async def membership_changed(
    mesh: MeshView,
    pipeline: RemotePipeline | None,
    until: float | None,
    *,
    measured: int = 0,
    reported: trio.Event | None = None,
) -> bool:
    """Wait for a membership change (True), or for ``pipeline`` to fail, for ``measured``
    more one-row passes of it to time every stage (if above 0), for ``reported`` (link
    news: :mod:`meshnode.node.warm`), or the trio time ``until`` (False)."""
    changed = False
    changed_event = mesh.membership_event()  # before any checkpoint
    with trio.move_on_at(math.inf if until is None else until):
        async with trio.open_nursery() as nursery:

            async def membership() -> None:
                nonlocal changed
                await changed_event.wait()
                changed = True
                nursery.cancel_scope.cancel()

            async def failure(failed: trio.Event) -> None:
                await failed.wait()
                nursery.cancel_scope.cancel()

            async def passes(pipeline: RemotePipeline) -> None:
                await pipeline.measured.wait(measured)
                nursery.cancel_scope.cancel()

            nursery.start_soon(membership)
            if reported is not None:
                nursery.start_soon(failure, reported)  # not a failure: it ends the wait alike
            if pipeline is not None:
                nursery.start_soon(failure, pipeline.failed)
                if measured > 0:
                    nursery.start_soon(passes, pipeline)
    return changed


@dataclass(frozen=True, slots=True)
class Watched:
    """What the coordinator's watch sees of a serving pipeline (:func:`watch_stages`)."""

    failed: StageFailed | None  # how the pipeline ended, if it did (:func:`stage_failure`)
    spared: frozenset[str]  # stages whose nodes are suspect but not lost yet
    look_at: float | None  # the trio time to look at those again (None: none is suspect)


def watch_stages(
    placed: Plan, pipeline: RemotePipeline, mesh: MeshView, live: list[NodeCapacity], grace_s: float
) -> Watched:
    """How ``pipeline`` of ``placed`` stands now: ``live`` nodes and spared suspects keep
    their stages (:func:`spared_suspects`), any other stage is lost."""
    now, stalled = trio.current_time(), pipeline.stalled_since
    spared, look_at = spared_suspects(placed, mesh.suspects(), stalled, now, grace_s)
    live_ids = {n.node_id for n in live} | spared
    return Watched(stage_failure(placed, pipeline, live_ids, host=mesh.node_id), spared, look_at)


def earliest(*times: float | None) -> float | None:
    """The earliest of ``times`` that is not None (None if none is)."""
    return min((t for t in times if t is not None), default=None)


def spared_suspects(
    placed: Plan,
    suspects: Mapping[str, float],
    stalled_since: float | None,
    now: float,
    grace_s: float,
) -> tuple[frozenset[str], float | None]:
    """The stages of ``placed`` whose nodes are ``suspects`` (node -> suspect since) but not
    lost yet at trio time ``now`` (:func:`~meshnode.node.membership.suspect_lost_at`), and
    when to look at them again (None: no stage is suspect). With nothing in flight a spared
    suspect is looked at every ``grace_s``, so that a pass sent meanwhile is seen in time."""
    spared: set[str] = set()
    wake: list[float] = []
    for node in placed.node_ids:
        if (since := suspects.get(node)) is None:
            continue
        lost_at = suspect_lost_at(since, stalled_since, grace_s)
        if lost_at is None or lost_at > now:
            spared.add(node)
            wake.append(now + grace_s if lost_at is None else lost_at)
    return frozenset(spared), min(wake, default=None)


def stage_failure(
    placed: Plan, pipeline: RemotePipeline, live_ids: Set[str], *, host: str
) -> StageFailed | None:
    """How ``pipeline`` of ``placed`` ended, if it did: a goodbye (neither kept out nor
    blamed), a stage the membership lost (not in ``live_ids``: alive, or suspect and
    spared), or a failure naming its node (kept out until
    the membership changes, never the host itself) or not (``node`` None: blame it)."""
    failure = pipeline.failure
    if failure is not None and failure.left:
        return StageFailed(failure.node, str(failure), left=True)
    for stage in placed.stages:
        if stage.node_id not in live_ids:
            return StageFailed(stage.node_id, f"stage node {stage.node_id} was lost")
    if failure is not None:
        exclude = failure.node not in (None, host)
        return StageFailed(failure.node, str(failure), exclude=exclude)
    return None
