"""Bringing up one run: the conversation of the host with every stage of a plan.

``Claim`` every remote node of the plan (fenced by run id and term) → ``Prepare`` each (they
materialize their part in the background while the host builds its own stage 0; progress
from ``Inventory`` polls) → ``Load`` downstream-first → ``Ready``; the result is the run's
:class:`~meshnode.node.remote.RemotePipeline`. Any failure is one :class:`RunError` naming
the node, which is recorded in ``failed`` (or ``refused``: it refused the Claim, another
host holds it) for the coordinator's decisions (:mod:`meshnode.node.decisions`). The coordinator
(:mod:`meshnode.node.coordinator`) owns the loop around it and routes the replies here.

While the run serves, :meth:`BringUp.probe` asks its stages, over the same reply
channels, how long their pass in progress has run (``Inventory`` → ``InventoryReport``
``busy_ms``): the coordinator's evidence when a pass misses its deadline.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import trio
from meshnode_packaging.manifest import Part
from meshnode_packaging.reference import LocalPackage, RemotePackage
from meshnode_packaging.refs import check_local_package, is_url, open_ref, resolve
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
    Prepare,
    PrepareAccepted,
    Ready,
    Stop,
)

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.constraint import Grammars
from meshnode.engine.model import Stage
from meshnode.errors import RunError
from meshnode.net.stream import SEND_ERRORS
from meshnode.node import heap
from meshnode.node.claims import ClaimBook
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.planner import Plan, StagePlan
from meshnode.node.prefix import StagePrefix
from meshnode.node.prefix_keep import host_identity, host_seeds, kept_keys, take_over
from meshnode.node.progress import DownloadProgress
from meshnode.node.remote import RemotePipeline
from meshnode.node.selfmeasure import measure_or_reason
from meshnode.node.speeds import SpeedBook
from meshnode.node.stage import StageRunner
from meshnode.node.stage_build import place_weights

if TYPE_CHECKING:
    from meshnode.node.mesh import CoordinatorSettings, MeshView

log = logging.getLogger("meshnode.coordinator")

# A reply to Claim/Prepare/Load is a few ms on a LAN; a node silent this long is unhealthy.
REPLY_TIMEOUT_S = 10.0
# Loading builds the engine stage (dequantizing weights): seconds per GiB on a CPU.
LOAD_TIMEOUT_S = 300.0
# Materializing downloads the part; big models on slow links take long, but not forever.
PREPARE_TIMEOUT_S = 3600.0
INVENTORY_POLL_S = 0.25
# Replies waiting for the coordinator; it asks one thing of a node at a time.
REPLY_QUEUE = 16
# A probe's answer comes from the stage's session loop, which compute never blocks: a few
# ms on a LAN. A stage silent this long is unwell whatever it computes.
PROBE_TIMEOUT_S = 5.0

M = TypeVar("M", bound=Message)


class StageState(enum.StrEnum):
    """How far one stage of a bring-up got (``meshnode status`` shows the value)."""

    PLANNED = "planned"  # placed; the bring-up has not reached it yet
    CLAIMING = "claiming"
    CLAIMED = "claimed"
    PREPARING = "preparing"  # fetching its layers
    PREPARED = "prepared"
    LOADING = "loading"
    LOADED = "loaded"
    READY = "ready"


class BringUp:
    """One run (``run_id``, ``term``) brought up on a plan; see the module docstring.

    ``stage_state`` and ``progress`` (bytes done and total, by node) are what status shows.
    A node that fails is added to ``failed``; one that refuses the Claim to ``refused``.
    """

    def __init__(
        self,
        mesh: MeshView,
        settings: CoordinatorSettings,
        placed: Plan,
        *,
        run_id: str,
        term: int,
        config: ModelConfig,
        source: ModelSource,
        backend: Backend,
        context_size: int,
        speeds: SpeedBook | None = None,
        stage_weight_bytes: Sequence[int] = (),
        claims: ClaimBook | None = None,
        kept: StagePrefix | None = None,  # stage 0's pool of the run before
    ) -> None:
        self.mesh = mesh
        self.settings = settings
        self.run_id = run_id
        self.term = term
        self.config = config
        self.source = source
        self.context_size = context_size
        self.stage_state = {s.node_id: StageState.CLAIMING for s in placed.stages}
        self.progress: dict[str, tuple[int, int]] = {}
        self.backend = backend
        self._speeds, self._stage_weight_bytes = speeds, tuple(stage_weight_bytes)
        # what each node measured of itself as it prepared (its links alone by memory)
        self._claims = claims
        self.failed: set[str] = set()
        self.refused: set[str] = set()
        self._download_log: dict[str, DownloadProgress] = {}
        self._replies: dict[str, trio.MemorySendChannel[Message]] = {}
        self._receivers: dict[str, trio.MemoryReceiveChannel[Message]] = {}
        self._kept = kept
        # hook (issue 30): the prefix-cache keys outlive the run (node/prefix_keep.py),
        # each stage's by what changes its own K/V
        self.prefix_seeds = host_seeds(mesh, settings, backend, placed)

    def deliver(self, peer: str, message: Message) -> None:
        """A reply of this run from ``peer``, for the request waiting on it."""
        channel = self._replies.get(peer)
        if channel is not None:
            with contextlib.suppress(trio.WouldBlock):
                channel.send_nowait(message)

    def lost(self, peer: str) -> None:
        """The session with ``peer`` ended: a request waiting on it fails at once."""
        replies = self._replies.pop(peer, None)
        if replies is not None:
            replies.close()

    async def run(self, placed: Plan) -> RemotePipeline:
        """Claim, prepare, load and ready every stage of ``placed``; its pipeline.

        Raises RunError naming the node and step that failed.
        """
        local, remote = placed.stages[0], placed.stages[1:]
        receivers = self._receivers
        for stage in remote:
            send, receive = trio.open_memory_channel[Message](REPLY_QUEUE)
            self._replies[stage.node_id] = send
            receivers[stage.node_id] = receive
        for stage in remote:
            await self._request(stage.node_id, receivers, self._claim(), ClaimAccepted)
            self.stage_state[stage.node_id] = StageState.CLAIMED
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
        prefix_blocks = []  # hook (issue 30): each stage's prefix-cache block size
        prefix_held = []  # ... and the keys of what it kept of the run before
        for index in range(len(remote) - 1, -1, -1):  # downstream-first
            stage = remote[index]
            upstream = placed.stages[index]
            downstream = placed.stages[index + 2] if index + 2 < len(placed.stages) else None
            self.stage_state[stage.node_id] = StageState.LOADING
            ready = await self._request(
                stage.node_id,
                receivers,
                _load(self, index + 1, stage, upstream.node_id, downstream),
                Ready,
                timeout_s=LOAD_TIMEOUT_S,
            )
            # a stage that keys with another seed (an older node's run id) shares nothing
            echoed = ready.prefix_seed == self.prefix_seeds[index + 1]
            prefix_blocks.append(ready.prefix_block if echoed else 0)
            prefix_held.append(ready.prefix_keys)
            self.stage_state[stage.node_id] = StageState.READY
        self.stage_state[local.node_id] = StageState.READY
        return RemotePipeline(
            runner_box[0],
            run_id=self.run_id,
            term=self.term,
            stage_nodes=placed.node_ids,
            send=self.mesh.send,
            wire_dtype=self.settings.wire_dtype,
            deadline=self.settings.pass_deadline,
            speeds=self._speeds,
            stage_weight_bytes=self._stage_weight_bytes,
            prefix_blocks=prefix_blocks[::-1],
            prefix_seeds=self.prefix_seeds,
            prefix_held=kept_keys(runner_box[0].prefix, prefix_held),
        )

    async def probe(self, placed: Plan) -> dict[str, int | None]:
        """Ask every remote stage of ``placed`` how long its pass in progress has run:
        milliseconds by node (0: idle), ``None`` for a stage that did not answer within
        ``PROBE_TIMEOUT_S`` or no longer holds this run."""
        inventory = Inventory(
            run_id=self.run_id, term=self.term, package_ref=self.settings.model_ref
        )
        answers: dict[str, int | None] = {}
        async with trio.open_nursery() as nursery:
            for stage in placed.stages[1:]:
                node = stage.node_id
                receive = self._receivers.get(node)
                nursery.start_soon(_probe, self.mesh, node, receive, inventory, answers)
        return answers

    def _claim(self) -> Claim:
        return Claim(
            run_id=self.run_id,
            term=self.term,
            coordinator_id=self.mesh.node_id,
            package_ref=self.settings.model_ref,
        )

    async def _prepare_local(self, stage: StagePlan, box: list[StageRunner]) -> None:
        self.stage_state[stage.node_id] = StageState.PREPARING
        part = Part(stage.start, stage.end, embed=True, head=stage.head)

        def progress(done: int, total: int) -> None:
            self._record_progress(stage.node_id, done, total, time.monotonic())

        def build() -> StageRunner:
            source = _open_part(self.settings, self.source, part, progress)
            vocab, eos = self.config.vocab_size, self.config.eos_token_ids
            # hook (issue 30): the pool of the run before, or none (freed before the weights)
            identity, seed = host_identity(self, stage), self.prefix_seeds[0]
            kept, self._kept = take_over(self._kept, identity, seed, self.context_size), None
            engine_stage = Stage(
                self.config,
                source,
                stage.start,
                stage.end,
                embed=True,
                head=stage.head,
                backend=self.backend,
                ring_slots=self.settings.ring_slots,
                kv_dtype=self.settings.kv_dtype,
            )
            place_weights(engine_stage, short=stage.offload_bytes > 0)  # from disk or not
            runner = StageRunner(
                engine_stage,
                context_size=self.context_size,
                max_sequences=MAX_SEQUENCES_PER_STAGE,
                grammars=Grammars(lambda: source.tokenizer_json, vocab, eos),
                prefix_salt=seed,
                prefix_identity=identity,
                prefix=kept,
            )
            heap.release_free_memory()  # what loading the model and its tokenizer freed
            if self._claims is not None and self._claims.compute:  # as every node does
                model_id = f"{self.settings.model_ref}@{self.settings.pin}"
                measured = measure_or_reason(
                    source,
                    stage.start,
                    self.backend,
                    model_id=model_id,
                    cache_dir=self.settings.cache_dir,
                )
                self._claims.record_own(stage.node_id, measured, stage.start)
            return runner

        try:
            box.append(await trio.to_thread.run_sync(build))
        except Exception as exc:
            raise RunError(f"loading stage 0 on this node failed: {exc}") from exc
        self.stage_state[stage.node_id] = StageState.LOADED

    def _record_progress(self, node: str, done: int, total: int, now_s: float) -> None:
        """Keep a stage's download progress for status, and log it now and then."""
        self.progress[node] = (done, total)
        tracker = self._download_log.setdefault(node, DownloadProgress(f"stage on {node}"))
        if line := tracker.update(done, total, now_s):
            log.info("%s", line)

    async def _prepare_remote(
        self, stage: StagePlan, receivers: dict[str, trio.MemoryReceiveChannel[Message]]
    ) -> None:
        node = stage.node_id
        prepare = Prepare(
            run_id=self.run_id,
            term=self.term,
            package_ref=self.settings.model_ref,
            manifest_sha256=self.settings.pin if is_url(self.settings.model_ref) else "",
            layer_range=(stage.start, stage.end),
            has_embed=stage.embed,
            has_head=stage.head,
            commit="" if is_url(self.settings.model_ref) else self.settings.pin,
        )
        await self._request(node, receivers, prepare, PrepareAccepted)
        self.stage_state[node] = StageState.PREPARING
        inventory = Inventory(
            run_id=self.run_id, term=self.term, package_ref=self.settings.model_ref
        )
        with trio.move_on_after(PREPARE_TIMEOUT_S):
            while True:
                report = await self._request(node, receivers, inventory, InventoryReport)
                self._record_progress(
                    node, report.bytes_done, report.bytes_total, trio.current_time()
                )
                if report.error:
                    self.failed.add(node)
                    raise RunError(f"node {node} could not prepare its layers: {report.error}")
                if report.ready:
                    if self._claims is not None:
                        self._claims.record(node, report)
                    self.stage_state[node] = StageState.PREPARED
                    return
                await trio.sleep(INVENTORY_POLL_S)
        self.failed.add(node)
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
                    if isinstance(reply, ClaimRejected):
                        self.refused.add(node)
                        raise RunError(f"node {node} refused {what}: {reply.reason}")
                    if isinstance(reply, Error):
                        raise RunError(f"node {node} refused {what}: {reply.message}")
        except trio.TooSlowError:
            failure = f"node {node} did not answer {what} within {timeout_s:.0f} s"
        except SEND_ERRORS:
            failure = f"node {node} is unreachable"
        except trio.EndOfChannel:
            failure = f"node {node} was lost while the run was brought up"
        except RunError:
            if node not in self.refused:
                self.failed.add(node)
            raise
        self.failed.add(node)
        raise RunError(failure)

    async def stop_all(self, placed: Plan, reason: str) -> None:
        """Stop every remote stage of ``placed`` (best effort: a lost node has stopped)."""
        stop = Stop(run_id=self.run_id, term=self.term, reason=reason)
        for stage in placed.stages[1:]:
            with contextlib.suppress(*SEND_ERRORS):
                await self.mesh.send(stage.node_id, stop)
        self._replies.clear()


