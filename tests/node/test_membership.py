"""Peer table transitions, driven by plain clock values (no sleeping)."""

from __future__ import annotations

import pytest

from meshnode.net.identity import NodeId
from meshnode.node.config import HeartbeatTimeouts
from meshnode.node.membership import (
    FORGET_AFTER_DEAD,
    ConnectionLost,
    FrameReceived,
    MembershipError,
    PeerHello,
    PeerLeft,
    PeerState,
    PeerTable,
    RttMeasured,
    Tick,
    apply,
    changes,
    suspect_lost_at,
)

A = NodeId("aaaa")
TIMEOUTS = HeartbeatTimeouts(interval_s=1.0, suspect_after_s=3.0, dead_after_s=10.0)


def joined(now: float = 0.0) -> PeerTable:
    return apply(PeerTable(TIMEOUTS), PeerHello(A, "10.0.0.1:7470", "cpu", 1 << 30, now))


def state_at(table: PeerTable, now: float) -> PeerState:
    return apply(table, Tick(now)).peers[A].state


def test_hello_makes_a_peer_alive() -> None:
    table = joined()
    peer = table.peers[A]
    assert peer.state is PeerState.ALIVE
    assert (peer.address, peer.device, peer.usable_memory) == ("10.0.0.1:7470", "cpu", 1 << 30)
    assert table.alive() == [peer]


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (0.0, PeerState.ALIVE),
        (2.9, PeerState.ALIVE),
        (3.0, PeerState.SUSPECT),
        (9.9, PeerState.SUSPECT),
        (10.0, PeerState.DEAD),
    ],
)
def test_silence_makes_a_peer_suspect_then_dead(now: float, expected: PeerState) -> None:
    assert state_at(joined(), now) is expected


def test_any_frame_revives_a_suspect_peer() -> None:
    table = apply(joined(), Tick(5.0))
    assert table.peers[A].state is PeerState.SUSPECT
    table = apply(table, FrameReceived(A, 5.5))
    assert table.peers[A].state is PeerState.ALIVE
    assert state_at(table, 8.0) is PeerState.ALIVE


def test_rtt_is_recorded_and_counts_as_a_frame() -> None:
    table = apply(joined(), RttMeasured(A, 0.002, 2.0))
    assert table.peers[A].rtt_s == 0.002
    assert table.peers[A].last_seen_s == 2.0


def test_lost_connection_is_suspect_at_once_and_dead_after_the_timeout() -> None:
    table = apply(joined(), ConnectionLost(A, 1.0))
    assert table.peers[A].state is PeerState.SUSPECT
    assert state_at(table, 9.0) is PeerState.SUSPECT
    assert state_at(table, 10.0) is PeerState.DEAD


def test_goodbye_drops_the_peer_at_once() -> None:
    table = joined()
    left = apply(table, PeerLeft(A, 1.0))
    assert A not in left.peers
    assert changes(table, left) == [(A, PeerState.ALIVE, None)]


def test_dead_peers_are_forgotten_later() -> None:
    table = apply(joined(), Tick(10.0))
    assert table.peers[A].state is PeerState.DEAD
    assert A in apply(table, Tick(10.0 + FORGET_AFTER_DEAD * 10.0 - 0.1)).peers
    assert A not in apply(table, Tick(10.0 + FORGET_AFTER_DEAD * 10.0)).peers


def test_a_new_hello_brings_a_dead_peer_back() -> None:
    table = apply(apply(joined(), Tick(10.0)), PeerHello(A, "x:1", "cuda", 5, 11.0))
    peer = table.peers[A]
    assert (peer.state, peer.device, peer.since_s) == (PeerState.ALIVE, "cuda", 11.0)


def test_events_for_unknown_peers_are_errors() -> None:
    with pytest.raises(MembershipError, match="FrameReceived"):
        apply(PeerTable(TIMEOUTS), FrameReceived(A, 0.0))


def test_changes_lists_joins_and_transitions() -> None:
    empty = PeerTable(TIMEOUTS)
    table = joined()
    assert changes(empty, table) == [(A, None, PeerState.ALIVE)]
    assert changes(table, apply(table, Tick(1.0))) == []
    assert changes(table, apply(table, Tick(4.0))) == [(A, PeerState.ALIVE, PeerState.SUSPECT)]


@pytest.mark.parametrize(
    ("suspect_since", "stalled_since", "lost_at"),
    [
        (5.0, None, None),  # nothing in flight: lost only when dead
        (5.0, 1.0, 7.0),  # stalled before it fell silent: the grace runs from the suspicion
        (5.0, 6.0, 8.0),  # a pass sent to a suspect: the grace runs from the send
        (5.0, 5.0, 7.0),
    ],
)
def test_a_suspect_stage_is_lost_once_suspect_and_stalled_for_the_grace(
    suspect_since: float, stalled_since: float | None, lost_at: float | None
) -> None:
    assert suspect_lost_at(suspect_since, stalled_since, grace_s=2.0) == lost_at
