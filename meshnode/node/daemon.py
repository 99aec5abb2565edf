"""The running node: it wires the listener, dialer, sessions, discovery, roles and HTTP API.

Theory of operation. One trio nursery owns everything. The listener accepts TLS
connections; the dialer (:mod:`meshnode.node.dialer`) connects to *targets* (static
``--peer`` addresses, mDNS adverts, addresses learned from peers' ``Hello``). Either way a
connection becomes a session (:mod:`meshnode.node.sessions`: handshake, Hello, heartbeats,
receive loop). Messages that are not session business go to the node's roles: a returned
token straight to the host's live pipeline, control replies to the host's coordinator,
everything else of a run to the worker.

Every observation becomes a membership event applied to the pure peer table
(:mod:`meshnode.node.membership`); the node only executes: log the changes, and close
sessions of peers the table declared dead. The process around it (signals, goodbye, the
node file) is :mod:`meshnode.node.process`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import psutil
import trio
from meshnode_protocol import (
    BATCH_FEATURE,
    DEFAULT_FEATURES,
    LINK_PROBE_FEATURE,
    PROTOCOL_VERSION,
    SPEED_QUERY_FEATURE,
    Hello,
    Message,
    PeerInfo,
)

from meshnode.engine.backend import cuda_free_memory, select_backend
from meshnode.errors import ConfigError
from meshnode.net.discovery import Advert, DiscoveryEvent, advertised_addresses, run_discovery
from meshnode.net.http import serve_api
from meshnode.net.identity import JoinToken, NodeId, NodeIdentity
from meshnode.node.config import Address, NodeConfig
from meshnode.node.dialer import DIAL_TIMEOUT_S, Dialer
from meshnode.node.host import MeshHost
from meshnode.node.links import reported_links
from meshnode.node.membership import (
    ConnectionLost,
    Event,
    Peer,
    PeerLeft,
    PeerState,
    PeerTable,
    Tick,
    apply,
    changes,
)
from meshnode.node.peer_models import PeerModels
from meshnode.node.planner import NodeCapacity
from meshnode.node.remote import is_data_reply
from meshnode.node.sessions import Sessions
from meshnode.node.worker import Worker

log = logging.getLogger("meshnode.node")

# mDNS events waiting for the daemon; adverts repeat, so dropping on overflow is harmless.
DISCOVERY_QUEUE = 64


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


@contextmanager
def _naming_flag(flag: str, address: Address) -> Iterator[None]:
    """Turn a failed bind into a one-line :class:`ConfigError` naming the flag and address."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"{flag} {address}: cannot listen there: {reason}") from exc


AppFactory = Callable[["Node"], Any]
"""Builds the node's ASGI app (``meshnode.serve.app``) once the node exists."""


