"""Workers meet and measure each other's links in time to be placed by them (issue 34): the
host's ``SpeedQuery`` names the other candidates, a worker answers again each time it has
measured a link (or itself), a link is probed whenever no request passes through the node,
and the calibration waits, bounded, for the links between the candidates before it weighs
a re-placement, which then keeps the ends of a slow link apart."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import pytest
import trio
from meshnode_packaging.refs import open_ref
from meshnode_protocol import (
    Claim,
    Message,
    PeerInfo,
    PeerLink,
    Release,
    SpeedQuery,
    SpeedReport,
)

from meshnode.engine.backend import cpu_backend
from meshnode.node import speed_answers
from meshnode.node.calibration import LINKS_TIMEOUT_S, measured_links
from meshnode.node.claims import ClaimBook
from meshnode.node.coordinator import Coordinator
from meshnode.node.links import (
    LINK_MAX_AGE_S,
    QUIET_RECHECK_S,
    LinkBook,
    unmeasured_links,
)
from meshnode.node.mesh import CoordinatorSettings
from meshnode.node.planner import NodeCapacity, NodeLink, NodeSpeed
from meshnode.node.remote import RemotePipeline
from meshnode.node.warm import SpeedQueries
from meshnode.node.worker import Worker
from tests.node.inmemory import BRING_UP_TIMEOUT_S, CONTEXT, HOST, InMemoryMesh, add_worker
from tests.node.test_links import Link
from tests.node.test_planner import MODEL  # 30 layers of 4 MiB

SLOW = 50_000.0  # bytes a second
REF = "hf://org/model"


def tells(name: str, *rates: tuple[str, float]) -> NodeCapacity:
    """A worker that reported its link to the host (a round trip) and ``rates`` to peers."""
    links = (NodeLink(HOST, 0.001), *(NodeLink(peer, 0.001, rate) for peer, rate in rates))
    return NodeCapacity(name, 1, links=links)


@pytest.mark.parametrize(
    ("nodes", "missing"),
    [
        # two workers that tell their links, neither measured the other's rate
        ([tells("a"), tells("b")], [("a", "b")]),
        # either end's rate is enough
        ([tells("a", ("b", SLOW)), tells("b")], []),
        ([tells("a"), tells("b", ("a", SLOW))], []),
        # a round trip alone is no rate
        ([tells("a", ("b", 0.0)), tells("b")], [("a", "b")]),
        ([tells("a"), tells("b"), tells("c", ("a", SLOW))], [("a", "b"), ("b", "c")]),
        # a node that tells no links does not probe: nothing to wait for
        ([tells("a"), NodeCapacity("old", 1)], []),
    ],
)  # fmt: skip
def test_the_links_left_to_measure(
    nodes: list[NodeCapacity], missing: list[tuple[str, str]]
) -> None:
    # the host's own links are never waited for: it measured them before it planned
    host = NodeCapacity(HOST, 1, links=(NodeLink("a", 0.001),))
    assert unmeasured_links([host, *nodes], HOST) == missing


async def test_a_due_link_waits_for_a_quiet_node_and_each_measure_is_told(
    autojump_clock: Any, nursery: trio.Nursery
) -> None:
    """While a request passes through the node its new link is not probed; in the first
    gap it is, the node tells it (``measured``), and it is not probed again before
    ``LINK_MAX_AGE_S``."""
    serving = True
    told: list[float] = []
    measured_once = trio.Event()

    async def measured(node: str) -> None:
        assert node == "w2"
        told.append(trio.current_time())
        measured_once.set()

    book = LinkBook("w1", quiet=lambda: not serving, measured=measured)
    link = Link(book, LinkBook("w2"), rtt_s=0.001, bytes_per_s=1e6)
    link.nursery = nursery
    nursery.start_soon(book.keep_measured, "w2", link.send)
    await trio.sleep(20 * QUIET_RECHECK_S)  # mock clock: twenty looks, all while serving
    assert book.rate("w2") == 0.0
    assert told == []
    serving, quiet_at = False, trio.current_time()
    await measured_once.wait()
    assert told[0] - quiet_at <= QUIET_RECHECK_S + 1.0  # the next look, then the probe
    assert book.rate("w2") == pytest.approx(1e6)
    await trio.sleep(LINK_MAX_AGE_S - 60.0)
    assert len(told) == 1


async def test_a_query_introduces_the_peers_and_the_worker_answers_again(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The worker dials the peers a query names (``meet``), answers at once, and answers
    the same query again, with its links then, each time it has measured one; not once its
    host is gone."""
    sent: list[tuple[str, Message]] = []
    met: list[tuple[PeerInfo, ...]] = []
    links: tuple[PeerLink, ...] = ()

    async def send(peer: str, message: Message) -> None:
        sent.append((peer, message))

    async def connect(info: PeerInfo) -> None:
        raise AssertionError("no Load here")

    worker = Worker("w1", send, connect=connect, backend=cpu_backend(), cache_dir=tmp_path,
                    nursery=nursery, links=lambda: links, meet=met.append)  # fmt: skip
    peers = (PeerInfo(node_id="w2", address="10.0.0.2:7470"),)
    assert await worker.handle(
        HOST, SpeedQuery(node_id=HOST, nonce=7, package_ref=REF, peers=peers)
    )
    assert met == [peers]
    links = (PeerLink(node_id="w2", rtt_us=500.0, bytes_per_s=SLOW),)
    await worker.speed.link_measured()
    answers = [(peer, m) for peer, m in sent if isinstance(m, SpeedReport)]
    assert [(peer, m.nonce, m.links, m.measuring) for peer, m in answers] == [
        (HOST, 7, (), False),  # cold, and not asked to measure itself (the daemon is)
        (HOST, 7, links, False),
    ]
    worker.peer_lost(HOST)
    await worker.speed.link_measured()
    assert len(sent) == 2


