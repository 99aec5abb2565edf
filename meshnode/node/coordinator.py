"""The coordinator: the host's loop that places the model on the mesh and keeps it placed.

Theory of operation (DESIGN §5). The host (the node started with ``--model``) opens the
model's stage-0 part to learn its config, then loops:

1. **plan** the live nodes (:func:`meshnode.node.planner.plan`); with no fit, wait for the
   membership to change and try again;
2. **bring up** a run with a new ``term``: ``Claim`` every other planned node, ``Prepare``
   each (they materialize their part in the background, the host its own), poll
   ``Inventory`` until every part is ready, ``Load`` downstream-first, wait for ``Ready``;
3. **serve**: hand a :class:`~meshnode.node.remote.RemotePipeline` to the API;
4. **watch**: when a stage's node is lost (the membership says so, or the pipeline failed:
   a dropped connection, a refusal, a missed pass deadline), fail the pipeline, ``Stop`` the
   others and go back to 1 without it. The requests in flight wait for the next pipeline
   and replay there (:mod:`meshnode.generation.replay`): they outlive the loss;
5. **grow back**: when the nodes ``--split`` asks for (or that the planner would choose)
   are live again after a loss (:func:`~meshnode.node.planner.should_regrow`), keep
   serving until a moment when no request is in flight, then stop admitting requests (the
   API answers 503 while the mesh is re-placed) and go back to 1. When requests keep
   coming for ``REGROW_IDLE_WAIT_S``, stop admitting them and let those in flight finish on
   the old pipeline first (a drain). A drain that does not finish within
   ``REGROW_DRAIN_TIMEOUT_S`` is abandoned: serving resumes on the old pipeline and the
   next membership change tries again. No request in flight is failed by a regrow.

A failed step ``Stop``s every node claimed for the run and replans without the failed node
(it is excluded until the membership changes again). Every message carries the run id and
term, so a late reply of an abandoned run is recognised and dropped.

**Blame.** A pipeline that failed on its own (not through the membership) names the lost
node when it knows it (its send to stage 1 failed). When it does not (a pass missed its
deadline; a stage said it no longer holds the run), the coordinator probes every remote
stage of the run (:meth:`~meshnode.node.bringup.BringUp.probe`) and :func:`blame` picks:

1. the first stage, in pipeline order, that did not answer within ``PROBE_TIMEOUT_S`` or
   no longer holds the run;
2. else the stage whose compute pass in progress is the oldest, if it has run for at least
   half the deadline's base (a stage that hangs in a forward while its heartbeats flow);
3. else nobody: the pass was lost without a trace, and the plan is made again as it was.

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

import enum
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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
    PeerInfo,
    PrepareAccepted,
    Ready,
)

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS
from meshnode.errors import PlanError, RunError
from meshnode.node.bringup import BringUp, StageState
from meshnode.node.footprint import model_footprint, served_context
from meshnode.node.planner import (
    ModelFootprint,
    NodeCapacity,
    Plan,
    StagePlan,
    plan,
    should_regrow,
)
from meshnode.node.remote import PassDeadline, RemotePipeline, idle_by, is_data_reply

log = logging.getLogger("meshnode.coordinator")

# Longest wait for the requests in flight before a regrow: a request is bounded by its
# context, and a few minutes covers the default context decoded on a slow CPU mesh.
REGROW_DRAIN_TIMEOUT_S = 300.0
# How long the host keeps admitting requests after the planned nodes are back, waiting for
# a moment with none in flight to re-place the model: only past it does it drain (503s).
REGROW_IDLE_WAIT_S = 30.0
# A failed bring-up is retried after RETRY_BACKOFF_FIRST_S, doubling with each failure in
# a row up to RETRY_BACKOFF_MAX_S. A stage that keeps failing (a damaged file, a device
# that refuses) replanned at once, 46 times in 12 s, flooding the log and the workers;
# a passing glitch (a node that restarted) still costs under a second.
RETRY_BACKOFF_FIRST_S = 0.5
RETRY_BACKOFF_MAX_S = 30.0
# How long a node blamed for a lost pass stays out of the plans (module docstring, Blame).
# Five minutes: a node that hangs on every pass then costs one replay per five minutes,
# while one that hung once (a stalled disk, a swapped-out process) is used again soon.
BLAME_COOL_OFF_S = 300.0
# Stage-0 computes that missed their deadline and have not returned, beyond which no new run
# is brought up until one does: each holds a thread and a stage's memory (module docstring).
MAX_HUNG_STAGE0 = 2


def retry_delay(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failed bring-up in a row (0 for none)."""
    if failures < 1:
        return 0.0
    return float(min(RETRY_BACKOFF_FIRST_S * 2.0 ** (failures - 1), RETRY_BACKOFF_MAX_S))