class Node:
    """The daemon's state and tasks; start with ``await nursery.start(node.run)``.

    It is the sessions' :class:`~meshnode.node.sessions.SessionOwner` and the coordinator's
    :class:`~meshnode.node.coordinator.MeshView`.
    """

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
        self.token = token
        self.identity = identity
        self.node_id = identity.node_id
        self.usable_memory = usable_memory(config)
        self.table = PeerTable(config.heartbeat)
        self.listen: Address | None = None
        self.api: Address | None = None
        interval_s = config.heartbeat.interval_s
        self.sessions = Sessions(
            self.node_id,
            identity.mesh_id,
            self,
            interval_s=interval_s,
            server_context=identity.server_context(),
            quiet=lambda: _quiet(self),
            link_measured=partial(_link_measured, self),
        )
        self.dialer = Dialer(
            self.node_id,
            config.peers,
            interval_s=interval_s,
            client_context=identity.client_context(),
            run_session=self.sessions.run_session,
            connected=self.sessions.__contains__,
        )
        self._app_factory = app_factory
        self._changed = trio.Event()
        self._started_s = 0.0
        self.stopping = False  # from :meth:`stop` on, ending sessions is our own doing

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``started()`` once listening and the API is up."""
        self._started_s = trio.current_time()
        async with trio.open_nursery() as nursery:
            listen = self.config.listen
            with _naming_flag("--listen", listen):
                listeners = await trio.open_tcp_listeners(listen.port, host=listen.host or None)
            port = listeners[0].socket.getsockname()[1]
            self.listen = self.dialer.listen = Address(self._advertised_host(), port)
            self.worker = Worker(
                self.node_id,
                self.send,
                connect=self.connect,
                backend=select_backend(self.config.device, self.config.weights_dtype),
                cache_dir=self.config.cache_dir,
                nursery=nursery,
                peer_models=PeerModels.of_config(self.config),
                memory_bytes=self.usable_memory,
                links=lambda: reported_links(_alive_rtts(self), self.sessions.links),
                meet=self.dialer.meet,
                measure_when_asked=True,
            )
            nursery.start_soon(trio.serve_listeners, self.sessions.handle_inbound, listeners)
            log.info("node %s of mesh %r on %s", self.node_id, self.token.name, self.listen)
            with _naming_flag("--api", self.config.api):
                self.api = await nursery.start(serve_api, self._app_factory(self), self.config.api)
            nursery.start_soon(self._membership_clock)
            nursery.start_soon(self.dialer.run, nursery)
            if self.config.mdns:
                await self._start_discovery(nursery, port)
            if self.host is not None:
                nursery.start_soon(self.host.run, self)
            task_status.started()

    async def stop(self) -> None:
        """Leave the mesh: the host plans no more, every peer is told ``Goodbye`` (bounded
        by ``GOODBYE_TIMEOUT_S``), then the worker drops its run. Sessions that end from
        now on are no news about peers (no "lost" stage or coordinator, no replan); the
        caller cancels the rest."""
        self.stopping = True
        if self.host is not None:
            self.host.stop()
        await self.sessions.say_goodbye()
        if self.worker is not None:
            self.worker.stop("this node is stopping", keep=False)

    def _advertised_host(self) -> str:
        return advertised_addresses(self.config.listen.host, self.config.interface)[0]

    async def _start_discovery(self, nursery: trio.Nursery, port: int) -> None:
        advert = Advert(
            node_id=self.node_id,
            mesh_id=self.identity.mesh_id,
            protocol_version=PROTOCOL_VERSION,
            port=port,
        )
        addresses = advertised_addresses(self.config.listen.host, self.config.interface)
        send, receive = trio.open_memory_channel[DiscoveryEvent](DISCOVERY_QUEUE)
        await nursery.start(run_discovery, advert, addresses, self.config.interface, send)
        nursery.start_soon(self.dialer.consume_discovery, receive)

    # -- membership -----------------------------------------------------------------------

    def observe(self, event: Event) -> None:
        """Apply a membership event; log the changes and close sessions of dead peers.

        A goodbye reaches the host here, before its coordinator can see the table without
        the peer: a stage that left is then told from one that was lost."""
        old, self.table = self.table, apply(self.table, event)
        found = changes(old, self.table)
        if found:
            self._notify()
        for node_id, before, after in found:
            if after is None:
                log.info("peer %s left the mesh", node_id)
            elif before is None:
                log.info("peer %s joined (%s)", node_id, self.table.peers[node_id].address)
            else:
                log.info("peer %s is %s (was %s)", node_id, after, before)
            if after is PeerState.DEAD:
                self.sessions.close(node_id)
        if isinstance(event, PeerLeft) and self.host is not None and not self.stopping:
            self.host.peer_lost(event.node_id, left=True)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _membership_clock(self) -> None:
        # Half the heartbeat interval: state changes are seen within 1.5 intervals.
        while True:
            await trio.sleep(self.config.heartbeat.interval_s / 2)
            self.observe(Tick(trio.current_time()))

    # -- what the sessions ask of the node (``SessionOwner``) -----------------------------

    def hello(self) -> Hello:
        """This node's ``Hello``: addresses, capacity and the alive peers it knows."""
        # Both are set before the listener and the dialer start.
        assert self.listen is not None
        assert self.api is not None
        known = tuple(_peer_info(p) for p in self.table.alive())
        return Hello(
            # this node takes batched steps, answers link probes and speed queries
            features=(*DEFAULT_FEATURES, BATCH_FEATURE, LINK_PROBE_FEATURE, SPEED_QUERY_FEATURE),
            node_id=self.node_id,
            mesh_id_hash=self.identity.mesh_id,
            listen_address=str(self.listen),
            device_kind=self.config.device,
            usable_memory=self.usable_memory,
            known_peers=known,
            api_address=str(self.api),
        )

    def learn(self, address: Address, node_id: NodeId | None) -> None:
        """A peer's address worth dialing."""
        self.dialer.learn(address, node_id)

    def learn_text(self, address: str, node_id: NodeId) -> None:
        """An address a peer told us (ignored when unparsable)."""
        self.dialer.learn_text(address, node_id)

    def forget(self, node_id: NodeId) -> None:
        """A peer said goodbye: stop dialing it."""
        self.dialer.forget(node_id)

    async def route(self, peer: NodeId, message: Message) -> bool:
        """Hand ``message`` to the role it belongs to; False if none takes it."""
        if self.host is not None and is_data_reply(message):
            # A returned token (or a stage's failure of one frame): straight to the pipeline.
            if (pipeline := self.host.pipeline) is not None:
                pipeline.deliver(peer, message)
            return True
        if self.host is not None and self.host.handle(peer, message):
            return True
        return self.worker is not None and await self.worker.handle(peer, message)

    def session_lost(self, node_id: NodeId, *, unexpected: bool) -> None:
        """Tell the roles; an unexpected loss is a membership event too.

        Once this node is stopping its own goodbye ends the sessions: nothing to tell."""
        if self.stopping:
            return
        if self.worker is not None:
            # Not unexpected, and we are not stopping: the peer said goodbye.
            self.worker.peer_lost(node_id, left=not unexpected)
        if self.host is not None:
            self.host.peer_lost(node_id, left=not unexpected)
        self._notify()
        if unexpected and node_id in self.table.peers:
            self.observe(ConnectionLost(node_id, trio.current_time()))

    # -- the mesh as the coordinator sees it (``meshnode.node.coordinator.MeshView``) -------

    def live_nodes(self) -> list[NodeCapacity]:
        """This node and every alive peer we hold a session with."""
        nodes = [NodeCapacity(self.node_id, self.usable_memory, self.config.device, 0.0)]
        for node_id, peer in sorted(self.table.peers.items()):
            if peer.state is PeerState.ALIVE and node_id in self.sessions:
                rtt, link = peer.rtt_s or 0.0, self.sessions.links.rate(node_id)
                nodes.append(
                    NodeCapacity(
                        node_id, peer.usable_memory, peer.device, rtt, link_bytes_per_s=link
                    )
                )
        return nodes

    def suspects(self) -> dict[str, float]:
        """Every suspect peer we hold a session with, and since when it is suspect."""
        return {
            node_id: peer.since_s
            for node_id, peer in self.table.peers.items()
            if peer.state is PeerState.SUSPECT and node_id in self.sessions
        }

    def peer_info(self, node_id: str) -> PeerInfo:
        """Address and capacity of ``node_id`` (this node included)."""
        if node_id == self.node_id:
            return PeerInfo(
                node_id=self.node_id,
                address=str(self.listen),
                device_kind=self.config.device,
                usable_memory=self.usable_memory,
            )
        return _peer_info(self.table.peers[NodeId(node_id)])

    async def send(self, node_id: str, message: Message) -> None:
        """Send ``message`` over the session with ``node_id``.

        Raises ``KeyError`` when there is no session, transport errors when it broke.
        """
        await self.sessions.send(node_id, message)

    async def connect(self, info: PeerInfo, timeout_s: float = DIAL_TIMEOUT_S) -> None:
        """Make sure a session with ``info.node_id`` exists, dialing its address if needed.

        Stages dial their downstream neighbour this way at ``Load``: peers learn each other
        from Hello peer lists, which two nodes that joined at the same moment may have missed.
        Raises ``trio.TooSlowError`` when no session comes up within ``timeout_s``.
        """
        await self.dialer.connect(info, timeout_s, self.wait_changed)

    async def wait_changed(self) -> None:
        """Return after the next membership change (a peer joined, changed state or left)."""
        await self._changed.wait()

    def membership_event(self) -> trio.Event:
        """The event the next membership change sets (see ``MeshView.membership_event``)."""
        return self._changed

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The body of ``GET /v1/mesh/status``."""
        peers = peer_status(
            self.table, self.sessions, trio.current_time(), links=self.sessions.links.rate
        )
        body: dict[str, Any] = {"node": self._node_status(), "peers": peers}
        if self.worker is not None and (run := self.worker.status()) is not None:
            body["run"] = run
        if self.host is not None:
            body["host"] = self.host.status()
            body["stages"] = body["host"].get("stages", [])
        return body

    def _node_status(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "mesh_id": self.identity.mesh_id,
            "mesh_name": self.token.name,
            "listen": str(self.listen),
            "api": str(self.api),
            "device": self.config.device,
            "usable_memory": self.usable_memory,
            "protocol_version": PROTOCOL_VERSION,
            "uptime_s": round(trio.current_time() - self._started_s, 3),
            "refused_handshakes": self.sessions.refused_handshakes,
            "protocol_errors": self.sessions.protocol_errors,
            "internal_errors": self.sessions.internal_errors,
        }


def _quiet(node: Node) -> bool:
    """Whether no request passes through ``node`` now, as host or stage: its links may be
    probed (:mod:`meshnode.node.links`) without slowing a request's tokens."""
    pipeline = None if node.host is None else node.host.pipeline
    if pipeline is not None and pipeline.runner.live_sequences:
        return False
    return node.worker is None or not node.worker.serving()


