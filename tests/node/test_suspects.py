"""A suspect stage is dropped on evidence, not on one late heartbeat (issue 35's leftover).

The coordinator's watch (:func:`meshnode.node.replacing.watch`) runs on trio's autojump
clock against a mesh whose membership is the real peer table
(:mod:`meshnode.node.membership`), fed as the daemon feeds it: a heartbeat from each peer
every ``interval_s`` and a ``Tick`` every half interval. The pipeline is a stand-in that
says since when its passes have gone unanswered (``RemotePipeline.stalled_since``; the
real one is checked at the end). Default
timeouts: heartbeats every 1 s, suspect after 3 s, dead after 10 s, a 2 s grace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import trio
from meshnode_packaging.refs import open_ref
from meshnode_packaging.writer import write_package
from meshnode_protocol import ActivationBatch, ActivationFrame, Message, PeerInfo, SpeedQuery

from meshnode.engine.backend import cpu_backend
from meshnode.net.identity import NodeId
from meshnode.node.config import HeartbeatTimeouts
from meshnode.node.coordinator import Coordinator
from meshnode.node.decisions import Failure
from meshnode.node.membership import (
    Event,
    FrameReceived,
    PeerHello,
    PeerState,
    PeerTable,
    Tick,
    apply,
    changes,
)
from meshnode.node.mesh import CoordinatorSettings
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame
from meshnode.node.planner import NodeCapacity, Plan, plan
from meshnode.node.remote import RemotePipeline
from meshnode.node.replacing import watch
from meshnode.node.worker import Worker
from tests.engine.tiny import write_tiny_model
from tests.node.inmemory import (
    CONTEXT,
    GREEDY,
    HOST,
    PROMPT,
    InMemoryMesh,
    add_worker,
    decode,
    split_host,
)

TIMEOUTS = HeartbeatTimeouts()  # 1 s, suspect 3 s, dead 10 s, grace 2 s
PEERS = ("a", "b")
MEMORY = 1 << 34
# Heartbeats arrive a quarter interval after the membership ticks, never at the same instant.
BEAT_PHASE_S = 0.25
WATCH_S = 120.0  # how long a watch that should not drop anything is watched


@dataclass
class _Silence:
    """When a peer's heartbeats do not arrive: [start, end) intervals of trio time."""

    spans: list[tuple[float, float]] = field(default_factory=list)

    def quiet(self, now: float) -> bool:
        return any(start <= now < end for start, end in self.spans)


class _Mesh:
    """The coordinator's ``MeshView`` over the real peer table, kept as the daemon keeps it."""

    def __init__(self) -> None:
        self.table = PeerTable(TIMEOUTS)
        self.silence = {peer: _Silence() for peer in PEERS}
        self.seen: list[tuple[float, str, PeerState | None]] = []  # (time, peer, new state)
        self._changed = trio.Event()

    @property
    def node_id(self) -> str:
        return HOST

    def observe(self, event: Event) -> None:
        old, self.table = self.table, apply(self.table, event)
        found = changes(old, self.table)
        self.seen += [(trio.current_time(), node, after) for node, _, after in found]
        if found:
            self._changed.set()
            self._changed = trio.Event()

    def live_nodes(self) -> list[NodeCapacity]:
        alive = [NodeCapacity(peer.node_id, MEMORY) for peer in self.table.alive()]
        return [NodeCapacity(HOST, MEMORY), *alive]

    def suspects(self) -> dict[str, float]:
        return {
            node: peer.since_s
            for node, peer in self.table.peers.items()
            if peer.state is PeerState.SUSPECT
        }

    def peer_info(self, node_id: str) -> PeerInfo:
        return PeerInfo(node_id=node_id, address=f"{node_id}.invalid:7470")

    async def send(self, node_id: str, message: Message) -> None:
        # The watch introduces the candidates to each other (node/warm.py), nothing else.
        if not isinstance(message, SpeedQuery):
            raise AssertionError(f"the watch sent {message!r} to {node_id}")

    def membership_event(self) -> trio.Event:
        return self._changed

    def suspected(self, peer: str) -> bool:
        return (peer, PeerState.SUSPECT) in {(node, state) for _, node, state in self.seen}

    def hellos(self) -> None:
        for peer in PEERS:
            self.observe(PeerHello(NodeId(peer), f"{peer}.invalid:7470", "cpu", MEMORY, 0.0))

    async def run(self) -> None:
        """Heartbeats (``silence`` aside) and ticks, as the daemon has them."""
        async with trio.open_nursery() as nursery:
            for peer in PEERS:
                nursery.start_soon(self._beats, peer)
                for _, end in self.silence[peer].spans:
                    nursery.start_soon(self._back, peer, end)
            while True:
                await trio.sleep(TIMEOUTS.interval_s / 2)
                self.observe(Tick(trio.current_time()))

    async def _back(self, peer: str, at: float) -> None:
        """A starved peer's frames arrive as soon as it runs again."""
        await trio.sleep_until(at)
        self.observe(FrameReceived(NodeId(peer), trio.current_time()))

    async def _beats(self, peer: str) -> None:
        await trio.sleep(BEAT_PHASE_S)
        while True:
            if not self.silence[peer].quiet(trio.current_time()):
                self.observe(FrameReceived(NodeId(peer), trio.current_time()))
            await trio.sleep(TIMEOUTS.interval_s)