class MeshState(enum.StrEnum):
    """Where the host's mesh stands (``meshnode status`` and the 503s show the value)."""

    PLANNING = "planning"
    LOADING = "loading"  # Claim, Prepare, Load: each stage's StageState says how far
    FAILED = "failed"  # the bring-up failed; the next try backs off
    REPLANNING = "replanning"  # a stage was lost
    READY = "ready"
    DRAINING = "draining"  # the plan grows back once the requests in flight are done


class MeshView(Protocol):
    """What the coordinator needs of the running node (the daemon implements it)."""

    @property
    def node_id(self) -> str:
        """This node's id."""
        ...

    def live_nodes(self) -> list[NodeCapacity]:
        """This node and every alive, connected peer."""
        ...

    def peer_info(self, node_id: str) -> PeerInfo:
        """Address and capacity of a node (this one included), for ``Load``."""
        ...

    async def send(self, node_id: str, message: Message) -> None:
        """Send to a peer over its session; raises if there is none."""
        ...

    def membership_event(self) -> trio.Event:
        """The event the next membership change sets. Take it before reading
        :meth:`live_nodes` and wait on it after: a change in between is not missed."""
        ...


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    model_ref: str
    context_size: int | None = None
    split: int | None = None
    wire_dtype: str = "f16"
    # K/V of every stage's caches (``Load.kv_dtype``): f32 or f16, ``--kv-dtype`` resolved
    # by the host (``engine.kv_cache.resolve_kv_dtype``: auto is f16 with q8 weights)
    kv_dtype: str = "f32"
    cache_dir: Path | None = None
    # What the host resolved ``model_ref`` to (``refs.pin_ref``): a hub commit or a URL
    # package's manifest sha256, sent in every Prepare so that no stage reads another one.
    pin: str = ""
    # Per-sequence recurrent-state snapshots each hybrid stage keeps (``Load.ring_slots``):
    # the host's largest verify pass (``engine.recurrent.ring_slots_for``).
    ring_slots: int = DEFAULT_RING_SLOTS
    # When a pass across the stages counts as lost (``--pass-deadline``).
    pass_deadline: PassDeadline = field(default_factory=PassDeadline)


def blame(
    stages: Sequence[str], answers: Mapping[str, int | None], *, min_busy_ms: int
) -> str | None:
    """The stage to blame for a pass that did not come back (module docstring, Blame).

    ``stages`` are the run's remote stages in pipeline order; ``answers`` what each said to
    the probe (the age of its pass in progress in ms, ``None``: silent or refusing).
    """
    for node in stages:
        if answers.get(node) is None:
            return node
    busy = [(answers[node] or 0, node) for node in stages]
    oldest_ms, node = max(busy, default=(0, ""))
    return node if oldest_ms >= min_busy_ms else None


@dataclass(frozen=True, slots=True)
class Loss:
    """Why a pipeline ended: the node lost (``None``: not known) and the reason."""

    node: str | None
    reason: str


def stage_gone(node: str, *, left: bool) -> str:
    """Why a pipeline ended when a stage's session did: its node said goodbye, or was lost."""
    if left:
        return f"stage node {node} left the mesh; replanning"
    return f"stage node {node} was lost; the mesh is replanning"


def retry_in(retry_at: float | None, now: float) -> float | None:
    """Seconds until the next bring-up while backing off (``None``: not backing off)."""
    return None if retry_at is None else round(max(0.0, retry_at - now), 1)


def seconds_left(until: Mapping[str, float], now: float) -> dict[str, float]:
    """Each node's seconds left until its time in ``until`` (trio clock), by node id;
    those already past are left out (the ``cooling_off`` of the status)."""
    return {node: round(t - now, 1) for node, t in sorted(until.items()) if t > now}


