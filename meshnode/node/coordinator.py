"""The coordinator: the host's loop that places the model on the mesh and keeps it placed.

Theory of operation (DESIGN §5). The host (the node started with ``--model``) opens the
model's stage-0 part to learn its config, then loops:

1. **plan** the live nodes (:func:`meshnode.node.planner.plan`), having first asked each
   for the speed it measured of itself before (:mod:`meshnode.node.warm`: a warm mesh is
   placed by speed at once); with no fit, wait for the membership to change and try again;
2. **bring up** a run with a new ``term``: ``Claim`` every other planned node, ``Prepare``
   each (they materialize their part in the background, the host its own), poll
   ``Inventory`` until every part is ready, ``Load`` downstream-first, wait for ``Ready``;
3. **serve**: hand a :class:`~meshnode.node.remote.RemotePipeline` to the API;
4. **watch**: when a stage's node is lost (the membership says so, or the pipeline failed:
   a dropped connection, a refusal, a missed pass deadline), fail the pipeline, ``Stop`` the
   others and go back to 1 without it. A node the membership holds suspect is lost only
   once it has stayed so, and the pipeline's passes stalled, for ``suspect_grace_s``, or
   when it is dead (:func:`~meshnode.node.membership.suspect_lost_at`): a node starved on
   busy cores for a beat costs no re-placement and no replay. The requests in flight wait
   for the next pipeline and replay there (:mod:`meshnode.generation.replay`): they
   outlive the loss;
5. **grow back**: when the nodes ``--split`` asks for (or that the planner would choose)
   are live again after a loss (:func:`~meshnode.node.planner.should_regrow`), keep
   serving until a moment when no request is in flight, then stop admitting requests (the
   API answers 503 while the mesh is re-placed) and go back to 1. When requests keep
   coming for ``REGROW_IDLE_WAIT_S``, stop admitting them and let those in flight finish on
   the old pipeline first (a drain). A drain that does not finish within
   ``REGROW_DRAIN_TIMEOUT_S`` is abandoned: serving resumes on the old pipeline and the
   next membership change tries again. No request in flight is failed by a regrow.
6. **re-place by measured speed**: each time every stage of the pipeline has timed
   ``MIN_SAMPLES`` more one-row passes (:mod:`meshnode.node.speeds`), plan again with the
   measured speeds; when that plan's token is predicted ``MIN_GAIN`` faster than the
   serving one's (:func:`~meshnode.node.speeds.should_replace`), re-place as in 5: between
   requests, never mid-request, and not before it has served for
   ``SERVE_BEFORE_REPLACING_S`` (calibration placed it already). A node that lies about
   its compute time can move layers to or from itself, so slow the mesh, but every plan
   still fits in memory and is watched the same way, and moves at most once per
   ``SERVE_BEFORE_REPLACING_S``.

A failed step ``Stop``s every node claimed for the run and replans without the failed node
(it is excluded until the membership changes again). A node that refused the ``Claim``
(another host holds it) is claimed again after a while instead, since being freed changes
nothing in the membership (issue 36 item 7). Which nodes a plan leaves out, and why the
mesh is not serving, are pure decisions (:func:`meshnode.node.decisions.next_action`).
Every message carries the run id and term, so a late reply of an abandoned run is
recognised and dropped.

Steps 4 to 6 while serving, and the blame below, are :mod:`meshnode.node.replacing`.

**Blame.** A pipeline that failed on its own (not through the membership) names the lost
node when it knows it (its send to stage 1 failed). When it does not (a pass missed its
deadline; a stage said it no longer holds the run), the coordinator probes every remote
stage of the run (:meth:`~meshnode.node.bringup.BringUp.probe`) and
:func:`~meshnode.node.replacing.blame` picks:

1. the first stage, in pipeline order, that did not answer within ``PROBE_TIMEOUT_S`` or
   no longer holds the run;
2. else the stage whose compute pass in progress is the oldest, if it has run for at least
   half the deadline's base (a stage that hangs in a forward while its heartbeats flow);
3. else what the host observed itself: the last stage's reply is missing, so every remote
   stage is a suspect of this *untraced* loss, and a node suspect of
   ``UNTRACED_LOSSES_TO_BLAME`` of them within ``BLAME_COOL_OFF_S`` is blamed; before
   that, nobody, and the plan is made again as it was. A stage's "idle" is not taken for
   it (issue 36 item 5; :mod:`meshnode.node.decisions`).

A node blamed this way is alive to the membership, so it is kept out of plans for
``BLAME_COOL_OFF_S`` (whatever the membership does meanwhile) instead of until the next
membership change: a node that hangs on every pass costs one replay per cool-off, not
every request its three replays. When the cool-off ends, the plan may grow back to it.
A node named by the failure itself is excluded until the membership changes, like a node
that failed a bring-up. Stage 0 is not probed: it is this node, which no plan can leave out.
Its own compute has the pass deadline too; when it misses it, the pipeline fails naming
this node (:meth:`~meshnode.node.remote.RemotePipeline._step`), which is neither
excluded nor cooled off: the next run gets a fresh stage 0 and the requests replay there.
The hung thread cannot be stopped and keeps its stage's memory, so while
``MAX_HUNG_STAGE0`` of them have not returned no new run is brought up (the status says
why), and the requests waiting to replay fail when their wait ends.

Terms survive restarts (:func:`next_term`): a worker keeps the newest term of a claim and
refuses an older one, so a restarted host whose terms began again at 1 was
``ClaimRejected`` by every worker still holding its previous process's term.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import open_ref
from meshnode_packaging.sources import ModelSource
from meshnode_protocol import (
    ClaimAccepted,
    ClaimRejected,
    Error,
    InventoryReport,
    Message,
    PrepareAccepted,
    Ready,
    SpeedReport,
)

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.errors import PlanError, RunError
from meshnode.node.bringup import BringUp
from meshnode.node.calibration import calibrated_faster, describe_plan
from meshnode.node.claims import ClaimBook, best_speed
from meshnode.node.decisions import (
    BackedOff,
    BackOff,
    BringUpFailed,
    CoordinatorState,
    Failure,
    MembershipChanged,
    NoFit,
    Planned,
    Replaced,
    Replan,
    Serving,
    Stage0Hung,
    next_action,
)
from meshnode.node.footprint import model_footprint, served_context
from meshnode.node.host_status import host_status
from meshnode.node.links import with_hop_bytes
from meshnode.node.mesh import CoordinatorSettings, MeshView
from meshnode.node.planner import (
    NodeCapacity,
    NodeSpeed,
    Plan,
    plan,
    stage_weight_bytes,
)
from meshnode.node.prefix import StagePrefix
from meshnode.node.remote import RemotePipeline, idle_by, is_data_reply
from meshnode.node.replacing import blame, watch
from meshnode.node.speeds import SpeedBook
from meshnode.node.warm import SpeedQueries
from meshnode.node.watch import earliest, membership_changed, settled

log = logging.getLogger("meshnode.coordinator")

# How long the host keeps admitting requests after the planned nodes are back, waiting for
# a moment with none in flight to re-place the model: only past it does it drain (503s).
REGROW_IDLE_WAIT_S = 30.0
# Stage-0 computes that missed their deadline and have not returned, beyond which no new run
# is brought up until one does: each holds a thread and a stage's memory (module docstring).
MAX_HUNG_STAGE0 = 2


class MeshState(enum.StrEnum):
    """Where the host's mesh stands (``meshnode status`` and the 503s show the value)."""

    PLANNING = "planning"
    LOADING = "loading"  # Claim, Prepare, Load: each stage's StageState says how far
    FAILED = "failed"  # the bring-up failed; the next try backs off
    REPLANNING = "replanning"  # a stage was lost
    READY = "ready"
    DRAINING = "draining"  # the plan grows back once the requests in flight are done


