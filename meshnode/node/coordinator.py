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

import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import trio
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import RemotePackage, is_url, open_ref, resolve
from meshnode_packaging.sources import ModelSource
from meshnode_protocol import (
    Claim,
    ClaimAccepted,
    ClaimRejected,
    Error,
    Inventory,
    InventoryReport,
    Load,
    Message,
    PeerInfo,
    Prepare,
    PrepareAccepted,
    Ready,
    Stop,
)

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.hybrid_config import HybridConfig
from meshnode.engine.model import Stage
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS
from meshnode.errors import PlanError, RunError
from meshnode.net.stream import SEND_ERRORS
from meshnode.node.planner import (
    ModelFootprint,
    NodeCapacity,
    Plan,
    StagePlan,
    plan,
    should_regrow,
)
from meshnode.node.progress import DownloadProgress
from meshnode.node.remote import RemotePipeline, is_data_reply
from meshnode.node.stage import MAX_SEQUENCES_PER_STAGE, StageRunner, default_context

log = logging.getLogger("meshnode.coordinator")

# A reply to Claim/Prepare/Load is a few ms on a LAN; a node silent this long is unhealthy.
REPLY_TIMEOUT_S = 10.0
# Loading builds the engine stage (dequantizing weights): seconds per GiB on a CPU.
LOAD_TIMEOUT_S = 300.0
# Materializing downloads the part; big models on slow links take long, but not forever.
PREPARE_TIMEOUT_S = 3600.0
INVENTORY_POLL_S = 0.25
# Longest wait for the requests in flight before a regrow: a request is bounded by its
# context, and a few minutes covers the default context decoded on a slow CPU mesh.
REGROW_DRAIN_TIMEOUT_S = 300.0
# Replies waiting for the coordinator; it asks one thing of a node at a time.
REPLY_QUEUE = 16


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


def model_footprint(config: ModelConfig, bytes_per_param: int = 4) -> ModelFootprint:
    """Bytes the planner must reserve per layer, for the embedding, the head and the KV.

    Weights are held as float32 on the CPU backend (``bytes_per_param`` 4). Every live
    sequence preallocates KV for the whole context, so KV scales with the sequence limit.
    """
    if config.hybrid is not None:
        return _hybrid_footprint(config, config.hybrid, bytes_per_param)
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    embed = config.vocab_size * h
    head = h + (0 if config.tie_word_embeddings else config.vocab_size * h)
    kv_bytes = 2 * kv * 4 * MAX_SEQUENCES_PER_STAGE  # float32 K and V
    return ModelFootprint(
        layer_bytes=(layer_params * bytes_per_param,) * config.num_layers,
        embed_bytes=embed * bytes_per_param,
        head_bytes=head * bytes_per_param,
        kv_bytes_per_token_per_layer=kv_bytes,
        tied_head=config.tie_word_embeddings,
    )


def _hybrid_footprint(
    config: ModelConfig, hybrid: HybridConfig, bytes_per_param: int
) -> ModelFootprint:
    """A hybrid model's footprint: KV on the attention layers only; on each DeltaNet layer
    the recurrent state and snapshot ring of every live sequence, whatever the context."""
    layers = range(hybrid.num_layers)
    per_sequence = hybrid.recurrent_shape().nbytes() * (1 + DEFAULT_RING_SLOTS)
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


