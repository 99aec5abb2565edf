"""The coordinator: the host's loop that places the model on the mesh and keeps it placed.

Theory of operation (DESIGN §5). The host (the node started with ``--model``) opens the
model's stage-0 part to learn its config, then loops:

1. **plan** the live nodes (:func:`meshnode.node.planner.plan`); with no fit, wait for the
   membership to change and try again;
2. **bring up** a run with a new ``term``: ``Claim`` every other planned node, ``Prepare``
   each (they materialize their part in the background, the host its own), poll
   ``Inventory`` until every part is ready, ``Load`` downstream-first, wait for ``Ready``;
3. **serve**: hand a :class:`~meshnode.node.remote.RemotePipeline` to the API;
4. **watch**: when a stage's node is lost, fail the in-flight requests, ``Stop`` the others
   and go back to 1 without it;
5. **grow back**: when the nodes ``--split`` asks for (or that the planner would choose)
   are live again after a loss (:func:`~meshnode.node.planner.should_regrow`), stop
   admitting requests (the API answers 503 while the mesh is re-placed), let the requests
   in flight finish on the old pipeline, and go back to 1. A drain that does not finish
   within ``REGROW_DRAIN_TIMEOUT_S`` is abandoned: serving resumes on the old pipeline and
   the next membership change tries again. No request in flight is failed by a regrow.

A failed step ``Stop``s every node claimed for the run and replans without the failed node
(it is excluded until the membership changes again). Every message carries the run id and
term, so a late reply of an abandoned run is recognised and dropped.

Terms survive restarts (:func:`next_term`): a worker keeps the newest term of a claim and
refuses an older one, so a restarted host whose terms began again at 1 was
``ClaimRejected`` by every worker still holding its previous process's term.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from meshnode.engine.hybrid_config import HybridConfig
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS
from meshnode.engine.weights import HeldBytes, held_bytes
from meshnode.errors import PlanError, RunError
from meshnode.node.bringup import BringUp
from meshnode.node.planner import (
    ModelFootprint,
    NodeCapacity,
    Plan,
    plan,
    should_regrow,
)
from meshnode.node.remote import RemotePipeline, is_data_reply
from meshnode.node.stage import MAX_SEQUENCES_PER_STAGE, default_context

log = logging.getLogger("meshnode.coordinator")

# Longest wait for the requests in flight before a regrow: a request is bounded by its
# context, and a few minutes covers the default context decoded on a slow CPU mesh.
REGROW_DRAIN_TIMEOUT_S = 300.0
# A failed bring-up is retried after RETRY_BACKOFF_FIRST_S, doubling with each failure in
# a row up to RETRY_BACKOFF_MAX_S. A stage that keeps failing (a damaged file, a device
# that refuses) replanned at once, 46 times in 12 s, flooding the log and the workers;
# a passing glitch (a node that restarted) still costs under a second.
RETRY_BACKOFF_FIRST_S = 0.5
RETRY_BACKOFF_MAX_S = 30.0


def retry_delay(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failed bring-up in a row (0 for none)."""
    if failures < 1:
        return 0.0
    return float(min(RETRY_BACKOFF_FIRST_S * 2.0 ** (failures - 1), RETRY_BACKOFF_MAX_S))


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

    async def wait_changed(self) -> None:
        """Return after the next membership change."""
        ...


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    model_ref: str
    context_size: int | None = None
    split: int | None = None
    wire_dtype: str = "f16"
    cache_dir: Path | None = None
    # What the host resolved ``model_ref`` to (``refs.pin_ref``): a hub commit or a URL
    # package's manifest sha256, sent in every Prepare so that no stage reads another one.
    pin: str = ""
    # Per-sequence recurrent-state snapshots each hybrid stage keeps (``Load.ring_slots``):
    # the host's largest verify pass (``engine.recurrent.ring_slots_for``).
    ring_slots: int = DEFAULT_RING_SLOTS