def stage_gone(node: str, *, left: bool) -> str:
    """Why a pipeline ended when a stage's session did: its node said goodbye, or was lost."""
    if left:
        return f"stage node {node} left the mesh; replanning"
    return f"stage node {node} was lost; the mesh is replanning"


def next_term(previous: int, wall_clock_ns: int) -> int:
    """The term of the next run: above ``previous`` and at least the wall clock in µs.

    Epoch-prefixed rather than persisted: microseconds since 1970 grow across restarts (a
    host restarts far less often than once per microsecond), so a restarted coordinator's
    first term is above every term of its previous process, with no state file. Only a
    wall clock set back by more than the downtime could repeat a term; the worker then
    refuses the claim until its old claim is dropped, as before. About 2**51 today: a
    uint64 on the wire and exact in JSON (below 2**53) for centuries.
    """
    return max(previous + 1, wall_clock_ns // 1000)


class Coordinator:
    """Places the model and keeps it placed; see the module docstring."""

    def __init__(
        self,
        mesh: MeshView,
        settings: CoordinatorSettings,
        *,
        source: ModelSource,
        backend: Backend,
        on_pipeline: Callable[[RemotePipeline | None], None],
        in_flight: Callable[[], int] = lambda: 0,
    ) -> None:
        """``on_pipeline`` hands each pipeline (None: 503s) to the frontend; ``in_flight``
        counts its requests, with a sequence on the pipeline or not (regrows wait for it)."""
        self.mesh = mesh
        self.settings = settings
        self.source = source
        self.config = ModelConfig.from_hf(source.config)
        self.context_size = served_context(self.config, settings.context_size)
        self.footprint = model_footprint(
            self.config,
            held=backend.held_bytes(source, self.config),
            ring_slots=settings.ring_slots,
            kv_dtype=settings.kv_dtype,
        )
        self.footprint = with_hop_bytes(self.footprint, self.config, settings.wire_dtype)
        self._backend = backend
        self._on_pipeline = on_pipeline
        self._in_flight = in_flight
        self._term = 0
        self.run_id = ""
        self._state = MeshState.PLANNING
        # What the pure decisions keep between runs: nodes left out, failures (typed).
        self.decided = CoordinatorState()
        self._plan: Plan | None = None
        self._run: BringUp | None = None  # the latest run (its stages' states, progress)
        self._pipeline: RemotePipeline | None = None
        self._retry_at: float | None = None  # trio time of the next try, while backing off
        self._hung: list[RemotePipeline] = []  # whose stage-0 compute hangs (stage0_hung)
        # stage 0's prefix pool of the run before, for the next (node/prefix_keep.py)
        self._kept: StagePrefix | None = None
        # Decode rates observed while serving (node/speeds.py): the next plan uses them.
        self.speeds = SpeedBook()
        # ... and what each node measured of itself (its links alone with memory placement)
        self.claims = ClaimBook(self.footprint, compute=settings.place_by_speed)
        self.queries = _speed_queries(settings, backend)  # ... asked before a plan (node/warm.py)
        self.why_replace = ""  # why the serving plan is being re-placed (steps 5 and 6)
        self.calibration = "off" if not settings.calibrate else ""  # the last one's outcome

    def decide(self, event: Any) -> BackOff | Replan | None:
        """Apply ``event`` to the decisions' state (:func:`~meshnode.node.decisions.next_action`)
        and return what to do next."""
        self.decided, action = next_action(self.decided, event)
        return action

    # -- status -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The host's part of ``GET /v1/mesh/status`` (:mod:`meshnode.node.host_status`)."""
        run, plan_, at = self._run, self._plan, self._retry_at
        return host_status(self, self._term, self._state, plan_, run, retry_at=at)

    # -- messages from peers ------------------------------------------------------------

    @property
    def pipeline(self) -> RemotePipeline | None:
        """The live pipeline; data replies (:func:`~meshnode.node.remote.is_data_reply`)
        go to it straight from the session, not through :meth:`handle`."""
        return self._pipeline

    def handle(self, peer: str, message: Message) -> bool:
        """Route a control reply of our run; False if the message is not the coordinator's."""
        if is_data_reply(message):
            return False
        if isinstance(message, SpeedReport):  # an answer to a query before a plan
            return self.queries.deliver(peer, message, self.claims)
        replies = (ClaimAccepted, ClaimRejected, PrepareAccepted, InventoryReport, Ready, Error)
        if not isinstance(message, replies):
            return False
        if getattr(message, "run_id", "") != self.run_id:
            return True  # a late reply of an abandoned run
        if self._run is not None:
            self._run.deliver(peer, message)
        return True

    def peer_lost(self, peer: str, *, left: bool = False) -> None:
        """The session with ``peer`` ended (``left``: a goodbye): fail what waits on it now."""
        if self._pipeline is not None and peer in self._pipeline.stage_nodes:
            self._pipeline.fail(stage_gone(peer, left=left), node=peer, left=left)
        if self._run is not None:
            self._run.lost(peer)  # a bring-up waiting for this node's reply fails at once

    # -- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        """Plan, bring up, serve, watch; forever (cancel to stop)."""
        while True:
            await self._while_stage0_hangs()
            placed = await self._plan_when_possible()
            # The wall clock, not trio's: the term must compare across processes.
            self._term = next_term(self._term, time.time_ns())
            self.run_id = f"run-{secrets.token_hex(4)}"
            self._plan = placed
            self._run = run = BringUp(
                self.mesh,
                self.settings,
                placed,
                run_id=self.run_id,
                term=self._term,
                config=self.config,
                source=self.source,
                backend=self._backend,
                context_size=self.context_size,
                speeds=self.speeds,
                claims=self.claims,
                stage_weight_bytes=[stage_weight_bytes(self.footprint, s) for s in placed.stages],
                kept=self._kept,
            )
            self._kept = None  # taken over by the run's stage 0, or dropped with it
            log.info("run %s term %d: %s", self.run_id, self._term, describe_plan(placed))
            self._state = MeshState.LOADING  # Claim, Prepare, Load: the stages say how far
            try:
                pipeline = await run.run(placed)
            except RunError as exc:
                failed = BringUpFailed(
                    str(exc), trio.current_time(), frozenset(run.failed), frozenset(run.refused)
                )
                backoff = self.decide(failed)
                self._state = MeshState.FAILED
                log.warning("run %s failed: %s", self.run_id, exc)
                await run.stop_all(placed, str(exc))
                await self._back_off(backoff.delay_s if isinstance(backoff, BackOff) else 0.0)
                self.decide(BackedOff())  # the next plan's own trouble, if any
                continue
            self.decide(Serving(placed.node_ids))
            self._pipeline = pipeline
            loss = await self._serve(placed, pipeline, run)
            self.decide(Replaced(loss))
            if loss is None:  # drained: the API answers 503 already
                reason = f"{self.why_replace}: re-placing"
            else:
                self._on_pipeline(None)
                reason = loss.reason
                pipeline.fail(f"{reason}; the mesh is replanning", node=loss.node)
                if pipeline.stage0_hung:
                    self._hung.append(pipeline)
            self._pipeline = None
            self._state = MeshState.REPLANNING
            await run.stop_all(placed, reason)
            self._kept = await pipeline.keep_prefix()  # a replay resumes from its blocks

    async def _while_stage0_hangs(self) -> None:
        """Bring up nothing while ``MAX_HUNG_STAGE0`` stage-0 computes of earlier runs hang
        (polled each second; module docstring, Blame); the error says why meanwhile."""
        while len(self._hung) >= MAX_HUNG_STAGE0:
            self._state = MeshState.FAILED
            self.decide(Stage0Hung(len(self._hung)))
            await trio.sleep(1.0)
            self._hung = [p for p in self._hung if p.stage0_hung]
            if len(self._hung) < MAX_HUNG_STAGE0:
                self.decide(Stage0Hung(0))

    async def _back_off(self, delay: float) -> None:
        failures = self.decided.failures
        log.info("retrying in %.1f s (failure %d in a row)", delay, failures)
        self._retry_at = trio.current_time() + delay
        try:
            await trio.sleep(delay)
        finally:
            self._retry_at = None

    async def _serve(self, placed: Plan, pipeline: RemotePipeline, run: BringUp) -> Failure | None:
        """Serve on ``pipeline`` until a stage is lost (the loss) or the plan grows back (None)."""
        regrow_now = announce = True
        if await calibrated_faster(self, placed, pipeline):
            return None  # re-placed before the API opened
        while True:
            if announce:
                self._state = MeshState.READY
                self._on_pipeline(pipeline)
            loss = await watch(self, placed, pipeline, regrow_now=regrow_now)
            if loss is not None:
                if loss.node is None:
                    loss = await blame(self, placed, pipeline, run)
                return loss
            idle = await idle_by(
                pipeline,
                REGROW_IDLE_WAIT_S,
                lambda: self.wait_changed(pipeline),
                in_flight=self._in_flight,
            )
            announce = idle is not None  # None: a stage failed or the membership changed
            if announce:  # else look again, still serving on this pipeline
                self._state = MeshState.DRAINING
                self._on_pipeline(None)  # new requests get 503 until the new plan is ready
                why, waited = self.why_replace, REGROW_IDLE_WAIT_S
                if await settled(pipeline, self.run_id, idle=bool(idle), why=why, waited_s=waited):
                    return None
                regrow_now = False  # until the membership changes again

    async def wait_changed(
        self,
        pipeline: RemotePipeline | None = None,
        measured: int = 0,
        until: float | None = None,
        *,
        links: bool = False,
    ) -> bool:
        """Wait for a membership change (True), or for ``pipeline`` to fail, to time every
        stage in ``measured`` more one-row passes (if above 0), a node left out to come
        back by itself, link news if ``links`` (:mod:`meshnode.node.warm`), or the trio
        time ``until`` (False)."""
        until = earliest(until, self.decided.wake_at(trio.current_time()))
        reported = self.queries.report_event() if links else None
        return await membership_changed(
            self.mesh, pipeline, until, measured=measured, reported=reported
        )

    async def _plan_when_possible(self) -> Plan:
        self._state = MeshState.PLANNING
        while True:
            await self.queries.ask(self.mesh, self.claims, self.mesh.live_nodes())
            nodes = self.candidates(self.mesh.live_nodes())
            split = self.settings.split
            if split is not None and not self.decided.first_plan and len(nodes) < split:
                split = None  # after a loss, serve on what is left rather than not at all
            try:
                result = plan(
                    self.footprint,
                    nodes,
                    host_id=self.mesh.node_id,
                    context_tokens=self.context_size,
                    split=split,
                    disk_offload=self.settings.disk_offload,
                )
                self.decide(Planned())
                return result
            except PlanError as exc:
                if str(exc) != str(self.decided.error or ""):
                    log.info("waiting for nodes: %s", exc)
                self.decide(NoFit(str(exc)))
            if await self.wait_changed():
                self.decide(MembershipChanged())  # give failed nodes another go

    def candidates(self, live: list[NodeCapacity]) -> list[NodeCapacity]:
        """The live nodes a plan may use (none kept out), each with its measured decode
        rate where serving has measured one (``speeds``; the planner needs every node's),
        else the one it claimed (``claims``), unless the placement is by memory alone; and,
        whatever the placement, with the links to its peers it reported
        (:meth:`~meshnode.node.claims.ClaimBook.linked`)."""
        kept_out = self.decided.kept_out(trio.current_time())
        by_speed = self.settings.place_by_speed
        return [
            dataclasses.replace(
                self.claims.linked(n), speed=_speed(self, n.node_id) if by_speed else None
            )
            for n in live
            if n.node_id not in kept_out
        ]


def _speed_queries(settings: CoordinatorSettings, backend: Backend) -> SpeedQueries:
    """The speed queries of a coordinator: its model as its ``Prepare`` names it, asked
    unless the placement is by memory alone (:mod:`meshnode.node.warm`)."""
    return SpeedQueries(
        settings.model_ref,
        settings.pin,
        backend=backend,
        cache_dir=settings.cache_dir,
        enabled=settings.place_by_speed,
    )


def _speed(coordinator: Coordinator, node: str) -> NodeSpeed | None:
    return best_speed(coordinator.speeds.speed(node), coordinator.claims.speed(node))


async def open_stage0_source(model_ref: str, cache_dir: Path | None) -> ModelSource:
    """The model's config and tokenizer side (its manifest and embedding), off the loop."""
    return await trio.to_thread.run_sync(
        lambda: open_ref(model_ref, Part(0, 0, embed=True), cache_dir=cache_dir)
    )