async def _probe(
    mesh: MeshView,
    node: str,
    receive: trio.MemoryReceiveChannel[Message] | None,
    inventory: Inventory,
    answers: dict[str, int | None],
) -> None:
    """One stage's answer to the probe (:meth:`BringUp.probe`) into ``answers``."""
    answers[node] = None
    if receive is None:
        return
    with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
        while True:  # replies that came late to the bring-up say nothing now
            receive.receive_nowait()
    with (
        trio.move_on_after(PROBE_TIMEOUT_S),
        contextlib.suppress(*SEND_ERRORS, trio.EndOfChannel, trio.ClosedResourceError),
    ):
        await mesh.send(node, inventory)
        while True:
            reply = await receive.receive()
            if isinstance(reply, InventoryReport):
                answers[node] = reply.busy_ms
                return
            if isinstance(reply, Error):
                return  # fenced: the node no longer holds this run


def _leaves(group: BaseExceptionGroup[RunError]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _load(
    run: BringUp, index: int, stage: StagePlan, upstream: str, downstream: StagePlan | None
) -> Load:
    """The ``Load`` of ``stage``, stage ``index`` of ``run``, between ``upstream`` and
    ``downstream``."""
    return Load(
        run_id=run.run_id,
        term=run.term,
        package_ref=run.settings.model_ref,
        manifest_sha256="",
        layer_range=(stage.start, stage.end),
        has_embed=stage.embed,
        has_head=stage.head,
        upstream=run.mesh.peer_info(upstream),
        # The last stage's downstream is the host: its Predictions come straight back.
        downstream=run.mesh.peer_info(downstream.node_id if downstream else run.mesh.node_id),
        wire_dtype=run.settings.wire_dtype,
        context_size=run.context_size,
        batch_sizes=(1,),
        kv_dtype=run.settings.kv_dtype,
        ring_slots=run.settings.ring_slots,
        cpu_dtype=run.settings.cpu_dtype,
        prefix_seed=run.prefix_seeds[index],
    )


def _open_part(
    settings: CoordinatorSettings,
    source: ModelSource,
    part: Part,
    progress: Callable[[int, int], None],
) -> ModelSource:
    """The host's part of the model (call off the event loop); ``source``: the model as
    the host opened it at start.

    A local model (alias, file, folder) is opened whole and memory-mapped, so the source
    the host already holds serves every plan (a local package's part is checked first);
    only a remote package has parts to fetch.
    """
    target = resolve(settings.model_ref)
    if isinstance(target, LocalPackage):
        # Opened at start for its embedding only: the files of this part are checked
        # now, so a damaged layer file fails the bring-up instead of serving garbage.
        check_local_package(target.path, part)
    if not isinstance(target, RemotePackage):
        return source
    return open_ref(
        settings.model_ref,
        part,
        cache_dir=settings.cache_dir,
        progress=progress,
        pin=settings.pin,
    )
