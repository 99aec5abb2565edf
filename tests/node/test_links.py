"""Link bandwidth (``meshnode.node.links``): the rate from two timed probes, the peer's
answers bounded, the probe timed over a simulated link on a mock clock."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
from meshnode_protocol import (
    LINK_PROBE_FEATURE,
    Heartbeat,
    Hello,
    LinkProbe,
    LinkProbeReply,
    Message,
)

from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.node.links import (
    MAX_LINK_BYTES_PER_S,
    PROBE_ANSWER_BURST,
    PROBE_ANSWER_EVERY_S,
    PROBE_BYTES,
    PROBE_TIMEOUT_S,
    LinkBook,
    link_rate,
    padding,
)
from tests.node.member import Member, start_node


@pytest.mark.parametrize(
    ("empty_s", "padded_s", "expected"),
    [
        (0.010, 0.010 + PROBE_BYTES / 1e6, 1e6),  # 1 MB/s: the round trip cancels out
        (0.0, PROBE_BYTES / 125e6, 125e6),  # gigabit
        (0.5, 0.5 + PROBE_BYTES / 1e3, 1e3),  # a crawling link stays what it is
        # answered before the padding could have crossed: the cap, not infinity
        (0.010, 0.010, MAX_LINK_BYTES_PER_S),
        (0.020, 0.010, MAX_LINK_BYTES_PER_S),  # the padded one faster (noise)
        (0.0, math.nan, MAX_LINK_BYTES_PER_S),
        (0.0, 1e-12, MAX_LINK_BYTES_PER_S),
    ],
)
def test_the_rate_is_the_padding_over_the_extra_time(
    empty_s: float, padded_s: float, expected: float
) -> None:
    assert link_rate(PROBE_BYTES, empty_s, padded_s) == pytest.approx(expected)


class Link:
    """A peer across a simulated link: a probe's answer comes after ``rtt_s`` plus its
    padding over ``bytes_per_s`` (trio's clock), through the peer's own ``LinkBook``."""

    def __init__(self, book: LinkBook, peer: LinkBook, rtt_s: float, bytes_per_s: float) -> None:
        self.book, self.peer = book, peer
        self.rtt_s, self.bytes_per_s = rtt_s, bytes_per_s
        self.nursery: trio.Nursery | None = None
        self.early = False  # a hostile peer: answers before the padding arrives

    async def send(self, message: Message) -> None:
        assert isinstance(message, LinkProbe)
        assert self.nursery is not None
        self.nursery.start_soon(self._answer, message)

    async def _answer(self, probe: LinkProbe) -> None:
        size = 0 if probe.payload is None else probe.payload.nbytes
        await trio.sleep(self.rtt_s + (0 if self.early else size / self.bytes_per_s))
        reply = self.peer.answer(self.book.node_id, probe, trio.current_time())
        if reply is not None:
            self.book.answered(self.peer.node_id, reply)


async def _measure(link: Link) -> float | None:
    async with trio.open_nursery() as nursery:
        link.nursery = nursery
        return await link.book.measure(link.peer.node_id, link.send)


@pytest.mark.parametrize("bytes_per_s", [1e6, 12.5e6, 125e6])
async def test_a_link_is_measured_at_its_rate(autojump_clock: Any, bytes_per_s: float) -> None:
    book, peer = LinkBook("host"), LinkBook("w1")
    rate = await _measure(Link(book, peer, rtt_s=0.003, bytes_per_s=bytes_per_s))
    assert rate == pytest.approx(bytes_per_s)
    assert book.rate("w1") == pytest.approx(bytes_per_s)
    assert not book.due("w1", trio.current_time())


async def test_a_peer_answering_early_looks_no_faster_than_the_cap(autojump_clock: Any) -> None:
    book, peer = LinkBook("host"), LinkBook("liar")
    link = Link(book, peer, rtt_s=0.003, bytes_per_s=1e6)
    link.early = True
    assert await _measure(link) == MAX_LINK_BYTES_PER_S


async def test_an_unanswered_probe_leaves_the_link_unmeasured(autojump_clock: Any) -> None:
    book = LinkBook("host")

    async def silent(message: Message) -> None:
        pass

    began = trio.current_time()
    assert await book.measure("mute", silent) is None
    assert trio.current_time() - began == pytest.approx(PROBE_TIMEOUT_S)
    assert book.rate("mute") == 0.0
    assert book.due("mute", trio.current_time())


def test_a_peer_gets_a_few_answers_then_one_per_interval() -> None:
    book = LinkBook("w1")
    probe = LinkProbe(node_id="flood", nonce=1)
    answers = [book.answer("flood", probe, 0.0) for _ in range(PROBE_ANSWER_BURST + 3)]
    assert [a is not None for a in answers] == [True] * PROBE_ANSWER_BURST + [False] * 3
    assert book.answer("flood", probe, PROBE_ANSWER_EVERY_S / 2) is None
    assert book.answer("flood", probe, PROBE_ANSWER_EVERY_S) == LinkProbeReply(
        node_id="w1", nonce=1, received_bytes=0
    )
    assert book.answer("other", probe, 0.0) is not None  # a bucket per peer


def test_an_answer_to_no_probe_of_ours_is_dropped() -> None:
    book = LinkBook("host")
    book.answered("w1", LinkProbeReply(node_id="w1", nonce=99))  # nothing waits: no error
    assert book.rate("w1") == 0.0


async def test_a_node_measures_its_link_to_a_member_that_answers(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The real daemon on loopback, a real member (mutual TLS) whose Hello offers
    ``link-probe``: the node sends it an empty probe, then one of ``PROBE_BYTES``; once
    both are answered the member shows a measured link in the node's status."""
    token = JoinToken.generate("m")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    assert node.listen is not None
    member = await Member.dial(
        NodeIdentity.provision(token, tmp_path / "me"), node.listen, hello=False
    )
    hello = member.hello()
    await member.send(replace(hello, features=(*hello.features, LINK_PROBE_FEATURE)))
    await member.receive(Hello)
    sizes = []
    for _ in range(2):
        probe = await member.receive(LinkProbe)
        assert isinstance(probe, LinkProbe)
        sizes.append(0 if probe.payload is None else probe.payload.nbytes)
        await member.send(LinkProbeReply(node_id=member.node_id, nonce=probe.nonce))
    assert sizes == [0, PROBE_BYTES]
    # the echo of a heartbeat sent after the reply says the node has handled the reply
    await member.send(Heartbeat(node_id=member.node_id, nonce=7, sent_ns=1))
    while True:
        echo = await member.receive(Heartbeat)
        assert isinstance(echo, Heartbeat)
        if echo.echo_nonce == 7:
            break
    (peer,) = node.status()["peers"]
    assert peer["link_mbytes_per_s"] > 0
    await member.aclose()


async def test_a_node_answers_a_few_probes_of_a_member_and_drops_the_rest(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A member floods probes; the node answers ``PROBE_ANSWER_BURST`` of them. The flood
    ends with a heartbeat whose echo says every probe before it was handled."""
    token = JoinToken.generate("m")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    assert node.listen is not None
    member = await Member.dial(NodeIdentity.provision(token, tmp_path / "me"), node.listen)
    for nonce in range(1, 3 * PROBE_ANSWER_BURST):
        await member.send(LinkProbe(node_id=member.node_id, nonce=nonce, payload=padding(64)))
    await member.send(Heartbeat(node_id=member.node_id, nonce=7, sent_ns=1))
    answered = []
    while True:  # the node's own heartbeats come too; the echo of ours ends the wait
        message = await member.receive(Heartbeat, LinkProbeReply, LinkProbe)
        assert not isinstance(message, LinkProbe), "a member without the feature is probed"
        if isinstance(message, LinkProbeReply):
            answered.append((message.nonce, message.received_bytes))
        elif isinstance(message, Heartbeat) and message.echo_nonce == 7:
            break
    assert answered == [(nonce, 64) for nonce in range(1, PROBE_ANSWER_BURST + 1)]
    await member.aclose()
