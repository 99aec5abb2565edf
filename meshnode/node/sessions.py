"""Peer sessions: TLS handshake, Hello and admission, heartbeats, the receive loop, dispatch.

Theory of operation. A connection, accepted or dialed, becomes a *session*: TLS handshake
(mutual, mesh CA; failures are counted as refused), then ``Hello`` both ways (the dialer's
first; the listener answers once it has admitted the dialer, so its peer list is current),
then a heartbeat sender and a receive loop until EOF, goodbye, a protocol error or a
timeout. Between two nodes one session survives: the one dialed by the smaller node id, so
simultaneous dials from both sides settle the same way on both sides.

Every observation becomes a membership event handed to the owner
(:class:`SessionOwner`, the daemon's :class:`~meshnode.node.daemon.Node`), which also
routes every message that is not session business (heartbeats and goodbyes are).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio
from meshnode_protocol import (
    LINK_PROBE_FEATURE,
    Connection,
    Error,
    ErrorCode,
    Goodbye,
    Heartbeat,
    Hello,
    LinkProbe,
    LinkProbeReply,
    Message,
    RemoteProtocolError,
    Role,
)

from meshnode.net.identity import NodeId, PeerIdentityError, certified_node_id
from meshnode.net.limits import DEFAULT_LIMITS, MeshLimits, RateLimitedLog, TokenBuckets
from meshnode.net.logtext import remote_text
from meshnode.net.stream import TRANSPORT_ERRORS, PeerStream
from meshnode.node.config import Address
from meshnode.node.dialer import DialTarget
from meshnode.node.handshakes import Pending, PendingHandshakes
from meshnode.node.links import LinkBook
from meshnode.node.membership import (
    Event,
    FrameReceived,
    PeerHello,
    PeerLeft,
    RttMeasured,
)
from meshnode.node.wire import for_peer

log = logging.getLogger("meshnode.node")

# TLS handshake plus the Hello exchange; a peer slower than this on a LAN is not healthy.
HANDSHAKE_TIMEOUT_S = 5.0
GOODBYE_TIMEOUT_S = 2.0
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


@dataclass(eq=False)
class Session:
    """One authenticated connection to a peer, after the Hello exchange."""

    node_id: NodeId
    peer: PeerStream
    dialer_id: NodeId  # who dialed: decides which of two duplicate sessions survives
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    left: bool = False
    features: frozenset[str] = frozenset()  # what the peer's Hello says it accepts


class SessionOwner(Protocol):
    """What the sessions need of the node that owns them."""

    def hello(self) -> Hello:
        """This node's ``Hello`` (addresses, capacity, the peers it knows)."""
        ...

    def observe(self, event: Event) -> None:
        """Apply a membership event (a peer said hello, spoke, left, was lost, …)."""
        ...

    def learn(self, address: Address, node_id: NodeId | None) -> None:
        """A peer's address worth dialing."""
        ...

    def learn_text(self, address: str, node_id: NodeId) -> None:
        """An address a peer told us (ignored when unparsable)."""
        ...

    def forget(self, node_id: NodeId) -> None:
        """A peer said goodbye: stop dialing it."""
        ...

    async def route(self, peer: NodeId, message: Message) -> bool:
        """Handle a message of the node's roles; False if none takes it."""
        ...

    def session_lost(self, node_id: NodeId, *, unexpected: bool) -> None:
        """The session with ``node_id`` ended; ``unexpected`` unless the peer or we said
        goodbye (then closing it is no news about the peer)."""
        ...


