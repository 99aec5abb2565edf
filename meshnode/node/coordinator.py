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

**Blame.** A pipeline that failed on its own (not through the membership) names the lost
node when it knows it (its send to stage 1 failed). When it does not (a pass missed its
deadline; a stage said it no longer holds the run), the coordinator probes every remote
stage of the run (:meth:`~meshnode.node.bringup.BringUp.probe`) and :func:`blame` picks:

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
from meshnode.node.bringup import BringUp, StageState
from meshnode.node.calibration import (
    calibrated_faster,
    describe_plan,
    faster_by_measure,
    wanted_plan,
)
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
    Probed,
    Replaced,
    Replan,
    Serving,
    Stage0Hung,
    next_action,
)
from meshnode.node.footprint import model_footprint, served_context
from meshnode.node.links import STATUS_PREFILL_ROWS, link_status, with_hop_bytes
from meshnode.node.mesh import CoordinatorSettings, MeshView
from meshnode.node.planner import (
    NodeCapacity,
    NodeSpeed,
    Plan,
    StagePlan,
    plan,
    should_regrow,
    stage_weight_bytes,
)
from meshnode.node.remote import RemotePipeline, idle_by, is_data_reply
from meshnode.node.speeds import SpeedBook
from meshnode.node.warm import SpeedQueries
from meshnode.node.watch import earliest, membership_changed, settled, watch_stages

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


def retry_in(retry_at: float | None, now: float) -> float | None:
    """Seconds until the next bring-up while backing off (``None``: not backing off)."""
    return None if retry_at is None else round(max(0.0, retry_at - now), 1)


