"""The dialer: which addresses are worth dialing, and redialing them with capped backoff.

Targets come from static ``--peer`` addresses, mDNS adverts and the peer lists of
``Hello``. The dialer connects to every target whose node it holds no session with and hands
the TLS stream to the sessions (:meth:`meshnode.node.sessions.Sessions.run_session`). A
failed dial backs off, doubling from the heartbeat interval up to ``MAX_DIAL_BACKOFF_S``;
learned targets that keep failing are dropped, static ones never are.

mDNS adverts are unauthenticated and the mesh id in them is public, so a spoofer can fill
the learned table (issue 36, item 3). Three rules keep room for real nodes: an advertised
target that never completed a handshake is dropped after ``MAX_LEARNED_FAILURES`` failed
dials like any learned one (only one that did is kept while its advert lasts); a full table
makes room for a new address by evicting the never-handshaken target that failed most; and
each advertised host adds new targets from a token bucket (``HOST_TARGETS_BURST``).
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from meshnode_protocol import PROTOCOL_VERSION, PeerInfo

from meshnode.net.discovery import Discovered, DiscoveryEvent, Vanished
from meshnode.net.identity import NodeId
from meshnode.net.limits import (
    DEFAULT_LIMITS,
    HOST_TARGETS_BURST,
    HOST_TARGETS_PER_S,
    MeshLimits,
    RateLimitedLog,
    TokenBuckets,
)
from meshnode.net.stream import TRANSPORT_ERRORS
from meshnode.node.config import Address, ConfigError

log = logging.getLogger("meshnode.node")

DIAL_TIMEOUT_S = 5.0
# Redial backoff doubles from the heartbeat interval up to this cap.
MAX_DIAL_BACKOFF_S = 5.0
# Learned (non-static) targets that keep failing are dropped; static ones never are, nor
# are mDNS-advertised ones that once completed a handshake, while the advert lasts (a
# partition longer than these failures would otherwise lose the peer for good: mDNS
# announces a known record only once).
MAX_LEARNED_FAILURES = 5
# How often ``connect`` looks again while it waits for a session to come up.
CONNECT_POLL_S = 0.1
# Peers of a host's SpeedQuery learned at most (links.MAX_REPORTED_LINKS: the links a
# report may tell); the learned-target bounds apply to them as to a Hello's peer list.
MAX_MET_PEERS = 64


@dataclass(eq=False)
class DialTarget:
    """An address worth dialing, and what we learned from dialing it."""

    address: Address
    static: bool
    node_id: NodeId | None = None
    advertised: bool = False  # found by mDNS: kept until the advert vanishes, once handshaken
    handshaken: bool = False  # a dial of it got past Hello at least once
    failures: int = 0
    next_attempt_s: float = 0.0
    in_flight: bool = False


RunSession = Callable[[trio.SSLStream[trio.SocketStream], DialTarget], Awaitable[bool]]
"""Runs a session over a dialed stream; True if it got past Hello."""


class Dialer:
    """The dial targets of one node and the task that dials them (module docstring)."""

    def __init__(
        self,
        node_id: NodeId,
        static: tuple[Address, ...],
        *,
        interval_s: float,
        client_context: ssl.SSLContext,
        run_session: RunSession,
        connected: Callable[[NodeId], bool],
        limits: MeshLimits = DEFAULT_LIMITS,
    ) -> None:
        self.node_id = node_id
        self.limits = limits
        self.targets: dict[Address, DialTarget] = {a: DialTarget(a, static=True) for a in static}
        self.listen: Address | None = None  # our own address, never dialed
        self._interval_s = interval_s
        self._client_ctx = client_context
        self._run_session = run_session
        self._connected = connected
        self._wake = trio.Event()
        self._refusals = RateLimitedLog(log)
        self._new_per_host = TokenBuckets(burst=HOST_TARGETS_BURST, per_s=HOST_TARGETS_PER_S)

    # -- targets --------------------------------------------------------------------------

    def learn(self, address: Address, node_id: NodeId | None) -> None:
        """Add ``address`` as a target (or name its node); our own address is ignored."""
        if node_id == self.node_id or address == self.listen:
            return
        target = self.targets.get(address)
        if target is None:
            learned = sum(not t.static for t in self.targets.values())
            if learned >= self.limits.max_learned_targets and not self._evict_one():
                self._refusals.warning(
                    "targets", trio.current_time(),
                    "not dialing %s: %d learned addresses already (max_learned_targets)",
                    address, learned,
                )  # fmt: skip
                return
            self.targets[address] = DialTarget(address, static=False, node_id=node_id)
            self._wake.set()
        elif target.node_id is None:
            target.node_id = node_id

    def _evict_one(self) -> bool:
        """Drop the learned, never-handshaken target that failed most (at least once);
        False when there is none, and the table stays as it is."""
        candidates = [
            t for t in self.targets.values()
            if not (t.static or t.handshaken or t.in_flight) and t.failures > 0
        ]  # fmt: skip
        if not candidates:
            return False
        del self.targets[max(candidates, key=lambda t: t.failures).address]
        return True

    def learn_text(self, address: str, node_id: NodeId) -> None:
        """:meth:`learn` an address a peer told us; an unparsable one is ignored."""
        with contextlib.suppress(ConfigError):
            self.learn(Address.parse(address), node_id)

    def meet(self, peers: tuple[PeerInfo, ...]) -> None:
        """:meth:`learn_text` the peers a host's ``SpeedQuery`` names (as many as a report
        may tell the links of), so that the links to them are measured."""
        for info in peers[:MAX_MET_PEERS]:
            self.learn_text(info.address, NodeId(info.node_id))

    def forget(self, node_id: NodeId) -> None:
        """Drop the learned targets of a node that left (unless a dial is under way)."""
        for address, target in list(self.targets.items()):
            if target.node_id == node_id and not target.static and not target.in_flight:
                del self.targets[address]

    async def consume_discovery(self, receive: trio.MemoryReceiveChannel[DiscoveryEvent]) -> None:
        """Learn from mDNS adverts and forget vanished nodes, until the channel closes."""
        async for event in receive:
            if isinstance(event, Discovered):
                if event.protocol_version != PROTOCOL_VERSION:
                    log.warning("ignoring %s: protocol %d", event.node_id, event.protocol_version)
                    continue
                address = Address(event.host, event.port)
                known = address in self.targets
                if not known and self._new_per_host.allow(event.host, trio.current_time()) is None:
                    continue  # this host advertised too many new addresses lately
                self.learn(address, NodeId(event.node_id))
                if (target := self.targets.get(address)) is not None:
                    target.advertised = True
            elif isinstance(event, Vanished):
                self.forget(NodeId(event.node_id))

    async def connect(
        self, info: PeerInfo, timeout_s: float, changed: Callable[[], Awaitable[None]]
    ) -> None:
        """Dial ``info`` now unless connected, until connected; ``changed`` waits for news.

        Raises ``trio.TooSlowError`` when no session comes up within ``timeout_s``.
        """
        node_id = NodeId(info.node_id)
        with trio.fail_after(timeout_s):
            while not self._connected(node_id):
                self.learn_text(info.address, node_id)
                target = next((t for t in self.targets.values() if t.node_id == node_id), None)
                if target is not None and not target.in_flight:
                    target.next_attempt_s = 0.0
                    self._wake.set()
                with trio.move_on_after(CONNECT_POLL_S):
                    await changed()

    # -- dialing --------------------------------------------------------------------------

    async def run(self, nursery: trio.Nursery) -> None:
        """Dial every due target (in ``nursery``), every interval or when woken.

        At most ``max_concurrent_dials`` dials are connecting at once (static targets
        first, then those that failed least), so a flood of spoofed adverts delays
        nothing for long and costs a bounded number of sockets.
        """
        while True:
            now = trio.current_time()
            connecting = self.connecting()
            for target in sorted(self.targets.values(), key=lambda t: (not t.static, t.failures)):
                if connecting >= self.limits.max_concurrent_dials:
                    break
                if self._should_dial(target, now):
                    target.in_flight = True
                    connecting += 1
                    nursery.start_soon(self._dial, target)
            self._wake = trio.Event()
            with trio.move_on_after(self._interval_s):
                await self._wake.wait()

    def connecting(self) -> int:
        """Dials under way that have not become a session (a dial's task serves the session
        it opens, so ``in_flight`` alone would count live sessions too)."""
        return sum(
            t.in_flight and not (t.node_id is not None and self._connected(t.node_id))
            for t in self.targets.values()
        )

    def _should_dial(self, target: DialTarget, now: float) -> bool:
        if target.in_flight or now < target.next_attempt_s:
            return False
        if target.node_id is not None and (
            target.node_id == self.node_id or self._connected(target.node_id)
        ):
            return False
        return target.address != self.listen

    async def _dial(self, target: DialTarget) -> None:
        address = target.address
        ok = False
        try:
            with trio.fail_after(DIAL_TIMEOUT_S):
                tcp = await trio.open_tcp_stream(address.host, address.port)
            stream = trio.SSLStream(tcp, self._client_ctx)
            ok = await self._run_session(stream, target)
        except (trio.TooSlowError, *TRANSPORT_ERRORS) as exc:
            log.debug("dial %s failed: %r", address, exc)
        finally:
            target.in_flight = False
            self._after_dial(target, ok)
            self._wake.set()  # a dial slot is free

    def _after_dial(self, target: DialTarget, ok: bool) -> None:
        target.failures = 0 if ok else target.failures + 1
        target.handshaken = target.handshaken or ok
        backoff = min(MAX_DIAL_BACKOFF_S, self._interval_s * 2 ** min(target.failures, 10))
        target.next_attempt_s = trio.current_time() + backoff
        kept = target.static or (target.advertised and target.handshaken)
        if not kept and target.failures >= MAX_LEARNED_FAILURES:
            self.targets.pop(target.address, None)