class Sessions:
    """The live sessions of one node, by peer, and the counters of refused connections."""

    def __init__(
        self,
        node_id: NodeId,
        mesh_id: str,
        owner: SessionOwner,
        *,
        interval_s: float,
        server_context: ssl.SSLContext,
        limits: MeshLimits = DEFAULT_LIMITS,
        quiet: Callable[[], bool] = lambda: True,
        link_measured: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.node_id = node_id
        self.limits = limits
        self.mesh_id = mesh_id
        self.owner = owner
        self.live: dict[NodeId, Session] = {}
        self.refused_handshakes = 0
        self.protocol_errors = 0
        self.internal_errors = 0
        self.stopping = False  # after goodbye: closing sessions is not news about peers
        self._interval_s = interval_s
        self._server_ctx = server_context
        self._nonces = itertools.count(1)
        # Accepted connections still in TLS or before their Hello, by TCP stream.
        self._pending = PendingHandshakes(limits)
        self._refusals = RateLimitedLog(log)
        self._peer_lines = TokenBuckets()  # lines each member's frames may cause
        # The measured rate of the link to each peer (meshnode.node.links); ``quiet`` says
        # when no request passes through the node, so that a link may be probed.
        self.links = LinkBook(node_id, quiet=quiet, measured=link_measured)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.live

    def __len__(self) -> int:
        return len(self.live)

    async def send(self, node_id: str, message: Message) -> None:
        """Send ``message`` over the session with ``node_id``.

        Raises ``KeyError`` when there is no session, transport errors when it broke.
        """
        session = self.live[NodeId(node_id)]
        for part in for_peer(message, session.features):
            await session.peer.send(part)

    def close(self, node_id: NodeId) -> None:
        """End the session with ``node_id`` (the membership declared it dead)."""
        if node_id in self.live:
            self.live[node_id].scope.cancel()

    async def say_goodbye(self) -> None:
        """Tell every peer we are leaving, in parallel, bounded by ``GOODBYE_TIMEOUT_S``."""
        goodbye = Goodbye(node_id=self.node_id, reason="shutdown")
        self.stopping = True

        async def send(session: Session) -> None:
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await session.peer.send(goodbye)

        with trio.move_on_after(GOODBYE_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for session in list(self.live.values()):
                    nursery.start_soon(send, session)

    # -- connections --------------------------------------------------------------------

    async def handle_inbound(self, tcp: trio.SocketStream) -> None:
        """Serve an accepted connection (``trio.serve_listeners`` handler).

        Connections before their ``Hello`` are bounded in all and per source; a new one
        evicts the oldest idle one when a bound is reached, and one that sends nothing
        within ``client_hello_timeout_s`` is closed (:mod:`meshnode.node.handshakes`).
        Both count as refused.
        """
        entry = Pending(_source(tcp), trio.current_time(), trio.CancelScope())
        for victim in self._pending.add(tcp, entry):
            self._refuse(
                "busy", "closed the oldest idle of %d pending handshakes (%d from %s)",
                len(self._pending), self._pending.from_source(victim.source), victim.source,
            )  # fmt: skip
            victim.scope.cancel()
        try:
            with entry.scope, contextlib.suppress(trio.TooSlowError, *TRANSPORT_ERRORS):
                timeout_s = self.limits.client_hello_timeout_s
                with trio.move_on_after(timeout_s) as silent:
                    await trio.lowlevel.wait_readable(tcp.socket)
                if silent.cancelled_caught:
                    self._refuse("idle", "nothing sent within %g s", timeout_s)
                    return
                entry.spoke = True
                stream = trio.SSLStream(tcp, self._server_ctx, server_side=True)
                await self.run_session(stream, None)
        finally:
            self._pending.discard(tcp)
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await trio.aclose_forcefully(tcp)

    def _refuse(self, kind: str, reason: str, *args: object) -> None:
        self.refused_handshakes += 1
        self._refusals.warning(kind, trio.current_time(), "refused a connection: " + reason, *args)

    async def run_session(
        self, stream: trio.SSLStream[trio.SocketStream], target: DialTarget | None
    ) -> bool:
        """Handshake, Hello, then serve the session; ``True`` if it got past Hello.

        ``target`` is the dialed target, ``None`` for an accepted connection.
        """
        cert_id = await self._handshake(stream)
        if cert_id is None:
            return False
        peer = PeerStream(stream, Connection(Role.LISTENER if target is None else Role.DIALER))
        dialer = target is not None
        try:
            # The dialer speaks first; the listener answers once it has admitted the
            # dialer, so that of two nodes joining through it at once the later one
            # learns of the earlier from the peer list in its Hello.
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                if dialer:
                    await peer.send(self.owner.hello())
                hello = await peer.receive()
            self._pending.discard(stream.transport_stream)  # past its Hello: not pending
            session = self._admit(peer, hello, cert_id, stream, target)
            if session is None:
                return hello is not None
            with session.scope:
                await self._serve(session, send_hello=not dialer)
            return True
        except RemoteProtocolError as exc:
            self.protocol_errors += 1
            log.warning("closed a connection from %s: %s", cert_id, exc)
            return False
        finally:
            await peer.aclose()

    async def _handshake(self, stream: trio.SSLStream[trio.SocketStream]) -> NodeId | None:
        """TLS handshake; the peer's certified node id, or ``None`` (counted as refused)."""
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                await stream.do_handshake()
            return certified_node_id(stream.getpeercert(binary_form=True))
        except (trio.TooSlowError, PeerIdentityError, *TRANSPORT_ERRORS) as exc:
            self._refuse("tls", "TLS handshake failed (%r)", exc)
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await trio.aclose_forcefully(stream)
            return None

    def _admit(
        self,
        peer: PeerStream,
        hello: Message | None,
        cert_id: NodeId,
        stream: trio.SSLStream[trio.SocketStream],
        target: DialTarget | None,
    ) -> Session | None:
        """Check the Hello and the duplicate rule; the new session, or ``None`` to close."""
        if not isinstance(hello, Hello):
            return None  # EOF before Hello (the codec rejects any other first message)
        if hello.node_id != cert_id or hello.mesh_id_hash != self.mesh_id:
            log.warning(
                "closed a connection: Hello claims %s but TLS says %s", hello.node_id, cert_id
            )
            return None
        node_id = NodeId(hello.node_id)
        if target is not None:
            target.node_id = node_id
        if node_id == self.node_id:
            return None  # we dialed ourselves (our own advert or a peer list naming us)
        dialer = self.node_id if target is not None else node_id
        session = Session(node_id, peer, dialer, features=frozenset(hello.features))
        if not self._replaces(session):
            return None
        self.live[node_id] = session
        address = _peer_address(hello.listen_address, stream)
        now = trio.current_time()
        self.owner.observe(
            PeerHello(node_id, str(address), hello.device_kind, hello.usable_memory, now)
        )
        self.owner.learn(address, node_id)
        for info in hello.known_peers:
            self.owner.learn_text(info.address, NodeId(info.node_id))
        return session

    def _replaces(self, session: Session) -> bool:
        """The duplicate rule: keep the session dialed by the smaller node id."""
        existing = self.live.get(session.node_id)
        if existing is None:
            return True
        preferred = min(self.node_id, session.node_id)
        if existing.dialer_id == preferred or session.dialer_id != preferred:
            return False
        existing.scope.cancel()
        return True

    # -- a live session -----------------------------------------------------------------

    async def _serve(self, session: Session, *, send_hello: bool) -> None:
        # The nursery wraps whatever ends the session in an ExceptionGroup; both kinds
        # end only this session.
        try:
            if send_hello:
                with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                    await session.peer.send(self.owner.hello())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_heartbeats, session)
                if LINK_PROBE_FEATURE in session.features:  # meshnode.node.links
                    nursery.start_soon(self.links.keep_measured, session.node_id, session.peer.send)
                await self._receive_loop(session)
                nursery.cancel_scope.cancel()
        except* RemoteProtocolError as group:
            self.protocol_errors += 1
            log.warning("closed the session with %s: %s", session.node_id, group.exceptions[0])
        except* (trio.TooSlowError, *TRANSPORT_ERRORS) as group:
            log.debug("session with %s broke: %r", session.node_id, group.exceptions[0])
        except* Exception as group:
            # Our own bug while handling this peer's message: it ends this session, not the
            # daemon, which keeps serving everyone else. Cancellation is not an Exception.
            self.internal_errors += 1
            log.error(
                "closed the session with %s after an internal error",
                session.node_id,
                exc_info=group.exceptions[0],
            )
        finally:
            self._ended(session)

    def _ended(self, session: Session) -> None:
        if self.live.get(session.node_id) is not session:
            return  # replaced by a duplicate, which carries on
        del self.live[session.node_id]
        self.links.forget(session.node_id)
        self.owner.session_lost(session.node_id, unexpected=not (session.left or self.stopping))

    def _beat(self, echo: Heartbeat | None = None) -> Heartbeat:
        return Heartbeat(
            node_id=self.node_id,
            nonce=next(self._nonces),
            sent_ns=int(trio.current_time() * 1e9),
            echo_nonce=None if echo is None else echo.nonce,
            echo_sent_ns=None if echo is None else echo.sent_ns,
        )

    async def _send_heartbeats(self, session: Session) -> None:
        while True:
            await session.peer.send(self._beat())
            await trio.sleep(self._interval_s)

    async def _receive_loop(self, session: Session) -> None:
        while (message := await session.peer.receive()) is not None:
            if self.live.get(session.node_id) is not session:
                return  # replaced by a duplicate; buffered frames may arrive before the cancel
            now = trio.current_time()
            if isinstance(message, Goodbye):
                session.left = True
                self.owner.observe(PeerLeft(session.node_id, now))
                self.owner.forget(session.node_id)
                return
            if isinstance(message, Heartbeat) and message.echo_sent_ns is not None:
                rtt_s = max(0.0, now - message.echo_sent_ns / 1e9)
                self.owner.observe(RttMeasured(session.node_id, rtt_s, now))
                continue
            self.owner.observe(FrameReceived(session.node_id, now))
            await self._dispatch(session, message)

    async def _dispatch(self, session: Session, message: Message) -> None:
        if isinstance(message, Heartbeat):
            await session.peer.send(self._beat(echo=message))
            return
        if isinstance(message, LinkProbe | LinkProbeReply):  # meshnode.node.links
            if reply := self.links.receive(session.node_id, message, trio.current_time()):
                await session.peer.send(reply)
            return
        if await self.owner.route(session.node_id, message):
            return
        if isinstance(message, Error):
            # An answer to nothing we run (a late reply, a refusal of an old run): log it,
            # escaped and at a bounded rate per peer (issue 36, item 9); answering an Error
            # with an Error could ping-pong forever.
            held = self._peer_lines.allow(session.node_id, trio.current_time())
            if held is not None:
                log.warning(
                    "peer %s reported error %d: %s%s", session.node_id, message.code,
                    remote_text(message.message), f" ({held} more not logged)" if held else "",
                )  # fmt: skip
            return
        await session.peer.send(
            Error(
                code=ErrorCode.UNKNOWN_RUN,
                message=f"{type(message).__name__}: no run on node {self.node_id}",
                run_id=str(getattr(message, "run_id", "")),
                term=int(getattr(message, "term", 0)),
            )
        )


def _source(tcp: trio.SocketStream) -> str:
    """The address a connection comes from ("" when it is already gone)."""
    try:
        return str(tcp.socket.getpeername()[0])
    except OSError:
        return ""


def _peer_address(advertised: str, stream: trio.SSLStream[trio.SocketStream]) -> Address:
    """The peer's listen address; a wildcard host is replaced by the address we see."""
    address = Address.parse(advertised)
    if address.host in _WILDCARDS:
        seen = stream.transport_stream.socket.getpeername()[0]
        address = Address(seen, address.port)
    return address
