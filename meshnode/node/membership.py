"""The peer table as a pure state machine: ``apply(table, event) -> table``.

Theory of operation. Each peer is *alive*, *suspect* or *dead*. Any frame from a peer
(its Hello, a heartbeat, an echo) proves it alive and refreshes ``last_seen_s``. Time
passing is itself an event (:class:`Tick`): silence longer than ``suspect_after_s`` makes
a peer suspect, longer than ``dead_after_s`` dead. A lost connection makes it suspect at
once (a SIGKILLed process closes its sockets, but so does a flaky link that will come back);
a goodbye drops it from the table at once (it left; it did not fail). Dead peers are
forgotten after ``FORGET_AFTER_DEAD`` times the dead timeout, so ``meshnode status`` still
shows who failed recently.

Suspect is not lost. Silence of ``suspect_after_s`` is weak evidence: a node starved on busy
cores (a user compiling, a browser, a test suite beside busy loops) goes quiet that long and
is back within a beat. The host drops a stage (:mod:`meshnode.node.watch`) when its node is
dead, or when it has been suspect for ``suspect_grace_s`` while the pipeline's passes also
stalled that long (:func:`suspect_lost_at`): a pass whose replies still come back is alive
whatever its heartbeats, and a suspect stage with nothing in flight costs nobody anything
until it is dead. A stage that hangs while its heartbeats flow is never suspect: the pass
deadline finds it (:mod:`meshnode.node.remote`).

Times are seconds on the trio clock (``trio.current_time()``), passed in by the caller, so
tests drive this with plain numbers and the daemon with a mock clock if it likes.

Errors: :class:`MembershipError` for an event about a peer the table has never seen (a bug
in the caller: every session starts with the peer's Hello).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from meshnode.errors import MeshnodeError
from meshnode.net.identity import NodeId
from meshnode.node.config import HeartbeatTimeouts

# Dead peers stay listed this many dead-timeouts, then drop out of the table.
FORGET_AFTER_DEAD = 3.0


class MembershipError(MeshnodeError, RuntimeError):
    """An event that the peer table cannot apply in its current state."""


class PeerState(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Peer:
    """What this node knows about one peer."""

    node_id: NodeId
    address: str  # the peer's mesh listen address, HOST:PORT
    device: str
    usable_memory: int
    state: PeerState
    last_seen_s: float
    since_s: float  # when it entered ``state``
    rtt_s: float | None = None


# ---- events -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerHello:
    """A session with the peer completed its Hello exchange."""

    node_id: NodeId
    address: str
    device: str
    usable_memory: int
    now_s: float


@dataclass(frozen=True, slots=True)
class FrameReceived:
    node_id: NodeId
    now_s: float


@dataclass(frozen=True, slots=True)
class RttMeasured:
    node_id: NodeId
    rtt_s: float
    now_s: float


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    node_id: NodeId
    now_s: float


@dataclass(frozen=True, slots=True)
class PeerLeft:
    """The peer said goodbye (clean shutdown)."""

    node_id: NodeId
    now_s: float


@dataclass(frozen=True, slots=True)
class Tick:
    now_s: float


Event = PeerHello | FrameReceived | RttMeasured | ConnectionLost | PeerLeft | Tick


@dataclass(frozen=True, slots=True)
class PeerTable:
    """An immutable snapshot of every known peer, keyed by node id."""

    timeouts: HeartbeatTimeouts
    peers: Mapping[NodeId, Peer] = field(default_factory=lambda: MappingProxyType({}))

    def with_peer(self, peer: Peer) -> PeerTable:
        return replace(self, peers=MappingProxyType({**self.peers, peer.node_id: peer}))

    def alive(self) -> list[Peer]:
        """Peers currently alive, by node id."""
        return [p for _, p in sorted(self.peers.items()) if p.state is PeerState.ALIVE]


def apply(table: PeerTable, event: Event) -> PeerTable:
    """The table after ``event``; raises :class:`MembershipError` for an unknown peer."""
    if isinstance(event, Tick):
        return _tick(table, event.now_s)
    if isinstance(event, PeerHello):
        return table.with_peer(
            Peer(
                node_id=event.node_id,
                address=event.address,
                device=event.device,
                usable_memory=event.usable_memory,
                state=PeerState.ALIVE,
                last_seen_s=event.now_s,
                since_s=_since(table, event.node_id, PeerState.ALIVE, event.now_s),
                rtt_s=None,
            )
        )
    peer = table.peers.get(event.node_id)
    if peer is None:
        raise MembershipError(f"peer table: {type(event).__name__} for unknown {event.node_id}")
    if isinstance(event, FrameReceived):
        return table.with_peer(_to(peer, PeerState.ALIVE, event.now_s, last_seen_s=event.now_s))
    if isinstance(event, RttMeasured):
        alive = _to(peer, PeerState.ALIVE, event.now_s, last_seen_s=event.now_s)
        return table.with_peer(replace(alive, rtt_s=event.rtt_s))
    if isinstance(event, ConnectionLost):
        if peer.state is PeerState.ALIVE:
            return table.with_peer(_to(peer, PeerState.SUSPECT, event.now_s))
        return table
    if isinstance(event, PeerLeft):
        rest = {k: v for k, v in table.peers.items() if k != event.node_id}
        return replace(table, peers=MappingProxyType(rest))
    raise AssertionError(f"unhandled event {event!r}")


def _since(table: PeerTable, node_id: NodeId, state: PeerState, now_s: float) -> float:
    old = table.peers.get(node_id)
    return old.since_s if old is not None and old.state is state else now_s


def _to(peer: Peer, state: PeerState, now_s: float, *, last_seen_s: float | None = None) -> Peer:
    """``peer`` in ``state``; ``since_s`` moves only when the state changes."""
    return replace(
        peer,
        state=state,
        since_s=peer.since_s if peer.state is state else now_s,
        last_seen_s=peer.last_seen_s if last_seen_s is None else last_seen_s,
    )


def _tick(table: PeerTable, now_s: float) -> PeerTable:
    t = table.timeouts
    forget_after_s = FORGET_AFTER_DEAD * t.dead_after_s
    kept: dict[NodeId, Peer] = {}
    for node_id, peer in table.peers.items():
        silent_s = now_s - peer.last_seen_s
        if peer.state is PeerState.DEAD:
            if now_s - peer.since_s < forget_after_s:
                kept[node_id] = peer
        elif silent_s >= t.dead_after_s:
            kept[node_id] = _to(peer, PeerState.DEAD, now_s)
        elif silent_s >= t.suspect_after_s:
            kept[node_id] = _to(peer, PeerState.SUSPECT, now_s)
        else:
            kept[node_id] = peer
    return replace(table, peers=MappingProxyType(kept))


def suspect_lost_at(
    suspect_since_s: float, stalled_since_s: float | None, grace_s: float
) -> float | None:
    """The trio time a stage whose node has been suspect since ``suspect_since_s`` counts as
    lost, if nothing changes meanwhile: once it has been suspect for ``grace_s`` *and* its
    pipeline's passes, in flight since ``stalled_since_s`` with no reply, have stalled as
    long (theory of operation). ``None`` while no pass is in flight: a suspect stage that
    nothing waits on is lost only when it is dead."""
    if stalled_since_s is None:
        return None
    return max(suspect_since_s, stalled_since_s) + grace_s


Change = tuple[NodeId, PeerState | None, PeerState | None]


def changes(old: PeerTable, new: PeerTable) -> list[Change]:
    """``(node_id, old state, new state)`` for every peer whose state changed.

    ``None`` as the old state means the peer is new; as the new state, that it was dropped.
    """
    out: list[Change] = []
    for node_id in sorted(old.peers.keys() | new.peers.keys()):
        before, after = old.peers.get(node_id), new.peers.get(node_id)
        b = None if before is None else before.state
        a = None if after is None else after.state
        if a is not b:
            out.append((node_id, b, a))
    return out