class _Meter:
    to_weigh = 0

    def due(self, now: float) -> bool:
        return False


class _Pipeline:
    """What the watch reads of a pipeline: its failure and since when passes stall."""

    def __init__(self) -> None:
        self.failure = None
        self.failed = trio.Event()
        self.measured = _Meter()
        self.replies: list[tuple[float, float]] = []  # [start, end): replies keep coming
        self.sent_at: float | None = None  # a pass in flight since, when replies stop

    @property
    def stalled_since(self) -> float | None:
        now = trio.current_time()
        if any(start <= now < end for start, end in self.replies):
            return now  # a reply came just now
        last = max((end for _, end in self.replies if end <= now), default=None)
        if self.sent_at is None or self.sent_at > now:
            return last  # a pass stalled since the last reply (None: nothing in flight)
        return self.sent_at if last is None else max(last, self.sent_at)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("suspects")
    write_package(write_tiny_model(root / "model", "Q8_0"), root / "package")
    return root / "package"


@pytest.fixture
def watched(package: Path) -> tuple[_Mesh, Coordinator, Plan]:
    mesh = _Mesh()
    settings = CoordinatorSettings(model_ref=str(package), context_size=CONTEXT, split=3)
    source = open_ref(package)
    coordinator = Coordinator(
        mesh, settings, source=source, backend=cpu_backend(), on_pipeline=lambda p: None
    )
    nodes = [NodeCapacity(node, MEMORY) for node in (HOST, *PEERS)]
    placed = plan(coordinator.footprint, nodes, HOST, CONTEXT, split=3)
    assert set(placed.node_ids) == {HOST, *PEERS}
    return mesh, coordinator, placed


async def _watch(
    watched: tuple[_Mesh, Coordinator, Plan], pipeline: _Pipeline
) -> tuple[Failure | None, float] | None:
    """Run the watch for up to ``WATCH_S``: its loss and when, or None (nothing dropped)."""
    mesh, coordinator, placed = watched
    ended: list[tuple[Failure | None, float]] = []
    mesh.hellos()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(mesh.run)
        with trio.move_on_after(WATCH_S):
            loss = await watch(coordinator, placed, cast(RemotePipeline, pipeline))
            ended.append((loss, trio.current_time()))
        nursery.cancel_scope.cancel()
    return ended[0] if ended else None


async def test_a_node_that_flaps_suspect_and_back_is_not_dropped(
    autojump_clock: Any, watched: tuple[_Mesh, Coordinator, Plan]
) -> None:
    """Starved on busy cores: "a"'s heartbeats stop for 3.35 s and so do the pipeline's
    replies (its pass waits on "a" too); the table marks it suspect, and it is alive again
    100 ms later. Before the grace, the host dropped it there and replayed every request."""
    mesh, _, _ = watched
    pipeline = _Pipeline()
    mesh.silence["a"].spans = [(10.5, 13.6)]  # last beat 10.25; suspect at the 13.5 tick
    pipeline.replies = [(0.0, 10.25), (13.6, WATCH_S + 1)]
    pipeline.sent_at = 0.0
    assert await _watch(watched, pipeline) is None
    assert mesh.suspected("a")
    assert mesh.table.peers[NodeId("a")].state is PeerState.ALIVE


async def test_a_suspect_whose_passes_come_back_is_not_dropped(
    autojump_clock: Any, watched: tuple[_Mesh, Coordinator, Plan]
) -> None:
    """ "a" stays suspect for 6 s (its heartbeats late, short of the dead timeout) while
    replies keep coming through it: the pipeline is alive, whatever its heartbeats."""
    mesh, _, _ = watched
    pipeline = _Pipeline()
    mesh.silence["a"].spans = [(10.5, 19.5)]  # suspect from 13.5 to the 19.25 beat
    pipeline.replies = [(0.0, WATCH_S + 1)]
    assert await _watch(watched, pipeline) is None
    assert mesh.suspected("a")


