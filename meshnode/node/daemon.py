"""The running node: mesh listener, dialer, peer sessions, heartbeats, discovery, HTTP API.

Theory of operation. One trio nursery owns everything. The listener accepts TLS
connections; the dialer connects to *targets* (static ``--peer`` addresses, mDNS adverts,
addresses learned from peers' ``Hello``), retrying with capped backoff. Either way a
connection becomes a *session*: TLS handshake (mutual, mesh CA; failures are counted as
refused), then ``Hello`` both ways (the dialer's first; the listener answers once it has
admitted the dialer, so its peer list is current), then a heartbeat sender and a receive
loop until EOF,
goodbye, a protocol error or a timeout. Between two nodes one session survives: the one
dialed by the smaller node id, so simultaneous dials from both sides settle the same way on
both sides.

Every observation becomes a membership event applied to the pure peer table
(:mod:`meshnode.node.membership`); the daemon only executes: log the changes, and close
sessions of peers the table declared dead. SIGINT/SIGTERM send ``Goodbye`` on every session,
then cancel everything, which unregisters the mDNS record.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import trio
from meshnode_protocol import (
    PROTOCOL_VERSION,
    Connection,
    Error,
    ErrorCode,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    PeerInfo,
    RemoteProtocolError,
    Role,
)

from meshnode.engine.backend import cuda_free_memory, limit_cpu_threads, select_backend
from meshnode.net.discovery import (
    Advert,
    Discovered,
    DiscoveryEvent,
    Vanished,
    advertised_addresses,
    run_discovery,
)
from meshnode.net.http import serve_api
from meshnode.net.identity import (
    JoinToken,
    NodeId,
    NodeIdentity,
    PeerIdentityError,
    TokenError,
    certified_node_id,
    write_token_file,
)
from meshnode.net.stream import TRANSPORT_ERRORS, PeerStream
from meshnode.node.config import Address, ConfigError, NodeConfig
from meshnode.node.host import MeshHost
from meshnode.node.membership import (
    ConnectionLost,
    Event,
    FrameReceived,
    PeerHello,
    PeerLeft,
    PeerState,
    PeerTable,
    RttMeasured,
    Tick,
    apply,
    changes,
)
from meshnode.node.planner import NodeCapacity
from meshnode.node.remote import is_data_reply
from meshnode.node.worker import Worker

log = logging.getLogger("meshnode.node")

# TLS handshake plus the Hello exchange; a peer slower than this on a LAN is not healthy.
HANDSHAKE_TIMEOUT_S = 5.0
DIAL_TIMEOUT_S = 5.0
# Redial backoff doubles from the heartbeat interval up to this cap.
MAX_DIAL_BACKOFF_S = 5.0
# Learned (non-static) targets that keep failing are dropped; static ones never are.
MAX_LEARNED_FAILURES = 5
# mDNS events waiting for the daemon; adverts repeat, so dropping on overflow is harmless.
DISCOVERY_QUEUE = 64
GOODBYE_TIMEOUT_S = 2.0
NODE_FILE = "node.json"
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


# ---- the node file: how `meshnode status` and tests find a running daemon --------------


@dataclass(frozen=True, slots=True)
class RunningNode:
    """Contents of ``<state-dir>/node.json`` while a daemon runs."""

    node_id: str
    pid: int
    listen: Address
    api: Address


def write_node_file(state_dir: Path, node: RunningNode) -> None:
    """Atomically write ``node.json`` (actual ports, so port 0 works in tests)."""
    body = {"node_id": node.node_id, "pid": node.pid, "listen": str(node.listen)}
    body["api"] = str(node.api)
    tmp = state_dir / (NODE_FILE + ".tmp")
    tmp.write_text(json.dumps(body) + "\n")
    tmp.replace(state_dir / NODE_FILE)


def read_node_file(state_dir: Path) -> RunningNode | None:
    """The running daemon's addresses, or ``None`` when none wrote its file."""
    try:
        body = json.loads((state_dir / NODE_FILE).read_text())
        return RunningNode(
            node_id=str(body["node_id"]),
            pid=int(body["pid"]),
            listen=Address.parse(body["listen"]),
            api=Address.parse(body["api"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---- sessions and dial targets -----------------------------------------------------------


@dataclass(eq=False)
class DialTarget:
    """An address worth dialing, and what we learned from dialing it."""

    address: Address
    static: bool
    node_id: NodeId | None = None
    failures: int = 0
    next_attempt_s: float = 0.0
    in_flight: bool = False


@dataclass(eq=False)
class Session:
    """One authenticated connection to a peer, after the Hello exchange."""

    node_id: NodeId
    peer: PeerStream
    dialer_id: NodeId  # who dialed: decides which of two duplicate sessions survives
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    left: bool = False


def usable_memory(config: NodeConfig) -> int:
    """Memory offered to the mesh: what is available now, capped by ``--max-memory``.

    A ``--device cuda`` node holds its layers and KV caches in device memory, so it offers
    the device's free memory (host RAM if no CUDA device is usable after all).
    """
    available = cuda_free_memory() if config.device == "cuda" else None
    if available is None:
        available = int(psutil.virtual_memory().available)
    cap = config.max_memory_bytes
    return available if cap is None else min(cap, available)


AppFactory = Callable[["Node"], Any]
"""Builds the node's ASGI app (``meshnode.serve.app``) once the node exists."""


class Node:
    """The daemon's state and tasks; start with ``await nursery.start(node.run)``."""

    def __init__(
        self,
        config: NodeConfig,
        token: JoinToken,
        identity: NodeIdentity,
        *,
        app_factory: AppFactory,
        host: MeshHost | None = None,
    ) -> None:
        self.config = config
        self.host = host
        self.worker: Worker | None = None
        self._app_factory = app_factory
        self._changed = trio.Event()
        self.token = token
        self.identity = identity
        self.node_id = identity.node_id
        self.usable_memory = usable_memory(config)
        self.table = PeerTable(config.heartbeat)
        self.sessions: dict[NodeId, Session] = {}
        self.targets: dict[Address, DialTarget] = {
            a: DialTarget(a, static=True) for a in config.peers
        }
        self.refused_handshakes = 0
        self.protocol_errors = 0
        self.internal_errors = 0
        self.listen: Address | None = None
        self.api: Address | None = None
        self._started_s = 0.0
        self._stopping = False  # after goodbye: closing sessions is not news about peers
        self._nonces = itertools.count(1)
        self._wake_dialer = trio.Event()
        self._server_ctx = identity.server_context()
        self._client_ctx = identity.client_context()

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``started()`` once listening, API up and node.json written."""
        self._started_s = trio.current_time()
        async with trio.open_nursery() as nursery:
            listen = self.config.listen
            listeners = await trio.open_tcp_listeners(listen.port, host=listen.host or None)
            port = listeners[0].socket.getsockname()[1]
            self.listen = Address(self._advertised_host(), port)
            self.worker = Worker(
                self.node_id,
                self.send,
                connect=self.connect,
                backend=select_backend(self.config.device, self.config.weights_dtype),
                cache_dir=self.config.cache_dir,
                nursery=nursery,
                accept_url_refs=self.config.allow_url_models,
            )
            nursery.start_soon(trio.serve_listeners, self._handle_inbound, listeners)
            log.info("node %s of mesh %r on %s", self.node_id, self.token.name, self.listen)
            self.api = await nursery.start(serve_api, self._app_factory(self), self.config.api)
            nursery.start_soon(self._membership_clock)
            nursery.start_soon(self._dialer, nursery)
            if self.config.mdns:
                await self._start_discovery(nursery, port)
            write_node_file(
                self.config.state_dir, RunningNode(self.node_id, os.getpid(), self.listen, self.api)
            )
            if self.host is not None:
                nursery.start_soon(self.host.run, self)
            task_status.started()

    async def say_goodbye(self) -> None:
        """Tell every peer we are leaving, in parallel, bounded by ``GOODBYE_TIMEOUT_S``."""
        goodbye = Goodbye(node_id=self.node_id, reason="shutdown")
        self._stopping = True

        async def send(session: Session) -> None:
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await session.peer.send(goodbye)

        with trio.move_on_after(GOODBYE_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for session in list(self.sessions.values()):
                    nursery.start_soon(send, session)

    def _advertised_host(self) -> str:
        return advertised_addresses(self.config.listen.host, self.config.interface)[0]

    # -- membership -----------------------------------------------------------------------

    def _apply(self, event: Event) -> None:
        old, self.table = self.table, apply(self.table, event)
        found = changes(old, self.table)
        if found:
            self._changed.set()
            self._changed = trio.Event()
        for node_id, before, after in found:
            if after is None:
                log.info("peer %s left the mesh", node_id)
            elif before is None:
                log.info("peer %s joined (%s)", node_id, self.table.peers[node_id].address)
            else:
                log.info("peer %s is %s (was %s)", node_id, after, before)
            if after is PeerState.DEAD and node_id in self.sessions:
                self.sessions[node_id].scope.cancel()

    async def _membership_clock(self) -> None:
        # Half the heartbeat interval: state changes are seen within 1.5 intervals.
        while True:
            await trio.sleep(self.config.heartbeat.interval_s / 2)
            self._apply(Tick(trio.current_time()))

    # -- discovery ------------------------------------------------------------------------

    async def _start_discovery(self, nursery: trio.Nursery, port: int) -> None:
        advert = Advert(
            node_id=self.node_id,
            mesh_id=self.identity.mesh_id,
            protocol_version=PROTOCOL_VERSION,
            device=self.config.device,
            usable_memory=self.usable_memory,
            port=port,
        )
        addresses = advertised_addresses(self.config.listen.host, self.config.interface)
        send, receive = trio.open_memory_channel[DiscoveryEvent](DISCOVERY_QUEUE)
        await nursery.start(run_discovery, advert, addresses, self.config.interface, send)
        nursery.start_soon(self._consume_discovery, receive)

    async def _consume_discovery(self, receive: trio.MemoryReceiveChannel[DiscoveryEvent]) -> None:
        async for event in receive:
            if isinstance(event, Discovered):
                if event.protocol_version != PROTOCOL_VERSION:
                    log.warning("ignoring %s: protocol %d", event.node_id, event.protocol_version)
                    continue
                self._learn(Address(event.host, event.port), NodeId(event.node_id))
            elif isinstance(event, Vanished):
                self._forget(NodeId(event.node_id))

    def _learn(self, address: Address, node_id: NodeId | None) -> None:
        if node_id == self.node_id or address == self.listen:
            return
        target = self.targets.get(address)
        if target is None:
            self.targets[address] = DialTarget(address, static=False, node_id=node_id)
            self._wake_dialer.set()
        elif target.node_id is None:
            target.node_id = node_id

    def _forget(self, node_id: NodeId) -> None:
        for address, target in list(self.targets.items()):
            if target.node_id == node_id and not target.static and not target.in_flight:
                del self.targets[address]

    # -- dialing --------------------------------------------------------------------------

    async def _dialer(self, nursery: trio.Nursery) -> None:
        while True:
            now = trio.current_time()
            for target in list(self.targets.values()):
                if self._should_dial(target, now):
                    target.in_flight = True
                    nursery.start_soon(self._dial, target)
            self._wake_dialer = trio.Event()
            with trio.move_on_after(self.config.heartbeat.interval_s):
                await self._wake_dialer.wait()

    def _should_dial(self, target: DialTarget, now: float) -> bool:
        if target.in_flight or now < target.next_attempt_s:
            return False
        if target.node_id is not None and (
            target.node_id == self.node_id or target.node_id in self.sessions
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

    def _after_dial(self, target: DialTarget, ok: bool) -> None:
        interval = self.config.heartbeat.interval_s
        target.failures = 0 if ok else target.failures + 1
        backoff = min(MAX_DIAL_BACKOFF_S, interval * 2 ** min(target.failures, 10))
        target.next_attempt_s = trio.current_time() + backoff
        if not target.static and target.failures >= MAX_LEARNED_FAILURES:
            self.targets.pop(target.address, None)

    # -- sessions -------------------------------------------------------------------------

    async def _handle_inbound(self, tcp: trio.SocketStream) -> None:
        stream = trio.SSLStream(tcp, self._server_ctx, server_side=True)
        with contextlib.suppress(trio.TooSlowError, *TRANSPORT_ERRORS):
            await self._run_session(stream, None)

    async def _handshake(self, stream: trio.SSLStream[trio.SocketStream]) -> NodeId | None:
        """TLS handshake; the peer's certified node id, or ``None`` (counted as refused)."""
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                await stream.do_handshake()
            return certified_node_id(stream.getpeercert(binary_form=True))
        except (trio.TooSlowError, PeerIdentityError, *TRANSPORT_ERRORS) as exc:
            self.refused_handshakes += 1
            log.warning("refused a connection: TLS handshake failed (%r)", exc)
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await trio.aclose_forcefully(stream)
            return None

    async def _run_session(
        self, stream: trio.SSLStream[trio.SocketStream], target: DialTarget | None
    ) -> bool:
        """Handshake, Hello, then serve the session; ``True`` if it got past Hello."""
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
                    await peer.send(self._hello())
                hello = await peer.receive()
            session = self._admit(peer, hello, cert_id, stream, target)
            if session is None:
                return hello is not None
            with session.scope:
                await self._serve_session(session, send_hello=not dialer)
            return True
        except RemoteProtocolError as exc:
            self.protocol_errors += 1
            log.warning("closed a connection from %s: %s", cert_id, exc)
            return False
        finally:
            await peer.aclose()

    def _hello(self) -> Hello:
        assert self.listen is not None
        assert self.api is not None
        known = tuple(
            PeerInfo(
                node_id=p.node_id,
                address=p.address,
                device_kind=p.device,
                usable_memory=p.usable_memory,
            )
            for p in self.table.alive()
        )
        return Hello(
            node_id=self.node_id,
            mesh_id_hash=self.identity.mesh_id,
            listen_address=str(self.listen),
            device_kind=self.config.device,
            usable_memory=self.usable_memory,
            known_peers=known,
            api_address=str(self.api),
        )

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
        if hello.node_id != cert_id or hello.mesh_id_hash != self.identity.mesh_id:
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
        session = Session(node_id, peer, dialer)
        existing = self.sessions.get(node_id)
        if existing is not None:
            preferred = min(self.node_id, node_id)
            if existing.dialer_id == preferred or session.dialer_id != preferred:
                return None
            existing.scope.cancel()
        self.sessions[node_id] = session
        address = self._peer_address(hello.listen_address, stream)
        self._apply(
            PeerHello(
                node_id, str(address), hello.device_kind, hello.usable_memory, trio.current_time()
            )
        )
        self._learn(address, node_id)
        for info in hello.known_peers:
            with contextlib.suppress(ConfigError):
                self._learn(Address.parse(info.address), NodeId(info.node_id))
        return session

    @staticmethod
    def _peer_address(advertised: str, stream: trio.SSLStream[trio.SocketStream]) -> Address:
        """The peer's listen address; a wildcard host is replaced by the address we see."""
        address = Address.parse(advertised)
        if address.host in _WILDCARDS:
            seen = stream.transport_stream.socket.getpeername()[0]
            address = Address(seen, address.port)
        return address

    async def _serve_session(self, session: Session, *, send_hello: bool) -> None:
        # The nursery wraps whatever ends the session in an ExceptionGroup; both kinds
        # end only this session.
        try:
            if send_hello:
                with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                    await session.peer.send(self._hello())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_heartbeats, session)
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
            if self.sessions.get(session.node_id) is session:
                del self.sessions[session.node_id]
                self._session_lost(session.node_id)
                lost = not (session.left or self._stopping)
                if lost and session.node_id in self.table.peers:
                    self._apply(ConnectionLost(session.node_id, trio.current_time()))

    async def _send_heartbeats(self, session: Session) -> None:
        while True:
            sent_ns = int(trio.current_time() * 1e9)
            beat = Heartbeat(node_id=self.node_id, nonce=next(self._nonces), sent_ns=sent_ns)
            await session.peer.send(beat)
            await trio.sleep(self.config.heartbeat.interval_s)

    async def _receive_loop(self, session: Session) -> None:
        while (message := await session.peer.receive()) is not None:
            if self.sessions.get(session.node_id) is not session:
                return  # replaced by a duplicate; buffered frames may arrive before the cancel
            now = trio.current_time()
            if isinstance(message, Goodbye):
                session.left = True
                self._apply(PeerLeft(session.node_id, now))
                self._forget(session.node_id)
                return
            if isinstance(message, Heartbeat) and message.echo_sent_ns is not None:
                rtt_s = max(0.0, now - message.echo_sent_ns / 1e9)
                self._apply(RttMeasured(session.node_id, rtt_s, now))
                continue
            self._apply(FrameReceived(session.node_id, now))
            await self._dispatch(session, message)

    async def _dispatch(self, session: Session, message: Message) -> None:
        if isinstance(message, Heartbeat):
            await session.peer.send(
                Heartbeat(
                    node_id=self.node_id,
                    nonce=next(self._nonces),
                    sent_ns=int(trio.current_time() * 1e9),
                    echo_nonce=message.nonce,
                    echo_sent_ns=message.sent_ns,
                )
            )
            return
        peer = session.node_id
        if self.host is not None and is_data_reply(message):
            # A returned token (or a stage's failure of one frame): straight to the pipeline.
            if (pipeline := self.host.pipeline) is not None:
                pipeline.deliver(peer, message)
            return
        if self.host is not None and self.host.handle(peer, message):
            return
        if self.worker is not None and await self.worker.handle(peer, message):
            return
        if isinstance(message, Error):
            # An answer to nothing we run (a late reply, a refusal of an old run): log it;
            # answering an Error with an Error could ping-pong forever.
            log.warning("peer %s reported error %d: %s", peer, message.code, message.message)
            return
        await session.peer.send(
            Error(
                code=ErrorCode.UNKNOWN_RUN,
                message=f"{type(message).__name__}: no run on node {self.node_id}",
                run_id=str(getattr(message, "run_id", "")),
                term=int(getattr(message, "term", 0)),
            )
        )

    def _session_lost(self, node_id: NodeId) -> None:
        if self.worker is not None:
            self.worker.peer_lost(node_id)
        if self.host is not None:
            self.host.peer_lost(node_id)
        self._changed.set()
        self._changed = trio.Event()

    # -- the mesh as the coordinator sees it (``meshnode.node.coordinator.MeshView``) -------

    def live_nodes(self) -> list[NodeCapacity]:
        """This node and every alive peer we hold a session with."""
        nodes = [NodeCapacity(self.node_id, self.usable_memory, self.config.device, 0.0)]
        for node_id, peer in sorted(self.table.peers.items()):
            if peer.state is PeerState.ALIVE and node_id in self.sessions:
                rtt = peer.rtt_s or 0.0
                nodes.append(NodeCapacity(node_id, peer.usable_memory, peer.device, rtt))
        return nodes

    def peer_info(self, node_id: str) -> PeerInfo:
        """Address and capacity of ``node_id`` (this node included)."""
        if node_id == self.node_id:
            return PeerInfo(
                node_id=self.node_id,
                address=str(self.listen),
                device_kind=self.config.device,
                usable_memory=self.usable_memory,
            )
        peer = self.table.peers[NodeId(node_id)]
        return PeerInfo(
            node_id=node_id,
            address=peer.address,
            device_kind=peer.device,
            usable_memory=peer.usable_memory,
        )

    async def send(self, node_id: str, message: Message) -> None:
        """Send ``message`` over the session with ``node_id``.

        Raises ``KeyError`` when there is no session, transport errors when it broke.
        """
        await self.sessions[NodeId(node_id)].peer.send(message)

    async def connect(self, info: PeerInfo, timeout_s: float = DIAL_TIMEOUT_S) -> None:
        """Make sure a session with ``info.node_id`` exists, dialing its address if needed.

        Stages dial their downstream neighbour this way at ``Load``: peers learn each other
        from Hello peer lists, which two nodes that joined at the same moment may have missed.
        Raises ``trio.TooSlowError`` when no session comes up within ``timeout_s``.
        """
        node_id = NodeId(info.node_id)
        with trio.fail_after(timeout_s):
            while node_id not in self.sessions:
                with contextlib.suppress(ConfigError):
                    self._learn(Address.parse(info.address), node_id)
                target = next((t for t in self.targets.values() if t.node_id == node_id), None)
                if target is not None and not target.in_flight:
                    target.next_attempt_s = 0.0
                    self._wake_dialer.set()
                with trio.move_on_after(0.1):
                    await self.wait_changed()

    async def wait_changed(self) -> None:
        """Return after the next membership change (a peer joined, changed state or left)."""
        await self._changed.wait()

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The body of ``GET /v1/mesh/status``."""
        now = trio.current_time()
        peers = [
            {
                "node_id": p.node_id,
                "address": p.address,
                "device": p.device,
                "usable_memory": p.usable_memory,
                "state": str(p.state),
                "rtt_ms": None if p.rtt_s is None else round(p.rtt_s * 1e3, 3),
                "last_seen_s_ago": round(now - p.last_seen_s, 3),
                "connected": node_id in self.sessions,
            }
            for node_id, p in sorted(self.table.peers.items())
        ]
        node = {
            "node_id": self.node_id,
            "mesh_id": self.identity.mesh_id,
            "mesh_name": self.token.name,
            "listen": str(self.listen),
            "api": str(self.api),
            "device": self.config.device,
            "usable_memory": self.usable_memory,
            "protocol_version": PROTOCOL_VERSION,
            "uptime_s": round(now - self._started_s, 3),
            "refused_handshakes": self.refused_handshakes,
            "protocol_errors": self.protocol_errors,
            "internal_errors": self.internal_errors,
        }
        body: dict[str, Any] = {"node": node, "peers": peers}
        if self.worker is not None and (run := self.worker.status()) is not None:
            body["run"] = run
        if self.host is not None:
            body["host"] = self.host.status()
            body["stages"] = body["host"].get("stages", [])
        return body


# ---- entry point -------------------------------------------------------------------------


NodeBuilder = Callable[[NodeConfig, JoinToken, NodeIdentity], Awaitable[Node]]
"""Builds the node to run (the serving layer adds its API and, with ``--model``, the host)."""


async def serve_until_signalled(
    build: NodeBuilder, config: NodeConfig, token: JoinToken, identity: NodeIdentity
) -> None:
    """Build the node, run it until SIGINT or SIGTERM, then say goodbye and stop."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        node = await build(config, token, identity)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            async for signum in signals:
                log.info(
                    "%s: saying goodbye to %d peers",
                    signal.Signals(signum).name,
                    len(node.sessions),
                )
                break
            await node.say_goodbye()
            nursery.cancel_scope.cancel()


def _token(config: NodeConfig) -> JoinToken:
    """The mesh token; a node given none creates a new mesh and keeps its token 0600."""
    text = config.resolve_token()
    if text is None:
        token = JoinToken.generate(socket.gethostname())
        write_token_file(config.own_token_file, token)
        log.warning(
            "no join token given: created mesh %r; other machines join it with "
            "`meshnode join --token-file FILE` where FILE holds the contents of %s",
            token.name,
            config.own_token_file,
        )
        return token
    try:
        return JoinToken.parse(text)
    except TokenError as exc:
        raise ConfigError(str(exc)) from exc


def run(config: NodeConfig, build: NodeBuilder) -> int:
    """``meshnode join``: provision identity, run the node until interrupted; exit status."""
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = _token(config)
    limit = limit_cpu_threads(config.threads)  # held while the node runs
    identity = NodeIdentity.provision(token, config.state_dir)
    try:
        trio.run(serve_until_signalled, build, config, token, identity)
    finally:
        running = read_node_file(config.state_dir)
        if running is not None and running.pid == os.getpid():
            (config.state_dir / NODE_FILE).unlink(missing_ok=True)
    del limit
    log.info("node %s stopped", identity.node_id)
    return 0