async def _link_measured(node: Node, peer: str) -> None:
    """``node`` measured its link to ``peer``: the host's coordinator weighs it, and the
    worker tells the host that asked it of its links (:mod:`meshnode.node.links`)."""
    if node.host is not None:
        node.host.links_changed()
    if node.worker is not None:
        await node.worker.speed.link_measured()


def _alive_rtts(node: Node) -> list[tuple[str, float | None]]:
    """Every alive peer ``node`` holds a session with, and its heartbeat round trip (None:
    not known yet): the links its reports tell (:func:`meshnode.node.links.reported_links`)."""
    return [
        (node_id, peer.rtt_s)
        for node_id, peer in sorted(node.table.peers.items())
        if peer.state is PeerState.ALIVE and node_id in node.sessions
    ]


def _peer_info(peer: Peer) -> PeerInfo:
    """What ``Hello`` and ``Load`` tell of a peer: its address and capacity."""
    return PeerInfo(
        node_id=peer.node_id,
        address=peer.address,
        device_kind=peer.device,
        usable_memory=peer.usable_memory,
    )


def peer_status(
    table: PeerTable,
    connected: Container[str],
    now: float,
    *,
    links: Callable[[str], float] = lambda _: 0.0,
) -> list[dict[str, Any]]:
    """The peers of ``table`` as ``GET /v1/mesh/status`` lists them, by node id
    (``connected``: the peers this node holds a session with; ``links``: the measured rate
    of the link to a peer in bytes a second, 0 when not measured)."""
    return [
        {
            "node_id": p.node_id,
            "address": p.address,
            "device": p.device,
            "usable_memory": p.usable_memory,
            "state": str(p.state),
            "rtt_ms": None if p.rtt_s is None else round(p.rtt_s * 1e3, 3),
            # this node's link to the peer (node/links.py), null until measured
            "link_mbytes_per_s": round(links(node_id) / 1e6, 3) or None,
            "last_seen_s_ago": round(now - p.last_seen_s, 3),
            "connected": node_id in connected,
        }
        for node_id, p in sorted(table.peers.items())
    ]