async def test_a_node_that_stops_mid_request_is_dropped_after_the_grace(
    autojump_clock: Any, watched: tuple[_Mesh, Coordinator, Plan]
) -> None:
    """SIGSTOP or a cut link mid-stream: heartbeats and replies stop together. The stage is
    dropped ``suspect_after_s + suspect_grace_s`` (5 s) after its last heartbeat, give or
    take a tick, half the dead timeout."""
    mesh, _, _ = watched
    pipeline = _Pipeline()
    last_beat = 10.25
    mesh.silence["a"].spans = [(10.5, WATCH_S + 1)]
    pipeline.replies = [(0.0, last_beat)]
    pipeline.sent_at = 0.0
    ended = await _watch(watched, pipeline)
    assert ended is not None, "a stopped stage was never dropped"
    loss, at = ended
    assert loss is not None
    assert loss.node == "a", loss
    promised = TIMEOUTS.suspect_after_s + TIMEOUTS.suspect_grace_s
    assert promised <= at - last_beat <= promised + TIMEOUTS.interval_s / 2
    assert at - last_beat < TIMEOUTS.dead_after_s


async def test_a_suspect_stage_nothing_waits_on_is_dropped_when_dead(
    autojump_clock: Any, watched: tuple[_Mesh, Coordinator, Plan]
) -> None:
    """Nothing in flight: a silent stage costs nobody anything, so it goes when it is dead
    (``dead_after_s``), not when it is suspect."""
    mesh, _, _ = watched
    last_beat = 10.25
    mesh.silence["b"].spans = [(10.5, WATCH_S + 1)]
    ended = await _watch(watched, _Pipeline())
    assert ended is not None, "a dead stage was never dropped"
    loss, at = ended
    assert loss is not None
    assert loss.node == "b", loss
    assert TIMEOUTS.dead_after_s <= at - last_beat <= TIMEOUTS.dead_after_s + 0.5
    assert mesh.table.peers[NodeId("b")].state is PeerState.DEAD


async def test_a_pass_sent_to_a_suspect_stage_drops_it_after_the_grace(
    autojump_clock: Any, watched: tuple[_Mesh, Coordinator, Plan]
) -> None:
    """Suspect while idle (spared), then a request comes at 16 s and its pass goes
    unanswered: the stage is dropped ``suspect_grace_s`` after the pass went out, not at the
    dead timeout (the watch looks again while it spares a suspect)."""
    mesh, _, _ = watched
    pipeline = _Pipeline()
    mesh.silence["a"].spans = [(10.5, WATCH_S + 1)]  # suspect from 13.5, dead at 20.5
    pipeline.sent_at = 16.0
    ended = await _watch(watched, pipeline)
    assert ended is not None
    loss, at = ended
    assert loss is not None
    assert loss.node == "a", loss
    assert at == pytest.approx(16.0 + TIMEOUTS.suspect_grace_s)


async def test_a_stage_that_hangs_while_its_heartbeats_flow_is_left_to_the_pass_deadline(
    autojump_clock: Any, watched: tuple[_Mesh, Coordinator, Plan]
) -> None:
    """A hung kernel: the pass stalls from 5 s on while every heartbeat arrives. Alive to
    the membership, so the watch drops nothing; the pass deadline (60 s and 0.25 s a token
    by default) fails the pipeline and the probe blames the stage
    (tests/node/test_coordinator_failures.py, tests/e2e/test_replay.py)."""
    pipeline = _Pipeline()
    pipeline.replies = [(0.0, 5.0)]
    pipeline.sent_at = 0.0
    assert await _watch(watched, pipeline) is None
    assert watched[0].seen == [(0.0, "a", PeerState.ALIVE), (0.0, "b", PeerState.ALIVE)]


def _hold_passes(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """``worker`` keeps every activation frame unanswered (a hung stage); the event is set
    when the first one arrives."""
    handle, arrived = worker.handle, trio.Event()

    async def holding(peer: str, message: Message) -> Any:
        if isinstance(message, ActivationFrame | ActivationBatch):
            arrived.set()
            return True
        return await handle(peer, message)

    monkeypatch.setattr(worker, "handle", holding)
    return arrived


async def test_a_real_pipeline_says_since_when_its_passes_stall(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RemotePipeline.stalled_since``: None when nothing is in flight (after a whole
    decode), the send's time while a pass through a stage that drops frames waits."""
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        _, next_pipeline = split_host(mesh, hub_ref, nursery)
        pipeline = await next_pipeline()
        assert pipeline is not None
        assert pipeline.stage_nodes == (HOST, "w")
        await decode(pipeline)
        assert pipeline.stalled_since is None
        arrived = _hold_passes(mesh.workers["w"], monkeypatch)
        before = trio.current_time()
        frame = StepFrame(RequestId("stuck"), FrameKind.PREFILL, 0, PROMPT, GREEDY)
        nursery.start_soon(pipeline.run, frame)
        with trio.fail_after(30):
            await arrived.wait()
        stalled = pipeline.stalled_since
        assert stalled is not None
        assert before <= stalled <= trio.current_time()
        await trio.sleep(0.05)
        assert pipeline.stalled_since == stalled  # no reply: the stall goes on
        nursery.cancel_scope.cancel()
