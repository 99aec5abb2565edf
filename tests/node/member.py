"""A live node in this process, and a member the test drives over a real TLS session.

:func:`start_node` runs the real daemon (:class:`~meshnode.node.daemon.Node`: sessions,
handshake, codec, worker) on loopback with mDNS off. :class:`Member` holds the mesh's token,
dials that node with mutual TLS, says ``Hello`` and then sends whatever frames the test
chooses: as the coordinator of a run it claims, prepares and loads the node
(:meth:`Member.bring_up`), or as a peer sending malformed bytes. Nothing is mocked below
the frames the test writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import trio
from meshnode_protocol import (
    CONNECTION_CLOSED,
    NEED_DATA,
    ActivationFrame,
    Claim,
    ClaimAccepted,
    Connection,
    Error,
    Hello,
    Inventory,
    InventoryReport,
    Load,
    Message,
    PeerInfo,
    Prepare,
    PrepareAccepted,
    Ready,
    Sampling,
)

from meshnode.net.address import Address
from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.node.config import HeartbeatTimeouts, NodeConfig
from meshnode.node.daemon import Node
from meshnode.node.wire import tensor_from_array
from meshnode.serve.app import create_app

#: Seconds any single exchange with the node may take. The longest is a stage's first
#: forward in a process whose kernels are not compiled yet (a fresh clone's cache): over
#: 60 s with both cores busy (issue 35, measured at load 12), so the bound is a hang's,
#: below pytest's 300 s for the whole test.
EXCHANGE_TIMEOUT_S = 240.0
#: The node's heartbeat timeouts: a member sends no heartbeats, and waiting for a Load
#: (seconds of building the stage, a minute when a loaded box compiles kernels afresh)
#: must not make the node call it dead (10 s by default) and close the session.
MEMBER_HEARTBEATS = HeartbeatTimeouts(
    interval_s=1.0, suspect_after_s=EXCHANGE_TIMEOUT_S, dead_after_s=2 * EXCHANGE_TIMEOUT_S
)
#: Bytes read from the TLS stream at once.
READ_BYTES = 1 << 16


async def start_node(
    nursery: trio.Nursery,
    token: JoinToken,
    state_dir: Path,
    cache_dir: Path,
    *,
    local_models: tuple[Path, ...] = (),
    max_memory_bytes: int | None = None,
) -> Node:
    """The real daemon on loopback (mesh and API on free ports, no mDNS), started;
    ``local_models`` and ``max_memory_bytes`` are its config's settings of those names."""
    config = NodeConfig(
        state_dir=state_dir,
        listen=Address("127.0.0.1", 0),
        api=Address("127.0.0.1", 0),
        mdns=False,
        cache_dir=cache_dir,
        local_models=local_models,
        max_memory_bytes=max_memory_bytes,
        heartbeat=MEMBER_HEARTBEATS,
    )
    identity = NodeIdentity.provision(token, state_dir)
    node = Node(config, token, identity, app_factory=lambda n: create_app(n.status))
    with trio.fail_after(EXCHANGE_TIMEOUT_S):
        await nursery.start(node.run)
    return node