M = TypeVar("M", bound=Message)


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
        self.footprint = model_footprint(self.config)
        self._backend = backend
        self._on_pipeline = on_pipeline
        self._term = 0
        self._run_id = ""
        self._state = "planning"
        self._error = ""
        self._last_failure = ""  # kept after recovery: why the plan is not the first one
        self._plan: Plan | None = None
        self._progress: dict[str, tuple[int, int]] = {}
        self._download_log: dict[str, DownloadProgress] = {}
        self._stage_state: dict[str, str] = {}
        self._pipeline: RemotePipeline | None = None
        self._replies: dict[str, trio.MemorySendChannel[Message]] = {}
        self._excluded: set[str] = set()
        self._first_plan = True
        self._recovering = False  # the plan was made after a loss: it may grow back

    # -- status -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        stages = []
        for stage in self._plan.stages if self._plan else ():
            done, total = self._progress.get(stage.node_id, (0, 0))
            stages.append(
                {
                    "node_id": stage.node_id,
                    "layers": [stage.start, stage.end],
                    "embed": stage.embed,
                    "head": stage.head,
                    "state": self._stage_state.get(stage.node_id, "planned"),
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
        channel = self._replies.get(peer)
        if channel is not None:
            with contextlib.suppress(trio.WouldBlock):
                channel.send_nowait(message)
        return True

    def peer_lost(self, peer: str) -> None:
        """The session with ``peer`` ended: fail what waits on it now, not at a timeout."""
        if self._pipeline is not None and peer in self._pipeline.stage_nodes:
            self._pipeline.fail(f"stage node {peer} was lost; the mesh is replanning")
        replies = self._replies.pop(peer, None)
        if replies is not None:
            replies.close()  # a bring-up waiting for this node's reply fails at once

    # -- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        """Plan, bring up, serve, watch; forever (cancel to stop)."""
        while True:
            placed = await self._plan_when_possible()
            # The wall clock, not trio's: the term must compare across processes.
            self._term = next_term(self._term, time.time_ns())
            self._run_id = f"run-{secrets.token_hex(4)}"
            self._plan = placed
            self._stage_state = {s.node_id: "claiming" for s in placed.stages}
            self._progress = {}
            log.info("run %s term %d: %s", self._run_id, self._term, _describe(placed))
            try:
                pipeline = await self._bring_up(placed)
            except RunError as exc:
                self._error = self._last_failure = str(exc)
                self._state = "failed"
                self._recovering = True
                log.warning("run %s failed: %s", self._run_id, exc)
                await self._stop_all(placed, str(exc))
                continue
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
            await self._stop_all(placed, reason)

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

    async def _bring_up(self, placed: Plan) -> RemotePipeline:
        local, remote = placed.stages[0], placed.stages[1:]
        self._replies = {}
        receivers = {}
        for stage in remote:
            send, receive = trio.open_memory_channel[Message](REPLY_QUEUE)
            self._replies[stage.node_id] = send
            receivers[stage.node_id] = receive
        for stage in remote:
            await self._request(stage.node_id, receivers, self._claim(), ClaimAccepted)
            self._stage_state[stage.node_id] = "claimed"
        runner_box: list[StageRunner] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._prepare_local, local, runner_box)
                for stage in remote:
                    nursery.start_soon(self._prepare_remote, stage, receivers)
        except BaseExceptionGroup as group:
            # The nursery groups the failures of parallel preparations; a run that failed
            # to prepare is one RunError for the loop (anything else, cancellation
            # included, propagates unchanged).
            failed, rest = group.split(RunError)
            if failed is None or rest is not None:
                raise
            reasons = "; ".join(str(exc) for exc in _leaves(failed))
            raise RunError(reasons) from group
        for index in range(len(remote) - 1, -1, -1):  # downstream-first
            stage = remote[index]
            upstream = placed.stages[index]
            downstream = placed.stages[index + 2] if index + 2 < len(placed.stages) else None
            self._stage_state[stage.node_id] = "loading"
            await self._request(
                stage.node_id,
                receivers,
                self._load(stage, upstream.node_id, downstream),
                Ready,
                timeout_s=LOAD_TIMEOUT_S,
            )
            self._stage_state[stage.node_id] = "ready"
        self._stage_state[local.node_id] = "ready"
        return RemotePipeline(
            runner_box[0],
            run_id=self._run_id,
            term=self._term,
            stage_nodes=placed.node_ids,
            send=self.mesh.send,
            wire_dtype=self.settings.wire_dtype,
        )

    def _claim(self) -> Claim:
        return Claim(
            run_id=self._run_id,
            term=self._term,
            coordinator_id=self.mesh.node_id,
            package_ref=self.settings.model_ref,
        )

    def _load(self, stage: StagePlan, upstream: str, downstream: StagePlan | None) -> Load:
        return Load(
            run_id=self._run_id,
            term=self._term,
            package_ref=self.settings.model_ref,
            manifest_sha256="",
            layer_range=(stage.start, stage.end),
            has_embed=stage.embed,
            has_head=stage.head,
            upstream=self.mesh.peer_info(upstream),
            # The last stage's downstream is the host: its Predictions come straight back.
            downstream=self.mesh.peer_info(downstream.node_id if downstream else self.mesh.node_id),
            wire_dtype=self.settings.wire_dtype,
            context_size=self.context_size,
            batch_sizes=(1,),
            kv_dtype="f32",
        )

    async def _prepare_local(self, stage: StagePlan, box: list[StageRunner]) -> None:
        self._stage_state[stage.node_id] = "preparing"
        part = Part(stage.start, stage.end, embed=True, head=stage.head)

        def progress(done: int, total: int) -> None:
            self._record_progress(stage.node_id, done, total, time.monotonic())

        def build() -> StageRunner:
            source = self._open_part(part, progress)
            engine_stage = Stage(
                self.config,
                source,
                stage.start,
                stage.end,
                embed=True,
                head=stage.head,
                backend=self._backend,
            )
            return StageRunner(
                engine_stage,
                context_size=self.context_size,
                max_sequences=MAX_SEQUENCES_PER_STAGE,
            )

        try:
            box.append(await trio.to_thread.run_sync(build))
        except Exception as exc:
            raise RunError(f"loading stage 0 on this node failed: {exc}") from exc
        self._stage_state[stage.node_id] = "loaded"

    def _open_part(self, part: Part, progress: Callable[[int, int], None]) -> ModelSource:
        """The host's part of the model (call off the event loop).

        A local model (alias, file, folder) is opened whole and memory-mapped, so the source
        the host already holds serves every plan; only a remote package has parts to fetch.
        """
        if not isinstance(resolve(self.settings.model_ref), RemotePackage):
            return self.source
        return open_ref(
            self.settings.model_ref,
            part,
            cache_dir=self.settings.cache_dir,
            progress=progress,
            pin=self.settings.pin,
        )

    def _record_progress(self, node: str, done: int, total: int, now_s: float) -> None:
        """Keep a stage's download progress for status, and log it now and then."""
        self._progress[node] = (done, total)
        tracker = self._download_log.setdefault(node, DownloadProgress(f"stage on {node}"))
        if line := tracker.update(done, total, now_s):
            log.info("%s", line)

    async def _prepare_remote(
        self, stage: StagePlan, receivers: dict[str, trio.MemoryReceiveChannel[Message]]
    ) -> None:
        node = stage.node_id
        prepare = Prepare(
            run_id=self._run_id,
            term=self._term,
            package_ref=self.settings.model_ref,
            manifest_sha256=self.settings.pin if is_url(self.settings.model_ref) else "",
            layer_range=(stage.start, stage.end),
            has_embed=stage.embed,
            has_head=stage.head,
            commit="" if is_url(self.settings.model_ref) else self.settings.pin,
        )
        await self._request(node, receivers, prepare, PrepareAccepted)
        self._stage_state[node] = "preparing"
        inventory = Inventory(
            run_id=self._run_id, term=self._term, package_ref=self.settings.model_ref
        )
        with trio.move_on_after(PREPARE_TIMEOUT_S):
            while True:
                report = await self._request(node, receivers, inventory, InventoryReport)
                self._record_progress(
                    node, report.bytes_done, report.bytes_total, trio.current_time()
                )
                if report.error:
                    self._excluded.add(node)
                    raise RunError(f"node {node} could not prepare its layers: {report.error}")
                if report.ready:
                    self._stage_state[node] = "prepared"
                    return
                await trio.sleep(INVENTORY_POLL_S)
        self._excluded.add(node)
        raise RunError(f"node {node} did not prepare its layers in {PREPARE_TIMEOUT_S:.0f} s")

    async def _request(
        self,
        node: str,
        receivers: dict[str, trio.MemoryReceiveChannel[Message]],
        message: Message,
        expected: type[M],
        *,
        timeout_s: float = REPLY_TIMEOUT_S,
    ) -> M:
        """Send ``message`` to ``node`` and return its reply of type ``expected``.

        Raises RunError (and excludes the node from the next plan) on a refusal, an
        ``Error``, a lost session or a timeout.
        """
        what = type(message).__name__
        try:
            await self.mesh.send(node, message)
            with trio.fail_after(timeout_s):
                while True:
                    reply = await receivers[node].receive()
                    if isinstance(reply, expected):
                        return reply
                    if isinstance(reply, ClaimRejected | Error):
                        reason = reply.reason if isinstance(reply, ClaimRejected) else reply.message
                        raise RunError(f"node {node} refused {what}: {reason}")
        except trio.TooSlowError:
            failure = f"node {node} did not answer {what} within {timeout_s:.0f} s"
        except SEND_ERRORS:
            failure = f"node {node} is unreachable"
        except trio.EndOfChannel:
            failure = f"node {node} was lost while the run was brought up"
        except RunError:
            self._excluded.add(node)
            raise
        self._excluded.add(node)
        raise RunError(failure)

    async def _stop_all(self, placed: Plan, reason: str) -> None:
        stop = Stop(run_id=self._run_id, term=self._term, reason=reason)
        for stage in placed.stages[1:]:
            with contextlib.suppress(*SEND_ERRORS):
                await self.mesh.send(stage.node_id, stop)
        self._replies = {}


def _leaves(group: BaseExceptionGroup[RunError]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _describe(placed: Plan) -> str:
    return ", ".join(f"{s.node_id}[{s.start}:{s.end})" for s in placed.stages)


async def open_stage0_source(model_ref: str, cache_dir: Path | None) -> ModelSource:
    """The model's config and tokenizer side (its manifest and embedding), off the loop."""
    return await trio.to_thread.run_sync(
        lambda: open_ref(model_ref, Part(0, 0, embed=True), cache_dir=cache_dir)
    )
