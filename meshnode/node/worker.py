"""The worker side of a run: what every node does when a coordinator claims it.

Theory of operation. A node is claimed by at most one run at a time. The coordinator (on the
host) sends, over the node's mesh session:

    Claim ──► ClaimAccepted | ClaimRejected
    Prepare ──► PrepareAccepted        (materializing starts in the background)
    Inventory ──► InventoryReport      (polled: progress in bytes, ready or error)
    Load ──► Ready | Error             (build the engine stage from the prepared part)
    ActivationFrame ──► ActivationFrame to the downstream stage, or Prediction to the host
    Release                            (free one sequence's KV)
    Stop                               (drop the run and its memory)

Fencing (DESIGN §3): every message names ``run_id`` and ``term``. A message of another run or
an older term than the claim is answered with an ``Error`` (``STALE_TERM``/``UNKNOWN_RUN``),
never dropped silently. A newer term of the same coordinator supersedes the claim (the
host replanned). When the claiming coordinator's session is lost the claim is dropped.

Senders (issue 15 item 4): every member can reach every node, so the run id and term are
not enough. A claimed run's control messages are accepted only from the node that claimed
it, and activations only from the stage's upstream (named in ``Load``); anyone else gets
``UNKNOWN_RUN`` with nothing about the run this node holds (no run id, no term, no owner).

What a ``Prepare`` may name is this node's setting (:mod:`meshnode.node.peer_models`): hub
refs and bundled aliases, URLs only with ``allow_url_models``, and no path on this machine
but those its own config names; anything else is refused before it is touched.

Compute runs off the session loop. A loaded run owns one *inbox* task: the session's receive
loop only queues ``ActivationFrame``/``Release`` messages (in arrival order, so a sequence's
chunks and its release keep their order) and goes back to reading, and the inbox task runs
each forward in a worker thread and sends its output on. A long prefill pass therefore no
longer stops this node from reading heartbeats, ``Hello`` or other peers' messages, and its
upstream is not declared dead while it computes. ``Load`` (seconds of building the stage)
runs in its own task for the same reason.

Errors about a run go to its coordinator: a frame this node cannot process (not loaded, bad
activation, next stage unreachable) is reported to the run's coordinator with the request
id, and an ``Error`` about a request of our run that comes back from our downstream stage
(it holds another run, or none) is passed on to the coordinator, which fails that request
instead of waiting for a ``Prediction`` that will never come.

Beside it: the fencing decisions (:mod:`meshnode.node.fencing`), what the worker reports
of its run (:mod:`meshnode.node.worker_reports`), the stage a ``Load`` builds
(:mod:`meshnode.node.stage_build`) and its answers to a host's ``SpeedQuery``
(:mod:`meshnode.node.speed_answers`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import open_ref
from meshnode_packaging.sources import ModelSource
from meshnode_protocol import (
    ActivationBatch,
    ActivationFrame,
    Claim,
    ClaimAccepted,
    Error,
    ErrorCode,
    Inventory,
    Load,
    Message,
    PeerInfo,
    PeerLink,
    Prepare,
    PrepareAccepted,
    Ready,
    Release,
    SpeedQuery,
    Stop,
)

from meshnode.engine.backend import Backend
from meshnode.net.stream import SEND_ERRORS
from meshnode.node.fencing import (
    claim_rejection,
    is_downstream_error,
    prepare_refusal,
    refusals,
)
from meshnode.node.fencing import may_send as may_send  # callers import it here
from meshnode.node.peer_models import PeerModels
from meshnode.node.prefix_keep import KEEP_POOL_S, KeptPool, held_keys
from meshnode.node.relay import Relay
from meshnode.node.selfmeasure import SelfMeasure, measure_or_reason
from meshnode.node.speed_answers import SpeedAnswers
from meshnode.node.stage import StageRunner
from meshnode.node.stage_build import build_runner as build_runner  # ditto
from meshnode.node.worker_reports import inventory_report, run_status
from meshnode.node.worker_run import (
    DataMessage,
    Preparation,
    RunState,
    WorkerRun,
)

log = logging.getLogger("meshnode.worker")

# Data messages waiting for this stage's compute. A sequence has at most one final frame in
# flight, plus the non-final chunks of a prefill sent ahead of it (a few per long prompt), so
# 64 holds every sequence of a full stage; beyond it the session's receive loop waits for a
# slot, which pushes back on the upstream stage.
INBOX_FRAMES = 64

SendFn = Callable[[str, Message], Awaitable[None]]
ConnectFn = Callable[[PeerInfo], Awaitable[None]]


class Worker:
    """Serves the claim/prepare/load/activation messages of runs (module docstring)."""

    def __init__(
        self,
        node_id: str,
        send: SendFn,
        *,
        connect: ConnectFn,
        backend: Backend,
        cache_dir: Path | None,
        nursery: trio.Nursery,
        peer_models: PeerModels | None = None,
        memory_bytes: int | None = None,
        links: Callable[[], tuple[PeerLink, ...]] = tuple,
        meet: Callable[[tuple[PeerInfo, ...]], None] = lambda _: None,
        measure_when_asked: bool = False,
    ) -> None:
        self.node_id = node_id
        self._send = send
        self._connect = connect
        self._backend = backend
        self._cache_dir = cache_dir
        self._nursery = nursery
        self._relay = Relay(node_id, send)  # the data plane of the loaded run
        # What another node's Prepare may name (hub refs and aliases; URLs and local paths
        # only as this node's config says): see meshnode.node.peer_models.
        self._peer_models = peer_models or PeerModels()
        self._memory_bytes = memory_bytes  # what this node offers: bounds a Load's KV
        # This node's measured links to its peers, told in its reports (node/links.py).
        self._links = links
        # The host's SpeedQuery, answered now and again as links (or this node) are measured.
        self.speed = SpeedAnswers(
            node_id, send, backend=backend, cache_dir=cache_dir, nursery=nursery,
            peer_models=self._peer_models, links=links, meet=meet,
            measure_when_asked=measure_when_asked, claimed=lambda: self.run is not None,
        )  # fmt: skip
        self.run: WorkerRun | None = None
        # A stopped run's prefix pool, for the next Load of the same stage (issue 30).
        self._kept: KeptPool | None = None

    # -- status -----------------------------------------------------------------------

    def status(self) -> dict[str, Any] | None:
        """This node's part in the run that claimed it, if any (:func:`run_status`)."""
        return None if self.run is None else run_status(self.run)

    def serving(self) -> bool:
        """Whether a request passes through this node's stage now (it holds a sequence)."""
        runner = None if self.run is None else self.run.runner
        return runner is not None and runner.live_sequences > 0

    # -- dispatch -----------------------------------------------------------------------

    async def handle(self, peer: str, message: Message) -> bool:
        """Handle ``message`` from ``peer``; False if it is not a worker message."""
        if isinstance(message, Claim):
            await self._claim(peer, message)
        elif isinstance(
            message, Prepare | Inventory | Load | Stop | ActivationFrame | ActivationBatch | Release
        ):
            run = await self._fenced(peer, message)
            if run is None:
                return True
            if isinstance(message, Prepare):
                await self._prepare(peer, run, message)
            elif isinstance(message, Inventory):
                await self._send(peer, inventory_report(self.node_id, run, self._links()))
            elif isinstance(message, Load):
                # Building the stage takes seconds: off the session loop, like compute.
                self._nursery.start_soon(self._load_in_background, peer, run, message)
            elif isinstance(message, Stop):
                self.stop(f"stopped by {peer}: {message.reason}")
            else:
                await self._queue(run, message)
        elif isinstance(message, SpeedQuery):  # answered without a claim (node/speed_answers.py)
            await self.speed.answer(peer, message)
        elif isinstance(message, Error) and is_downstream_error(self.run, peer, message):
            await self._to_coordinator(message)
        else:
            return False
        return True

    async def _to_coordinator(self, error: Error) -> None:
        run = self.run
        if run is None:
            return
        # Best effort: without a session to the coordinator the run is over anyway.
        with contextlib.suppress(*SEND_ERRORS):
            await self._send(run.coordinator, error)

    def peer_lost(self, peer: str, *, left: bool = False) -> None:
        """The session with ``peer`` ended (``left``: it said goodbye): a coordinator gone
        takes its claim with it, a host its query."""
        self.speed.peer_lost(peer)
        if self.run is not None and self.run.coordinator == peer:
            self.stop(f"coordinator {peer} {'left the mesh' if left else 'lost'}")

    # -- control ------------------------------------------------------------------------

    async def _claim(self, peer: str, claim: Claim) -> None:
        run = self.run
        superseded = run is None or (run.coordinator == peer and claim.term >= run.term)
        if not superseded and run is not None:
            await self._send(peer, claim_rejection(self.node_id, run, peer, claim))
            return
        if self._kept is not None and self._kept.coordinator != peer:
            self._kept = None  # another host's blocks are never this one's
        if run is not None and run.run_id != claim.run_id:
            self.stop(f"superseded by run {claim.run_id}")
        if self.run is not None and self.run.run_id == claim.run_id:
            self.run.term = claim.term
        else:
            self.run = WorkerRun(claim.run_id, claim.term, peer)
        self.speed.claimed_now()
        await self._send(
            peer,
            ClaimAccepted(run_id=claim.run_id, term=claim.term, node_id=self.node_id),
        )

    async def _fenced(self, peer: str, message: Any) -> WorkerRun | None:
        """The claimed run ``message`` belongs to, or None after answering an Error for
        each of its frames (:func:`~meshnode.node.fencing.refusals`)."""
        errors = refusals(self.run, peer, message)
        if errors is None:
            return self.run
        for error in errors:
            await self._send(peer, error)
        return None

    async def _prepare(self, peer: str, run: WorkerRun, prepare: Prepare) -> None:
        refusal = prepare_refusal(self._peer_models, prepare)
        if refusal:
            await self._send(peer, run.error(ErrorCode.PREPARE_FAILED, refusal))
            return
        start, end = prepare.layer_range
        part = Part(start, end, embed=prepare.has_embed, head=prepare.has_head)
        pin = prepare.commit or prepare.manifest_sha256
        prep = run.preparation
        wanted = (part, prepare.package_ref, pin)
        if prep is None or (prep.part, prep.package_ref, prep.pin) != wanted:
            if prep is not None:
                prep.cancel.set()
            prep = Preparation(prepare.package_ref, part, pin)
            run.preparation = prep
            run.state = RunState.PREPARING
            self._nursery.start_soon(self._materialize, run, prep)
        await self._send(
            peer, PrepareAccepted(run_id=run.run_id, term=run.term, node_id=self.node_id)
        )

    async def _materialize(self, run: WorkerRun, prep: Preparation) -> None:
        try:
            source = await trio.to_thread.run_sync(
                lambda: open_ref(
                    prep.package_ref,
                    prep.part,
                    cache_dir=self._cache_dir,
                    progress=prep.progress,
                    pin=prep.pin,
                    cancel=prep.cancel,
                )
            )
            if prep.bytes_total == 0:  # a local source: nothing was transferred
                prep.bytes_done = prep.bytes_total = 1
            # measured before it reads as ready: the report that says so carries it
            async with self.speed.measure_lock:  # not beside a measurement asked for
                prep.measured = await measure_part(prep, source, self._backend, self._cache_dir)
            prep.source = source
            if run.state is RunState.PREPARING:
                run.state = RunState.PREPARED
        except Exception as exc:  # any failure is reported, never raised
            prep.failure = exc
            run.state = RunState.FAILED
            log.warning("preparing %s failed: %s: %s", prep.package_ref, type(exc).__name__, exc)
        finally:
            prep.done.set()

    async def _load_in_background(self, peer: str, run: WorkerRun, load: Load) -> None:
        try:
            await self._load(peer, run, load)
        except SEND_ERRORS as exc:
            # The coordinator is gone: its claim goes with it (peer_lost), nothing to tell.
            log.info("run %s: could not answer Load: %r", run.run_id, exc)

    async def _load(self, peer: str, run: WorkerRun, load: Load) -> None:
        prep = run.preparation
        if prep is None or prep.source is None:
            reason = "nothing prepared" if prep is None else prep.error or "still preparing"
            await self._load_failed(peer, run, reason)
            return
        source = prep.source
        start, end = load.layer_range
        # what the blocks of a kept pool are of; the pool goes to the builder alone, which
        # frees it before the weights unless the stage takes it over
        owner = (run.coordinator, prep.package_ref, prep.pin)
        kept = [] if self._kept is None else [self._kept.prefix]
        self._kept = None

        def build() -> StageRunner:
            memory = self._memory_bytes
            return build_runner(
                self._backend,
                source,
                start,
                end,
                load,
                memory,
                owner=owner,
                kept=kept.pop() if kept else None,  # no reference left here
            )

        try:
            runner = await trio.to_thread.run_sync(build)
        except Exception as exc:  # reported to the coordinator
            await self._load_failed(peer, run, f"{type(exc).__name__}: {exc}")
            return
        if load.downstream is not None:
            try:
                await self._connect(load.downstream)
            except trio.TooSlowError:
                await self._load_failed(
                    peer, run, f"cannot reach downstream node {load.downstream.node_id}"
                )
                return
        run.runner = runner
        run.upstream = None if load.upstream is None else load.upstream.node_id
        run.downstream = None if load.downstream is None else load.downstream.node_id
        run.wire_dtype = load.wire_dtype
        run.state = RunState.READY
        if run.inbox is None:
            send, receive = trio.open_memory_channel[DataMessage](INBOX_FRAMES)
            run.inbox = send
            self._nursery.start_soon(self._relay.serve_inbox, run, receive)
        await self._send(
            peer,
            Ready(
                run_id=run.run_id,
                term=run.term,
                node_id=self.node_id,
                endpoint=self.node_id,
                layer_range=(start, end),
                prefix_block=runner.prefix.block,  # hook (issue 30)
                prefix_seed=load.prefix_seed,
                prefix_keys=held_keys(runner.prefix),  # what it kept of an earlier run
            ),
        )

    async def _load_failed(self, peer: str, run: WorkerRun, reason: str) -> None:
        run.state = RunState.FAILED
        await self._send(peer, run.error(ErrorCode.LOAD_FAILED, reason))

    def stop(self, reason: str, *, keep: bool = True) -> None:
        """Drop the run this node holds, if any, logging ``reason``; with ``keep``, its
        prefix pool is kept for the next ``Load`` of the same stage (:meth:`_keep_pool`)."""
        if self.run is not None:
            log.info("run %s stopped: %s", self.run.run_id, reason)
            if self.run.preparation is not None:
                self.run.preparation.cancel.set()  # a running fetch stops within a second
            self.run.scope.cancel()  # its inbox task, and a forward it awaits, end with it
            if keep and self.run.runner is not None:
                self._nursery.start_soon(self._keep_pool, self.run)
        self.run = None  # the runner, its caches and the mapped weights go with it

    async def _keep_pool(self, run: WorkerRun) -> None:
        """Keep the prefix pool of ``run`` (stopped) for ``KEEP_POOL_S``, once no forward of
        its inbox can touch it (:mod:`meshnode.node.prefix_keep`)."""
        with trio.move_on_after(KEEP_POOL_S):
            await run.idle.wait()
        runner, run.runner = run.runner, None  # the weights go now
        if runner is None or not run.idle.is_set() or not runner.prefix.identity:
            return  # a forward still runs (hung): the pool is not safe to reuse
        if self.run is not None and self.run.runner is not None:
            return  # a later run loaded meanwhile, with a pool of its own
        runner.release_all()  # its sequences' committed blocks stay cached
        kept = self._kept = KeptPool(runner.prefix, run.coordinator)
        del runner
        await trio.sleep(KEEP_POOL_S)
        if self._kept is kept:
            self._kept = None

    # -- data plane ---------------------------------------------------------------------

    async def _queue(self, run: WorkerRun, message: DataMessage) -> None:
        """Hand a data message to the run's inbox task; the receive loop goes on reading."""
        if run.inbox is None:
            frames = message.frames if isinstance(message, ActivationBatch) else (message,)
            for frame in frames:
                if isinstance(frame, ActivationFrame):
                    reason = "this stage is not loaded"
                    await self._to_coordinator(
                        run.error(ErrorCode.NOT_READY, reason, frame.request_id)
                    )
            return  # a Release before Load: nothing of that sequence is held here
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            await run.inbox.send(message)


async def measure_part(
    prep: Preparation, source: ModelSource, backend: Backend, cache_dir: Path | None
) -> SelfMeasure | str:
    """This node's speed on ``prep``'s first layer (:mod:`meshnode.node.selfmeasure`),
    reported in the ``InventoryReport`` once the part is ready."""
    if prep.part.end <= prep.part.start:
        return "no layer to time"
    model_id = f"{prep.package_ref}@{prep.pin}"
    return await trio.to_thread.run_sync(
        lambda: measure_or_reason(
            source, prep.part.start, backend, model_id=model_id, cache_dir=cache_dir
        )
    )