class Member:
    """A member's connection to one node; see the module docstring."""

    def __init__(self, identity: NodeIdentity, stream: trio.SSLStream[trio.SocketStream]):
        self.identity = identity
        self.node_id = identity.node_id
        self.stream = stream
        self.conn = Connection()
        self.closed = False

    @classmethod
    async def dial(cls, identity: NodeIdentity, address: Address, *, hello: bool = True) -> Member:
        """Connect with mutual TLS; with ``hello``, exchange ``Hello`` frames too."""
        with trio.fail_after(EXCHANGE_TIMEOUT_S):
            stream = await trio.open_ssl_over_tcp_stream(
                address.host, address.port, ssl_context=identity.client_context()
            )
            await stream.do_handshake()
        member = cls(identity, stream)
        if hello:
            await member.send(member.hello())
            await member.receive(Hello)
        return member

    def hello(self) -> Hello:
        return Hello(
            node_id=self.node_id,
            mesh_id_hash=self.identity.mesh_id,
            listen_address="127.0.0.1:1",
            device_kind="cpu",
            usable_memory=0,
        )

    async def send(self, message: Message) -> None:
        await self.stream.send_all(self.conn.send(message))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive(self, *wanted: type[Message]) -> Message:
        """The next message of a ``wanted`` type (others, such as heartbeats, are skipped).

        Raises EOFError when the node closes the connection first.
        """
        with trio.fail_after(EXCHANGE_TIMEOUT_S):
            while True:
                message = self.conn.next_message()
                if message is NEED_DATA:
                    try:
                        data = await self.stream.receive_some(READ_BYTES)
                    except trio.BrokenResourceError:
                        data = b""
                    self.conn.receive_data(data)
                    continue
                if message is CONNECTION_CLOSED:
                    self.closed = True
                    raise EOFError("the node closed the connection")
                assert isinstance(message, Message)
                if isinstance(message, wanted):
                    return message

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def bring_up(
        self,
        node_id: str,
        *,
        run_id: str,
        term: int,
        ref: str,
        layers: tuple[int, int],
        embed: bool,
        context: int,
    ) -> Ready:
        """Claim, prepare and load ``node_id`` as the last stage of a run this member
        coordinates (upstream and downstream: this member)."""
        ready = await self.try_bring_up(
            run_id=run_id, term=term, ref=ref, layers=layers, embed=embed, context=context
        )
        assert isinstance(ready, Ready), ready
        assert ready.node_id == node_id
        return ready

    async def try_bring_up(
        self,
        *,
        run_id: str,
        term: int,
        ref: str,
        layers: tuple[int, int],
        embed: bool,
        context: int,
        kv_dtype: str = "f32",
    ) -> Ready | Error:
        """As :meth:`bring_up`, but the node's answer to ``Load`` (``Ready`` or ``Error``),
        with ``kv_dtype`` in the ``Load``."""
        await self.send(Claim(run_id=run_id, term=term, coordinator_id=self.node_id))
        await self.receive(ClaimAccepted)
        await self.send(
            Prepare(
                run_id=run_id, term=term, package_ref=ref, manifest_sha256="",
                layer_range=layers, has_embed=embed, has_head=True,
            )
        )  # fmt: skip
        await self.receive(PrepareAccepted)
        while True:
            await self.send(Inventory(run_id=run_id, term=term, package_ref=ref))
            report = await self.receive(InventoryReport)
            assert isinstance(report, InventoryReport)
            assert not report.error, report.error
            if report.ready:
                break
            await trio.sleep(0.05)
        me = PeerInfo(node_id=self.node_id, address="127.0.0.1:1")
        await self.send(
            Load(
                run_id=run_id, term=term, package_ref=ref, manifest_sha256="", upstream=me,
                downstream=me, wire_dtype="f32", context_size=context, layer_range=layers,
                has_embed=embed, has_head=True, kv_dtype=kv_dtype,
            )
        )  # fmt: skip
        answer = await self.receive(Ready, Error)
        assert isinstance(answer, Ready | Error)
        return answer


def activation(
    *,
    request_id: str,
    run_id: str,
    term: int,
    tokens: Sequence[int],
    hidden_size: int | None,
    start_pos: int = 0,
    drafts: Sequence[int] = (),
    top_logprobs: int = 0,
) -> ActivationFrame:
    """A greedy frame of ``tokens`` (and ``drafts``: a verify frame) with random activations
    ``[rows, hidden_size]``, or none for a stage that embeds (``hidden_size`` None)."""
    rows = len(tokens) + len(drafts)
    payload = None
    if hidden_size is not None:
        hidden = np.random.default_rng(rows).standard_normal((rows, hidden_size))
        payload = tensor_from_array(hidden.astype(np.float32), "f32")
    return ActivationFrame(
        request_id=request_id,
        run_id=run_id,
        term=term,
        kind="verify" if drafts else ("prefill" if start_pos == 0 else "decode"),
        start_pos=start_pos,
        tokens=tuple(tokens),
        payload=payload,
        sampling=Sampling(temperature=0.0) if start_pos == 0 else None,
        draft_tokens=tuple(drafts),
        out_rows=rows if drafts else 1,
        logprobs=top_logprobs > 0,
        top_logprobs=top_logprobs,
    )
