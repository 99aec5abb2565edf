"""Calibration before serving (issue 34): every stage of a new pipeline timed before the API
opens, so that the mesh is placed by measured speed before its first request.

Theory of operation. A mesh whose nodes were never measured is planned by memory (the
planner needs every node's speed). Before such a pipeline serves, the host runs one short
request of its own through it: a prefill of :data:`PROMPT_TOKENS` tokens, then
:data:`DECODE_PASSES` one-row decode passes. Each pass's stage compute times feed the
coordinator's :class:`~meshnode.node.speeds.SpeedBook` exactly as serving does, so every
node is measured on its own backend, threads, formats and real layers (the first pass may
pay for compiling kernels: the median drops it). The coordinator's watch then weighs the
measured plan at once, and re-places before the first request when it is enough faster
(:func:`~meshnode.node.speeds.should_replace`).

Bounded: the whole request within :data:`TIMEOUT_S`. A calibration that fails or runs out
of time leaves the mesh planned by memory, with the reason in the status (``calibration``);
serving goes on (a stage that broke the pass fails the pipeline as any pass would).

**Links.** A plan is weighed with the links between the nodes it may use, as well as their
speeds: before it weighs, the host waits until every link between the candidates has been
measured by one of its ends (:func:`~meshnode.node.links.unmeasured_links`), every
candidate has answered its query (one just introduced tells its links with its answer),
and every one that said it measures itself (a spare node no plan prepared) has answered,
introducing nodes that joined since its plan to the others (:meth:`~meshnode.node.warm.
SpeedQueries.introduce`), for at most :data:`LINKS_TIMEOUT_S`; a link still unmeasured
then counts the host's link, and a node still unmeasured keeps the plan by memory, as
before. The workers met at the plan, and measure their links and themselves while they
prepare, so on a LAN the wait is short.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from meshnode.engine.sampling import SamplingParams
from meshnode.errors import MeshnodeError, PlanError
from meshnode.node.links import PROBE_TIMEOUT_S, unmeasured_links
from meshnode.node.mesh import CoordinatorSettings, MeshView
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame
from meshnode.node.planner import ModelFootprint, NodeCapacity, Plan, plan
from meshnode.node.remote import RemotePipeline
from meshnode.node.speeds import MIN_SAMPLES, SpeedBook, should_replace
from meshnode.node.warm import SpeedQueries

log = logging.getLogger("meshnode.coordinator")

#: Tokens of the calibration prompt: a short prefill, as a chat's first turn would start.
PROMPT_TOKENS = 8
#: One-row decode passes: enough for the speed book to count every stage as measured, and
#: one more for the first pass's kernel compilation, which the median drops.
DECODE_PASSES = MIN_SAMPLES + 1
#: The whole calibration request: a cold stage's first pass compiles its kernels (seconds,
#: up to a minute on a slow CPU; remote.PassDeadline's base), then a few passes.
TIMEOUT_S = 90.0
#: Releasing the calibration's sequence after a timeout: a Release per stage.
RELEASE_TIMEOUT_S = 5.0
#: The longest wait for the links between the candidates (module docstring, Links): a
#: probe is abandoned after links.PROBE_TIMEOUT_S; a dial to a peer just introduced and the
#: report's way to the host take a few seconds more on a loaded machine.
LINKS_TIMEOUT_S = PROBE_TIMEOUT_S + 5.0

REQUEST = RequestId("meshnode-calibration")
GREEDY = SamplingParams(temperature=0.0)


class Placing(Protocol):
    """What the re-placement helpers below read and set of the coordinator."""

    mesh: MeshView
    settings: CoordinatorSettings
    footprint: ModelFootprint
    context_size: int
    speeds: SpeedBook
    queries: SpeedQueries
    calibration: str
    why_replace: str

    def candidates(self, live: list[NodeCapacity]) -> list[NodeCapacity]: ...


def calibration_needed(pipeline: RemotePipeline, speeds: SpeedBook) -> str | None:
    """Why ``pipeline`` needs no calibration (one stage; every stage measured already), or
    None when it does."""
    if len(pipeline.stage_nodes) < 2:
        return "not needed: one stage"
    if pipeline.context_size <= PROMPT_TOKENS + DECODE_PASSES:
        return f"skipped: a context of {pipeline.context_size} tokens is too short"
    if all(speeds.speed(node) is not None for node in pipeline.stage_nodes):
        return "measured"
    return None


async def calibrate(pipeline: RemotePipeline, timeout_s: float | None = None) -> str:
    """Run the calibration request through ``pipeline`` within ``timeout_s`` (default
    :data:`TIMEOUT_S`); what the status shows of it: ``"measured"``, or
    ``"failed: <reason>"`` (the plan stays memory-weighted)."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    try:
        with trio.move_on_after(timeout_s) as scope:
            await _passes(pipeline)
    except MeshnodeError as exc:
        return f"failed: {exc}"
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT_S):
            await pipeline.release(REQUEST)
    if scope.cancelled_caught:
        return f"failed: did not finish within {timeout_s:.0f} s"
    return "measured"