def _stage_status(
    stage: StagePlan, run: BringUp | None, footprint: ModelFootprint
) -> dict[str, Any]:
    """One stage of the plan as the status shows it: its layers, its state and progress in
    ``run``, and its memory."""
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
    ) -> None:
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
        self._backend = backend
        self._on_pipeline = on_pipeline
        self._term = 0
        self._run_id = ""
        self._state = MeshState.PLANNING
        self._error = ""
        self._last_failure = ""  # kept after recovery: why the plan is not the first one
        self._plan: Plan | None = None
        self._run: BringUp | None = None  # the latest run (its stages' states, progress)
        self._pipeline: RemotePipeline | None = None
        self._excluded: set[str] = set()
        self._cooling: dict[str, float] = {}  # node -> trio time its cool-off ends (Blame)
        self._first_plan = True
        self._recovering = False  # the plan was made after a loss: it may grow back
        self._failures = 0  # bring-ups failed in a row (the retry backs off)
        self._retry_at: float | None = None  # trio time of the next try, while backing off
        self._hung: list[RemotePipeline] = []  # whose stage-0 compute hangs (stage0_hung)

    # -- status -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        run = self._run
        stages = (
            [_stage_status(s, run, self.footprint) for s in self._plan.stages] if self._plan else []
        )
        return {
            "model": self.settings.model_ref,
            "run_id": self._run_id,
            "term": self._term,
            "state": self._state,
            "error": self._error,
            "retry_in_s": retry_in(self._retry_at, now),
            "last_failure": self._last_failure,
            "context_size": self.context_size,
            "wire_dtype": self.settings.wire_dtype,
            "stages": stages,
            "cooling_off": seconds_left(self._cooling, now),
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
                excluded=self._excluded,
            )
            log.info("run %s term %d: %s", self._run_id, self._term, _describe(placed))
            self._state = MeshState.LOADING  # Claim, Prepare, Load: the stages say how far
            try:
                pipeline = await run.run(placed)
            except RunError as exc:
                self._error = self._last_failure = str(exc)
                self._state = MeshState.FAILED
                self._recovering = True
                log.warning("run %s failed: %s", self._run_id, exc)
                await run.stop_all(placed, str(exc))
                await self._back_off()
                self._error = ""  # the next plan's own trouble, if any (last_failure keeps it)
                continue
            self._failures = 0
            self._pipeline = pipeline
            self._error = ""
            loss = await self._serve(placed, pipeline, run)
            if loss is None:  # drained: the API answers 503 already
                reason = "the planned nodes are back: the plan grows back"
                self._recovering = False
            else:
                self._on_pipeline(None)
                reason = loss.reason
                self._last_failure = reason
                self._recovering = True
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
            self._error = (
                f"stage 0 on this node hangs: {len(self._hung)} of its passes have not come "
                "back; no new run until one does (restart meshnode if none does)"
            )
            await trio.sleep(1.0)
            self._hung = [p for p in self._hung if p.stage0_hung]
            if len(self._hung) < MAX_HUNG_STAGE0:
                self._error = ""

    async def _back_off(self) -> None:
        self._failures += 1
        delay = retry_delay(self._failures)
        log.info("retrying in %.1f s (failure %d in a row)", delay, self._failures)
        self._retry_at = trio.current_time() + delay
        try:
            await trio.sleep(delay)
        finally:
            self._retry_at = None

    async def _serve(self, placed: Plan, pipeline: RemotePipeline, run: BringUp) -> Loss | None:
        """Serve on ``pipeline`` until a stage is lost (the loss) or the plan grows back (None)."""
        regrow_now = announce = True
        while True:
            if announce:
                self._state = MeshState.READY
                self._on_pipeline(pipeline)
            loss = await self._watch(placed, pipeline, regrow_now=regrow_now)
            if loss is not None:
                if loss.node is None:
                    loss = await self._blame(placed, pipeline, run)
                return loss
            idle = await idle_by(pipeline, REGROW_IDLE_WAIT_S, lambda: self._wait_changed(pipeline))
            announce = idle is not None  # None: a stage failed or the membership changed
            if announce:  # else look again, still serving on this pipeline
                self._state = MeshState.DRAINING
                self._on_pipeline(None)  # new requests get 503 until the new plan is ready
                if await _settled(pipeline, self._run_id, idle=bool(idle)):
                    return None
                regrow_now = False  # until the membership changes again

    async def _blame(self, placed: Plan, pipeline: RemotePipeline, run: BringUp) -> Loss:
        """The loss of a pipeline that failed without naming its node: probe the stages and
        cool the blamed one off (module docstring, Blame)."""
        reason = str(pipeline.failure)
        answers = await run.probe(placed)
        min_busy_ms = int(pipeline.deadline.base_s * 1000 / 2)
        node = blame(placed.node_ids[1:], answers, min_busy_ms=min_busy_ms)
        log.warning("run %s: %s; probe: %s; blamed: %s", self._run_id, reason, answers, node)
        if node is None:
            return Loss(None, f"{reason} (no stage to blame)")
        self._cooling[node] = trio.current_time() + BLAME_COOL_OFF_S
        return Loss(node, f"{reason}: blamed on stage node {node}")

    def _cooled_off(self) -> set[str]:
        """Nodes still cooling off; forgets those whose cool-off ended."""
        now = trio.current_time()
        self._cooling = {n: t for n, t in self._cooling.items() if t > now}
        return set(self._cooling)

    async def _wait_changed(self, pipeline: RemotePipeline | None = None) -> bool:
        """Wait for a membership change (True), or for ``pipeline`` to fail or a cool-off
        to end (False)."""
        changed = False
        membership_changed = self.mesh.membership_event()  # before any checkpoint
        until = min(self._cooling.values(), default=math.inf)
        with trio.move_on_at(until):
            async with trio.open_nursery() as nursery:

                async def membership() -> None:
                    nonlocal changed
                    await membership_changed.wait()
                    changed = True
                    nursery.cancel_scope.cancel()

                async def failure(failed: trio.Event) -> None:
                    await failed.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(membership)
                if pipeline is not None:
                    nursery.start_soon(failure, pipeline.failed)
        return changed

    async def _plan_when_possible(self) -> Plan:
        self._state = MeshState.PLANNING
        while True:
            kept_out = self._excluded | self._cooled_off()
            nodes = [n for n in self.mesh.live_nodes() if n.node_id not in kept_out]
            split = self.settings.split
            if split is not None and not self._first_plan and len(nodes) < split:
                split = None  # after a loss, serve on what is left rather than not at all
            try:
                result = plan(
                    self.footprint,
                    nodes,
                    host_id=self.mesh.node_id,
                    context_tokens=self.context_size,
                    split=split,
                )
                self._first_plan = False
                return result
            except PlanError as exc:
                if str(exc) != self._error:
                    log.info("waiting for nodes: %s", exc)
                self._error = str(exc)
            if await self._wait_changed():
                self._excluded.clear()  # the membership changed: give failed nodes another go

    async def _watch(
        self, placed: Plan, pipeline: RemotePipeline, *, regrow_now: bool = True
    ) -> Loss | None:
        """The first loss of a stage (``node`` None when the pipeline failed without
        naming it), or ``None`` once the plan should grow back
        (:func:`~meshnode.node.planner.should_regrow`); with ``regrow_now`` false, growing
        back waits for the next membership change or the end of a cool-off."""
        while True:
            live = self.mesh.live_nodes()
            live_ids = {n.node_id for n in live}
            failure = pipeline.failure
            if failure is not None and failure.left:  # a goodbye: neither kept out nor blamed
                return Loss(failure.node, str(failure))
            for stage in placed.stages:
                if stage.node_id not in live_ids:
                    return Loss(stage.node_id, f"stage node {stage.node_id} was lost")
            if failure is not None:
                if failure.node not in (None, self.mesh.node_id):  # never the host itself
                    self._excluded.add(failure.node)  # until the membership changes
                return Loss(failure.node, str(failure))
            if regrow_now and self._wants_regrow(placed, live):
                return None
            changed = await self._wait_changed(pipeline)
            regrow_now = True
            if changed:
                self._excluded.clear()  # the membership changed: give failed nodes another go

    def _wants_regrow(self, placed: Plan, live: list[NodeCapacity]) -> bool:
        kept_out = self._excluded | self._cooled_off()
        nodes = [n for n in live if n.node_id not in kept_out]
        try:
            wanted: Plan | None = plan(
                self.footprint,
                nodes,
                host_id=self.mesh.node_id,
                context_tokens=self.context_size,
                split=self.settings.split,
            )
        except PlanError:
            wanted = None
        return should_regrow(placed, wanted, split=self.settings.split, degraded=self._recovering)

    # -- bring-up -----------------------------------------------------------------------


