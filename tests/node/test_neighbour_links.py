"""A worker's measured links to its peers travel to the host (issue 34): in its
``InventoryReport`` and ``SpeedReport``, bounded as claims (:mod:`meshnode.node.claims`),
into the planner's hop between two worker stages and the status."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
from meshnode_protocol import InventoryReport, PeerLink, SpeedReport

from meshnode.node.claims import MAX_LINKS, MAX_RTT_S, ClaimBook, claimed_links
from meshnode.node.links import MAX_LINK_BYTES_PER_S, LinkBook, LinkRate, reported_links
from meshnode.node.planner import NodeCapacity, NodeLink
from tests.node.inmemory import HOST, InMemoryMesh, add_worker, serve
from tests.node.test_planner import MODEL  # 30 layers of 4 MiB

SLOW = 50_000.0  # bytes a second


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ((PeerLink(node_id="b", rtt_us=800.0, bytes_per_s=SLOW),), (NodeLink("b", 8e-4, SLOW),)),
        # a rate past any link is capped; a round trip past any heartbeat's too
        ((PeerLink(node_id="b", rtt_us=1e12, bytes_per_s=1e15),),
         (NodeLink("b", MAX_RTT_S, MAX_LINK_BYTES_PER_S),)),
        # nonsense figures are not measured; a link left with neither is dropped
        ((PeerLink(node_id="b", rtt_us=math.nan, bytes_per_s=SLOW),), (NodeLink("b", 0.0, SLOW),)),
        ((PeerLink(node_id="b", rtt_us=-5.0, bytes_per_s=-math.inf),), ()),
        ((PeerLink(node_id="b", rtt_us=math.inf, bytes_per_s=math.nan),), ()),
        # a link to itself, to no one, or a peer named twice (the first counts)
        ((PeerLink(node_id="a", rtt_us=1.0), PeerLink(node_id="", rtt_us=1.0)), ()),
        ((PeerLink(node_id="b", rtt_us=1.0), PeerLink(node_id="b", rtt_us=9.0)),
         (NodeLink("b", 1e-6),)),
    ],
)  # fmt: skip
def test_a_reported_link_is_a_bounded_claim(
    sent: tuple[PeerLink, ...], kept: tuple[NodeLink, ...]
) -> None:
    assert claimed_links("a", sent) == kept


def test_a_report_keeps_at_most_max_links() -> None:
    sent = tuple(PeerLink(node_id=f"n{i}", rtt_us=100.0) for i in range(10 * MAX_LINKS))
    kept = claimed_links("a", sent)
    assert [link.node_id for link in kept] == [f"n{i}" for i in range(MAX_LINKS)]


@pytest.mark.parametrize("compute", [True, False])
def test_a_book_without_compute_claims_keeps_the_links(compute: bool) -> None:
    """``--placement memory``'s book (``compute=False``) keeps what a report says of its
    links, never its speed; the placement by speed's keeps both."""
    book = ClaimBook(MODEL, compute=compute)
    links = (PeerLink(node_id="b", rtt_us=2000.0, bytes_per_s=SLOW),)
    report = InventoryReport(run_id="r", term=1, node_id="a", package_ref="m", ready=((0, 1),),
                             decode_us=1000.0, layer_bytes=1, links=links)  # fmt: skip
    book.record("a", report)
    assert book.linked(NodeCapacity("a", 1)).links == (NodeLink("b", 0.002, SLOW),)
    assert (book.speed("a") is not None) == compute
    assert (book.shown("a") is not None) == compute


def test_both_reports_carry_the_links_into_the_planners_nodes() -> None:
    book = ClaimBook(MODEL)
    links = (PeerLink(node_id="b", rtt_us=2000.0, bytes_per_s=SLOW),)
    # a cold node's empty SpeedReport still tells its links
    book.record_cached("a", SpeedReport(node_id="a", nonce=1, package_ref="m", links=links))
    assert book.linked(NodeCapacity("a", 1)).links == (NodeLink("b", 0.002, SLOW),)
    assert book.speed("a") is None
    # a prepared node's report: its claim and its links, the latest replacing the older
    report = InventoryReport(run_id="r", term=1, node_id="a", package_ref="m",
                             ready=((0, 1),), decode_us=1000.0, layer_bytes=1)  # fmt: skip
    book.record("a", report)
    assert book.linked(NodeCapacity("a", 1)).links == ()
    assert book.speed("a") is not None
    assert book.linked(NodeCapacity("z", 1)).links == ()  # never reported


def test_a_node_reports_the_links_it_measured() -> None:
    book = LinkBook("a")
    book.rates["b"] = LinkRate(SLOW, 0.0)
    peers = [("b", 0.003), ("c", 0.001), ("d", None)]  # d: nothing known yet
    assert reported_links(peers, book) == (
        PeerLink(node_id="b", rtt_us=3000.0, bytes_per_s=SLOW),
        PeerLink(node_id="c", rtt_us=1000.0, bytes_per_s=0.0),
    )


@pytest.mark.parametrize(
    ("placement", "claims_kept"),
    [
        ("speed", True),
        # memory placement keeps the links alone: compute claims never move layers there,
        # but the hops still cross the network the nodes measured
        ("memory", False),
    ],
)
async def test_a_workers_link_to_its_neighbour_reaches_the_host_plan_and_status(
    tmp_path: Path, hub_ref: tuple[str, Path], placement: str, claims_kept: bool
) -> None:
    """Worker a reports a slow link to b: the host's candidates carry it, the planner's hop
    between the two stages is timed by it, and the status shows it on b's stage; with
    ``--placement memory`` too, where the nodes' compute claims are not kept."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        slow = (PeerLink(node_id="b", rtt_us=4000.0, bytes_per_s=SLOW),)
        add_worker(mesh, "a", tmp_path / "a-cache", nursery, links=lambda: slow)
        add_worker(mesh, "b", tmp_path / "b-cache", nursery)
        by_speed = placement == "speed"
        pipeline = await serve(mesh, ref, package, 3, nursery, place_by_speed=by_speed)
        coordinator = mesh.coordinator
        assert coordinator is not None
        status = coordinator.status()
        nodes = {n.node_id: n for n in coordinator.candidates(mesh.live_nodes())}
        claimed = {n: coordinator.claims.speed(n) is not None for n in (HOST, "a", "b")}
        nursery.cancel_scope.cancel()
    assert pipeline.stage_nodes == (HOST, "a", "b")
    assert claimed == dict.fromkeys((HOST, "a", "b"), claims_kept)
    assert all((s["self_measured"] is not None) == claims_kept for s in status["stages"])
    assert nodes["a"].links == (NodeLink("b", 0.004, SLOW),)
    assert nodes["b"].links == ()
    assert status["placed_by"] == "memory"  # a first plan of cold nodes, by either
    one, two = status["stages"][1:]
    assert one["hop_from"] == HOST
    assert one["link_mbytes_per_s"] is None  # the host's own link: not measured here
    assert two["hop_from"] == "a"
    assert two["link_mbytes_per_s"] == SLOW / 1e6
    hop_s = 0.004 + coordinator.footprint.activation_bytes_per_token / SLOW
    assert two["hop_ms"] == pytest.approx(hop_s * 1e3, abs=1e-3)