@pytest.mark.parametrize("claimed", [False, True])
async def test_a_spare_cold_node_measures_itself_when_asked(
    hub_ref: tuple[str, Path],
    tmp_path: Path,
    nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
    claimed: bool,
) -> None:
    """Cold, it answers that it measures itself and, unless a plan claims it (its Prepare
    measures it then), answers again with its measurement, kept for the next query."""
    if not claimed:
        monkeypatch.setattr(speed_answers, "SPARE_AFTER_S", 0.0)  # spare at once
    ref, _ = hub_ref
    reports, received = trio.open_memory_channel[SpeedReport](8)

    async def send(peer: str, message: Message) -> None:
        if isinstance(message, SpeedReport):
            reports.send_nowait(message)

    async def connect(info: PeerInfo) -> None:
        raise AssertionError("no Load here")

    worker = Worker("w1", send, connect=connect, backend=cpu_backend(),
                    cache_dir=tmp_path / "cache", nursery=nursery,
                    measure_when_asked=True)  # fmt: skip
    await worker.handle(HOST, SpeedQuery(node_id=HOST, nonce=3, package_ref=ref))
    if claimed:
        await worker.handle(HOST, Claim(run_id="r", term=1, coordinator_id=HOST, package_ref=ref))
    with trio.fail_after(BRING_UP_TIMEOUT_S):
        first, second = await received.receive(), await received.receive()
    assert (first.nonce, first.measuring, first.decode_us) == (3, True, 0.0)
    assert (second.nonce, second.measuring) == (3, False)
    assert (second.decode_us > 0) != claimed
    if not claimed:
        await worker.handle(HOST, SpeedQuery(node_id=HOST, nonce=4, package_ref=ref))
        third = received.receive_nowait()  # from its cache, at once
        assert (third.nonce, third.measuring, third.decode_us) == (4, False, second.decode_us)