async def _settled(pipeline: RemotePipeline, run_id: str, *, idle: bool) -> bool:
    """Whether the model may be re-placed now that the API answers 503: at once when
    ``pipeline`` went ``idle`` (no checkpoint since: no request came); else once the
    requests in flight finish, False when they have not within ``REGROW_DRAIN_TIMEOUT_S``
    (the regrow is put off)."""
    if idle:
        log.info("the planned nodes are back: re-placing between requests")
        return True
    log.info(
        "the planned nodes are back and requests kept coming for %.0f s: draining %s to re-place",
        REGROW_IDLE_WAIT_S,
        run_id,
    )
    with trio.move_on_after(REGROW_DRAIN_TIMEOUT_S):
        await pipeline.wait_idle()
        return True
    log.warning("requests in flight after %.0f s: regrow put off", REGROW_DRAIN_TIMEOUT_S)
    return False


def _describe(placed: Plan) -> str:
    return ", ".join(f"{s.node_id}[{s.start}:{s.end})" for s in placed.stages)


async def open_stage0_source(model_ref: str, cache_dir: Path | None) -> ModelSource:
    """The model's config and tokenizer side (its manifest and embedding), off the loop."""
    return await trio.to_thread.run_sync(
        lambda: open_ref(model_ref, Part(0, 0, embed=True), cache_dir=cache_dir)
    )