def model_footprint(
    config: ModelConfig,
    bytes_per_param: int = 4,
    held: HeldBytes | None = None,
    ring_slots: int = DEFAULT_RING_SLOTS,
) -> ModelFootprint:
    """Bytes the planner must reserve per layer, for the embedding, the head and the KV.

    Weights: ``held`` when known (a CPU stage keeps the file's GGUF blocks, so a layer
    costs its tensors' bytes in the file; :func:`~meshnode.engine.weights.held_bytes`),
    else every parameter at ``bytes_per_param`` (4: float32, the most any backend holds).
    Every live sequence preallocates KV for the whole context, so KV scales with the
    sequence limit.
    """
    if config.hybrid is not None:
        return _hybrid_footprint(config, config.hybrid, bytes_per_param, ring_slots)
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    embed = config.vocab_size * h
    head = h + (0 if config.tie_word_embeddings else config.vocab_size * h)
    kv_bytes = 2 * kv * 4 * MAX_SEQUENCES_PER_STAGE  # float32 K and V
    if held is None:
        held = HeldBytes(
            (layer_params * bytes_per_param,) * config.num_layers,
            embed * bytes_per_param,
            head * bytes_per_param,
        )
    return ModelFootprint(
        layer_bytes=held.layers,
        embed_bytes=held.embed,
        head_bytes=held.head,
        kv_bytes_per_token_per_layer=kv_bytes,
        tied_head=config.tie_word_embeddings,
    )