def _stage_status(
    stage: StagePlan, run: BringUp | None, coordinator: Coordinator
) -> dict[str, Any]:
    """One stage of the plan as the status shows it: its layers, its state and progress in
    ``run``, its memory and speeds."""
    footprint, speed = coordinator.footprint, coordinator.speeds.speed(stage.node_id)
    node = next((n for n in coordinator.mesh.live_nodes() if n.node_id == stage.node_id), None)
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
        # the hop into the stage: the host's measured link to it, a token's and a prefill
        # chunk's hop time (node/links.py)
        **(link_status(footprint, node, STATUS_PREFILL_ROWS) if node and stage.start else {}),
    }


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
        self._run_id = ""
        self._state = MeshState.PLANNING
        # What the pure decisions keep between runs: nodes left out, failures (typed).
        self._decided = CoordinatorState()
        self._plan: Plan | None = None
        self._run: BringUp | None = None  # the latest run (its stages' states, progress)
        self._pipeline: RemotePipeline | None = None
        self._retry_at: float | None = None  # trio time of the next try, while backing off
        self._hung: list[RemotePipeline] = []  # whose stage-0 compute hangs (stage0_hung)
        # Decode rates observed while serving (node/speeds.py): the next plan uses them.
        self.speeds = SpeedBook()
        self.claims = ClaimBook(self.footprint)  # ... and what each node measured of itself
        self.queries = _speed_queries(settings, backend)  # ... asked before a plan (node/warm.py)
        self.why_replace = ""  # why the serving plan is being re-placed (steps 5 and 6)
        self.calibration = "off" if not settings.calibrate else ""  # the last one's outcome

    def _decide(self, event: Any) -> BackOff | Replan | None:
        """Apply ``event`` to the decisions' state (:func:`~meshnode.node.decisions.next_action`)
        and return what to do next."""
        self._decided, action = next_action(self._decided, event)
        return action

    # -- status -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        run = self._run
        stages = [_stage_status(s, run, self) for s in self._plan.stages] if self._plan else []
        return {
            "model": self.settings.model_ref,
            "run_id": self._run_id,
            "term": self._term,
            "state": self._state,
            "error": str(self._decided.error or ""),
            "retry_in_s": retry_in(self._retry_at, now),
            "last_failure": str(self._decided.last_failure or ""),
            "context_size": self.context_size,
            "wire_dtype": self.settings.wire_dtype,
            "stages": stages,
            # what the serving plan's layer split follows: "speed" once every node is
            # measured and that is faster (docs/placement.md), else "memory"
            "placed_by": "speed" if self._plan and self._plan.measured else "memory",
            "calibration": self.calibration,
            "cooling_off": self._decided.cooling_off(now),
        }

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
        if getattr(message, "run_id", "") != self._run_id:
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
            self._run_id = f"run-{secrets.token_hex(4)}"
            self._plan = placed
            self._run = run = BringUp(
                self.mesh,
                self.settings,
                placed,
                run_id=self._run_id,
                term=self._term,
                config=self.config,
                source=self.source,
                backend=self._backend,
                context_size=self.context_size,
                speeds=self.speeds,
                claims=self.claims if self.settings.place_by_speed else None,
                stage_weight_bytes=[stage_weight_bytes(self.footprint, s) for s in placed.stages],
            )
            log.info("run %s term %d: %s", self._run_id, self._term, describe_plan(placed))
            self._state = MeshState.LOADING  # Claim, Prepare, Load: the stages say how far
            try:
                pipeline = await run.run(placed)
            except RunError as exc:
                failed = BringUpFailed(
                    str(exc), trio.current_time(), frozenset(run.failed), frozenset(run.refused)
                )
                backoff = self._decide(failed)
                self._state = MeshState.FAILED
                log.warning("run %s failed: %s", self._run_id, exc)
                await run.stop_all(placed, str(exc))
                await self._back_off(backoff.delay_s if isinstance(backoff, BackOff) else 0.0)
                self._decide(BackedOff())  # the next plan's own trouble, if any
                continue
            self._decide(Serving(placed.node_ids))
            self._pipeline = pipeline
            loss = await self._serve(placed, pipeline, run)
            self._decide(Replaced(loss))
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

    async def _while_stage0_hangs(self) -> None:
        """Bring up nothing while ``MAX_HUNG_STAGE0`` stage-0 computes of earlier runs hang
        (polled each second; module docstring, Blame); the error says why meanwhile."""
        while len(self._hung) >= MAX_HUNG_STAGE0:
            self._state = MeshState.FAILED
            self._decide(Stage0Hung(len(self._hung)))
            await trio.sleep(1.0)
            self._hung = [p for p in self._hung if p.stage0_hung]
            if len(self._hung) < MAX_HUNG_STAGE0:
                self._decide(Stage0Hung(0))

    async def _back_off(self, delay: float) -> None:
        failures = self._decided.failures
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
            loss = await self._watch(placed, pipeline, regrow_now=regrow_now)
            if loss is not None:
                if loss.node is None:
                    loss = await self._blame(placed, pipeline, run)
                return loss
            idle = await idle_by(
                pipeline,
                REGROW_IDLE_WAIT_S,
                lambda: self._wait_changed(pipeline),
                in_flight=self._in_flight,
            )
            announce = idle is not None  # None: a stage failed or the membership changed
            if announce:  # else look again, still serving on this pipeline
                self._state = MeshState.DRAINING
                self._on_pipeline(None)  # new requests get 503 until the new plan is ready
                why, waited = self.why_replace, REGROW_IDLE_WAIT_S
                if await settled(pipeline, self._run_id, idle=bool(idle), why=why, waited_s=waited):
                    return None
                regrow_now = False  # until the membership changes again

    async def _blame(self, placed: Plan, pipeline: RemotePipeline, run: BringUp) -> Failure:
        """The loss of a pipeline that failed without naming its node: probe the stages;
        the decisions blame from what the host observed (module docstring, Blame)."""
        reason = str(pipeline.failure)
        answers = await run.probe(placed)
        min_busy_ms = int(pipeline.deadline.base_s * 1000 / 2)
        stages = tuple(placed.node_ids[1:])
        now = trio.current_time()
        action = self._decide(Probed(reason, stages, answers, min_busy_ms, now))
        assert isinstance(action, Replan)
        loss = action.loss
        log.warning("run %s: %s; probe: %s; blamed: %s", self._run_id, reason, answers, loss.node)
        return loss

    async def _wait_changed(
        self, pipeline: RemotePipeline | None = None, measured: int = 0, until: float | None = None
    ) -> bool:
        """Wait for a membership change (True), or for ``pipeline`` to fail, to time every
        stage in ``measured`` more one-row passes (if above 0), a node left out to come
        back by itself, or the trio time ``until`` (False)."""
        until = earliest(until, self._decided.wake_at(trio.current_time()))
        return await membership_changed(self.mesh, pipeline, until, measured=measured)

    async def _plan_when_possible(self) -> Plan:
        self._state = MeshState.PLANNING
        while True:
            await self.queries.ask(self.mesh, self.claims, self.mesh.live_nodes())
            nodes = self.candidates(self.mesh.live_nodes())
            split = self.settings.split
            if split is not None and not self._decided.first_plan and len(nodes) < split:
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
                self._decide(Planned())
                return result
            except PlanError as exc:
                if str(exc) != str(self._decided.error or ""):
                    log.info("waiting for nodes: %s", exc)
                self._decide(NoFit(str(exc)))
            if await self._wait_changed():
                self._decide(MembershipChanged())  # give failed nodes another go

    async def _watch(
        self, placed: Plan, pipeline: RemotePipeline, *, regrow_now: bool = True
    ) -> Failure | None:
        """The first loss of a stage (``node`` None when the pipeline failed without
        naming it), or ``None`` once the plan should grow back
        (:func:`~meshnode.node.planner.should_regrow`); with ``regrow_now`` false, growing
        back waits for the next membership change or the end of a cool-off. ``None`` too
        once the measured speeds call for re-placing (module docstring, step 6)."""
        while True:
            live = self.mesh.live_nodes()
            seen = watch_stages(placed, pipeline, self.mesh, live, self.settings.suspect_grace_s)
            if seen.failed is not None:
                action = self._decide(seen.failed)
                assert isinstance(action, Replan)
                return action.loss
            # While a stage is suspect the live nodes leave it out: no plan to move to.
            if not seen.spared and regrow_now and _wants_regrow(self, placed, live):
                self.why_replace = "the planned nodes are back"
                return None
            due = not seen.spared and pipeline.measured.due(trio.current_time())  # step 6
            if due and faster_by_measure(self, placed, self.candidates(live)):
                self.why_replace = "the measured speeds place the layers faster"
                return None
            changed = await self._wait_changed(pipeline, pipeline.measured.to_weigh, seen.look_at)
            regrow_now = True
            if changed:
                self._decide(MembershipChanged())  # give failed nodes another go

    def candidates(self, live: list[NodeCapacity]) -> list[NodeCapacity]:
        """The live nodes a plan may use (none kept out), each with its measured decode
        rate where serving has measured one (``speeds``; the planner needs every node's),
        else the one it claimed (``claims``), unless the placement is by memory alone."""
        kept_out = self._decided.kept_out(trio.current_time())
        by_speed = self.settings.place_by_speed
        return [
            dataclasses.replace(n, speed=_speed(self, n.node_id) if by_speed else None)
            for n in live
            if n.node_id not in kept_out
        ]


def _wants_regrow(coordinator: Coordinator, placed: Plan, live: list[NodeCapacity]) -> bool:
    wanted = wanted_plan(coordinator, coordinator.candidates(live))
    degraded = coordinator._decided.recovering
    return should_regrow(placed, wanted, split=coordinator.settings.split, degraded=degraded)


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