class _Mesh:
    """A ``MeshView`` that keeps what it is sent."""

    node_id = HOST

    def __init__(self) -> None:
        self.sent: list[tuple[str, SpeedQuery]] = []
        self._changed = trio.Event()

    def peer_info(self, node_id: str) -> PeerInfo:
        return PeerInfo(node_id=node_id, address=f"{node_id}.invalid:7470")

    async def send(self, node_id: str, message: Message) -> None:
        assert isinstance(message, SpeedQuery)
        self.sent.append((node_id, message))

    def told(self) -> dict[str, list[str]]:
        told = {node: [p.node_id for p in query.peers] for node, query in self.sent}
        self.sent.clear()
        return told


def _nodes(*names: str) -> list[NodeCapacity]:
    return [NodeCapacity(n, 1) for n in (HOST, *names)]


async def test_the_host_introduces_the_candidates_and_again_when_one_joins(
    tmp_path: Path, autojump_clock: Any
) -> None:
    queries = SpeedQueries(REF, "", backend=cpu_backend(), cache_dir=tmp_path)
    mesh = _Mesh()
    await queries.introduce(mesh, _nodes("a", "b"))  # type: ignore[arg-type]
    assert mesh.told() == {"a": ["b"], "b": ["a"]}
    await queries.introduce(mesh, _nodes("a", "b"))  # type: ignore[arg-type]
    await queries.introduce(mesh, _nodes("a"))  # type: ignore[arg-type]  # b left: no news
    assert mesh.told() == {}
    await queries.introduce(mesh, _nodes("a", "b", "c"))  # type: ignore[arg-type]
    assert mesh.told() == {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]}


async def test_later_answers_tell_links_and_a_measured_claim_and_are_news(
    tmp_path: Path, autojump_clock: Any
) -> None:
    queries = SpeedQueries(REF, "", backend=cpu_backend(), cache_dir=tmp_path)
    book, mesh = ClaimBook(MODEL), _Mesh()
    await queries.introduce(mesh, _nodes("a", "b"))  # type: ignore[arg-type]
    nonce = {node: query.nonce for node, query in mesh.sent}
    news, before = queries.report_event(), queries.reports

    def report(**fields: Any) -> SpeedReport:
        return SpeedReport(node_id="a", nonce=nonce["a"], package_ref=REF, **fields)

    queries.deliver("a", report(measuring=True), book)  # cold: it measures itself
    assert news.is_set()
    assert queries.reports == before + 1
    assert queries.measuring == {"a"}
    assert book.speed("a") is None
    measured = {"layer": 0, "decode_us": 1000.0, "layer_bytes": 4 << 20}
    slow = (PeerLink(node_id="b", rtt_us=1000.0, bytes_per_s=SLOW),)
    queries.deliver("a", report(links=slow, **measured), book)  # done: its claim now
    assert queries.measuring == set()
    assert book.speed("a") == NodeSpeed((4 << 20) / 1e-3, 0.0)
    queries.deliver("a", report(decode_us=10.0, layer_bytes=4 << 20), book)  # a later one
    assert book.speed("a") == NodeSpeed((4 << 20) / 1e-3, 0.0)  # ...tells its links alone
    assert book.linked(NodeCapacity("a", 1)).links == ()
    await queries.introduce(mesh, _nodes("a", "b", "c"))  # type: ignore[arg-type]
    queries.deliver("a", report(links=slow), book)  # to the query asked again since: dropped
    assert book.linked(NodeCapacity("a", 1)).links == ()
    assert queries.reports == before + 3


class _Placing:
    """What :func:`measured_links` reads of a coordinator: the mesh, its queries, and the
    candidates with the links their nodes reported."""

    def __init__(self, tmp_path: Path) -> None:
        self.mesh = _LiveMesh()
        self.queries = SpeedQueries(REF, "", backend=cpu_backend(), cache_dir=tmp_path)
        self.book = ClaimBook(MODEL)

    def candidates(self, live: list[NodeCapacity]) -> list[NodeCapacity]:
        return [self.book.linked(node) for node in live]