def _hybrid_footprint(
    config: ModelConfig, hybrid: HybridConfig, bytes_per_param: int, ring_slots: int
) -> ModelFootprint:
    """A hybrid model's footprint: KV on the attention layers only; on each DeltaNet layer
    the recurrent state and snapshot ring of every live sequence, whatever the context."""
    layers = range(hybrid.num_layers)
    per_sequence = hybrid.recurrent_shape().nbytes() * (1 + ring_slots)
    h, vocab = hybrid.hidden_size, hybrid.vocab_size
    return ModelFootprint(
        layer_bytes=tuple(hybrid.layer_params(i) * bytes_per_param for i in layers),
        embed_bytes=vocab * h * bytes_per_param,
        head_bytes=(h + (0 if hybrid.tie_word_embeddings else vocab * h)) * bytes_per_param,
        kv_bytes_per_token_per_layer=2 * config.kv_size * 4 * MAX_SEQUENCES_PER_STAGE,
        tied_head=hybrid.tie_word_embeddings,
        kv_layers=tuple(not hybrid.is_linear(i) for i in layers),
        fixed_layer_bytes=tuple(
            per_sequence * MAX_SEQUENCES_PER_STAGE if hybrid.is_linear(i) else 0 for i in layers
        ),
    )


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
        self.context_size = settings.context_size or default_context(self.config)
        self.footprint = model_footprint(
            self.config,
            held=held_bytes(source, self.config, backend),
            ring_slots=settings.ring_slots,
        )
        self._backend = backend
        self._on_pipeline = on_pipeline
        self._term = 0
        self._run_id = ""
        self._state = "planning"
        self._error = ""
        self._last_failure = ""  # kept after recovery: why the plan is not the first one
        self._plan: Plan | None = None
        self._run: BringUp | None = None  # the latest run (its stages' states, progress)
        self._pipeline: RemotePipeline | None = None
        self._excluded: set[str] = set()
        self._first_plan = True
        self._recovering = False  # the plan was made after a loss: it may grow back
        self._failures = 0  # bring-ups failed in a row (the retry backs off)
        self._retry_at: float | None = None  # trio time of the next try, while backing off

    # -- status -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        stages = []
        for stage in self._plan.stages if self._plan else ():
            progress = self._run.progress if self._run else {}
            done, total = progress.get(stage.node_id, (0, 0))
            stages.append(
                {
                    "node_id": stage.node_id,
                    "layers": [stage.start, stage.end],
                    "embed": stage.embed,
                    "head": stage.head,
                    "state": self._run.stage_state.get(stage.node_id, "planned")
                    if self._run
                    else "planned",
                    "bytes_done": done,
                    "bytes_total": total,
                    "memory_bytes": stage.memory_bytes,
                    # recurrent state + snapshot ring reserved for every live sequence
                    "recurrent_bytes": sum(
                        self.footprint.fixed_layer_bytes[stage.start : stage.end]
                    ),
                }
            )
        return {
            "model": self.settings.model_ref,
            "run_id": self._run_id,
            "term": self._term,
            "state": self._state,
            "error": self._error,
            "retry_in_s": None
            if self._retry_at is None
            else round(max(0.0, self._retry_at - trio.current_time()), 1),
            "last_failure": self._last_failure,
            "context_size": self.context_size,
            "wire_dtype": self.settings.wire_dtype,
            "stages": stages,
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

    def peer_lost(self, peer: str) -> None:
        """The session with ``peer`` ended: fail what waits on it now, not at a timeout."""
        if self._pipeline is not None and peer in self._pipeline.stage_nodes:
            self._pipeline.fail(f"stage node {peer} was lost; the mesh is replanning")
        if self._run is not None:
            self._run.lost(peer)  # a bring-up waiting for this node's reply fails at once

    # -- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        """Plan, bring up, serve, watch; forever (cancel to stop)."""
        while True:
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
            self._state = "loading"  # Claim, Prepare, Load: the stages say how far
            try:
                pipeline = await run.run(placed)
            except RunError as exc:
                self._error = self._last_failure = str(exc)
                self._state = "failed"
                self._recovering = True
                log.warning("run %s failed: %s", self._run_id, exc)
                await run.stop_all(placed, str(exc))
                await self._back_off()
                self._error = ""  # the next plan's own trouble, if any (last_failure keeps it)
                continue
            self._failures = 0
            self._pipeline = pipeline
            self._error = ""
            lost = await self._serve(placed, pipeline)
            if lost is None:  # drained: the API answers 503 already
                reason = "the planned nodes are back: the plan grows back"
                self._recovering = False
            else:
                self._on_pipeline(None)
                reason = f"stage node {lost} was lost"
                self._last_failure = reason
                self._recovering = True
                pipeline.fail(f"{reason}; the mesh is replanning")
            self._pipeline = None
            self._state = "replanning"
            await run.stop_all(placed, reason)

    async def _back_off(self) -> None:
        self._failures += 1
        delay = retry_delay(self._failures)
        log.info("retrying in %.1f s (failure %d in a row)", delay, self._failures)
        self._retry_at = trio.current_time() + delay
        try:
            await trio.sleep(delay)
        finally:
            self._retry_at = None

    async def _serve(self, placed: Plan, pipeline: RemotePipeline) -> str | None:
        """Serve on ``pipeline`` until a stage node is lost (its id) or the plan should grow
        back and the requests in flight have finished (``None``)."""
        regrow_now = True
        while True:
            self._state = "ready"
            self._on_pipeline(pipeline)
            lost = await self._watch(placed, regrow_now=regrow_now)
            if lost is not None:
                return lost
            self._state = "draining"
            self._on_pipeline(None)  # new requests get 503 until the new plan is ready
            log.info("the planned nodes are back: draining %s to re-place", self._run_id)
            with trio.move_on_after(REGROW_DRAIN_TIMEOUT_S):
                await pipeline.wait_idle()
                return None
            log.warning("requests in flight after %.0f s: regrow put off", REGROW_DRAIN_TIMEOUT_S)
            regrow_now = False  # until the membership changes again

    async def _plan_when_possible(self) -> Plan:
        self._state = "planning"
        while True:
            nodes = [n for n in self.mesh.live_nodes() if n.node_id not in self._excluded]
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
            await self.mesh.wait_changed()
            self._excluded.clear()  # the membership changed: give failed nodes another go

    async def _watch(self, placed: Plan, *, regrow_now: bool = True) -> str | None:
        """The id of the first stage node that is lost, or ``None`` once the plan should
        grow back (:func:`~meshnode.node.planner.should_regrow`); with ``regrow_now``
        false, growing back waits for the next membership change."""
        while True:
            live = self.mesh.live_nodes()
            live_ids = {n.node_id for n in live}
            for stage in placed.stages:
                if stage.node_id not in live_ids:
                    return stage.node_id
            if regrow_now and self._wants_regrow(placed, live):
                return None
            await self.mesh.wait_changed()
            regrow_now = True
            self._excluded.clear()  # the membership changed: give failed nodes another go

    def _wants_regrow(self, placed: Plan, live: list[NodeCapacity]) -> bool:
        nodes = [n for n in live if n.node_id not in self._excluded]
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


def _describe(placed: Plan) -> str:
    return ", ".join(f"{s.node_id}[{s.start}:{s.end})" for s in placed.stages)


async def open_stage0_source(model_ref: str, cache_dir: Path | None) -> ModelSource:
    """The model's config and tokenizer side (its manifest and embedding), off the loop."""
    return await trio.to_thread.run_sync(
        lambda: open_ref(model_ref, Part(0, 0, embed=True), cache_dir=cache_dir)
    )