async def _passes(pipeline: RemotePipeline) -> None:
    prompt = tuple(range(1, PROMPT_TOKENS + 1))  # any ids the vocabulary holds
    result = await pipeline.run(StepFrame(REQUEST, FrameKind.PREFILL, 0, prompt, GREEDY))
    position = len(prompt)
    for _ in range(DECODE_PASSES):
        frame = StepFrame(REQUEST, FrameKind.DECODE, position, result.tokens[-1:], GREEDY)
        result = await pipeline.run(frame)
        position += 1


def wanted_plan(coordinator: Placing, nodes: list[NodeCapacity]) -> Plan | None:
    """The plan the planner makes now over ``nodes`` with ``--split`` as asked, if any."""
    try:
        return plan(
            coordinator.footprint,
            nodes,
            host_id=coordinator.mesh.node_id,
            context_tokens=coordinator.context_size,
            split=coordinator.settings.split,
            disk_offload=coordinator.settings.disk_offload,
        )
    except PlanError:
        return None


def faster_by_measure(coordinator: Placing, placed: Plan, nodes: list[NodeCapacity]) -> bool:
    """Whether the measured speeds of ``nodes`` call for re-placing ``placed`` (the
    coordinator's step 6)."""
    wanted = wanted_plan(coordinator, nodes)
    if not should_replace(coordinator.footprint, placed, wanted, nodes):
        return False
    assert wanted is not None  # should_replace never moves to no plan
    log.info("measured speeds: %s is faster than %s", describe_plan(wanted), describe_plan(placed))
    return True


async def calibrated_faster(coordinator: Placing, placed: Plan, pipeline: RemotePipeline) -> bool:
    """Calibrate ``pipeline`` before it serves (with calibration on); whether the measured
    speeds then call for re-placing it at once. The rates calibration observed come first;
    a node it could not time (it failed or ran out of time) is weighed by what it measured
    of itself as it prepared, and every node's disk by its own measurement. Without
    calibration (``--placement memory``) nothing is weighed."""
    if not coordinator.settings.calibrate:
        return False
    needless = calibration_needed(pipeline, coordinator.speeds)
    coordinator.calibration = needless or await calibrate(pipeline)
    pipeline.measured.weighed = pipeline.measured.passes
    if needless not in (None, "measured"):
        return False  # one stage, or a context too short to calibrate
    live = await measured_links(coordinator)
    if faster_by_measure(coordinator, placed, live):
        measured = coordinator.calibration == "measured"
        coordinator.why_replace = (
            "calibration placed the layers faster"
            if measured
            else "the nodes' own measurements place the layers faster (calibration failed)"
        )
        return True
    return False


async def measured_links(
    coordinator: Placing, timeout_s: float = LINKS_TIMEOUT_S
) -> list[NodeCapacity]:
    """The candidates, once every link between them is measured by one of its ends and
    every one has answered its query and none is measuring itself, or ``timeout_s`` has
    passed, each node introduced to the others first (module docstring, Links)."""
    mesh, queries = coordinator.mesh, coordinator.queries
    with trio.move_on_after(timeout_s):
        while True:
            reported, changed = queries.report_event(), mesh.membership_event()
            live = coordinator.candidates(mesh.live_nodes())
            await queries.introduce(mesh, live)
            missing = unmeasured_links(live, mesh.node_id)
            ids = {node.node_id for node in live}
            waiting = sorted((queries.measuring | queries.unanswered()) & ids)
            if not (missing or waiting):
                break
            log.debug("waiting for links %s and the answers of %s", missing, waiting)
            await _first(reported, changed)
    return coordinator.candidates(mesh.live_nodes())


async def _first(*events: trio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait, event)


def describe_plan(placed: Plan) -> str:
    return ", ".join(f"{s.node_id}[{s.start}:{s.end})" for s in placed.stages)