class _LiveMesh(_Mesh):
    def live_nodes(self) -> list[NodeCapacity]:
        return _nodes("a", "b")

    def membership_event(self) -> trio.Event:
        return self._changed


@pytest.mark.parametrize("answered", [True, False])
async def test_the_wait_for_links_ends_with_the_report_or_at_its_bound(
    tmp_path: Path, autojump_clock: Any, nursery: trio.Nursery, answered: bool
) -> None:
    placing = _Placing(tmp_path)
    to_host = PeerLink(node_id=HOST, rtt_us=800.0)
    for node in ("a", "b"):  # both tell their links: the one between them is awaited
        placing.book.record_links(node, (to_host,))
    began = trio.current_time()

    async def report_late() -> None:  # both answer, a with its link to b measured
        await trio.sleep(3.0)
        nonces = {node: query.nonce for node, query in placing.mesh.sent}
        slow = (to_host, PeerLink(node_id="b", rtt_us=800.0, bytes_per_s=SLOW))
        for node, links in (("b", (to_host,)), ("a", slow)):
            report = SpeedReport(node_id=node, nonce=nonces[node], package_ref=REF, links=links)
            placing.queries.deliver(node, report, placing.book)

    if answered:
        nursery.start_soon(report_late)
    live = await measured_links(placing)  # type: ignore[arg-type]
    waited = trio.current_time() - began
    assert waited == pytest.approx(3.0 if answered else LINKS_TIMEOUT_S)
    rates = {(n.node_id, x.node_id): x.bytes_per_s for n in live for x in n.links}
    assert rates.get(("a", "b")) == (SLOW if answered else None)


async def test_a_link_measured_after_the_calibration_keeps_its_ends_apart(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory plan of host, a, b, c (equal memory) is host, a, b. a measures its link
    to b, a slow one, only once the calibration's request is over: the host waits for it,
    and re-places the mesh before its API opens so that a and b are no neighbours. c, a
    spare node no plan prepares, measures itself when asked, so that it can be placed."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    to_host = PeerLink(node_id=HOST, rtt_us=1000.0)
    told: dict[str, tuple[PeerLink, ...]] = {"a": (to_host,), "b": (to_host,), "c": ()}
    # (c tells no links: none of its is awaited)
    deliver, released = mesh.deliver, trio.Event()

    async def measuring(sender: str, receiver: str, message: Message) -> None:
        await deliver(sender, receiver, message)
        if isinstance(message, Release) and not released.is_set():  # the calibration's
            released.set()
            told["a"] = (to_host, PeerLink(node_id="b", rtt_us=1000.0, bytes_per_s=SLOW))
            await mesh.workers["a"].speed.link_measured()

    monkeypatch.setattr(mesh, "deliver", measuring)
    send, pipelines = trio.open_memory_channel[RemotePipeline | None](4)
    async with trio.open_nursery() as nursery:
        for node in ("a", "b", "c"):
            links = functools.partial(told.__getitem__, node)  # what it tells now
            add_worker(mesh, node, tmp_path / f"{node}-cache", nursery, links=links,
                       measure_when_asked=True)  # fmt: skip
        settings = CoordinatorSettings(model_ref=ref, context_size=CONTEXT, split=3,
                                       calibrate=True)  # fmt: skip
        coordinator = Coordinator(mesh, settings, source=open_ref(package),
                                  backend=cpu_backend(), on_pipeline=send.send_nowait)  # fmt: skip
        mesh.coordinator = coordinator
        nursery.start_soon(coordinator.run)
        with trio.fail_after(BRING_UP_TIMEOUT_S * 2):
            first = await pipelines.receive()
        why = coordinator.why_replace
        nursery.cancel_scope.cancel()
    assert released.is_set()
    assert first is not None
    stages = first.stage_nodes
    assert stages[0] == HOST
    assert {"a", "b"} not in [set(pair) for pair in itertools.pairwise(stages)]
    assert why == "calibration placed the layers faster"
