"""Spoofed mDNS adverts cannot keep real nodes out (issue 36, item 3).

Before, 2,000 adverts carrying the mesh's (public) id filled the 256-entry table of learned
dial targets, and advertised targets were never dropped after failed dials, so a node
advertised later was never dialed. Now a target that never completed a handshake is
dropped after its failed dials, a full table evicts one that failed to make room, and each
advertised host adds new targets from a token bucket.

The dialer here is the real one dialing real loopback sockets: the spoofed addresses are
closed ports on other loopback hosts (each dial refused at once), the real node's address
a listener whose session the test stands in for.
"""

from __future__ import annotations

import socket
import ssl

import trio
from meshnode_protocol import PROTOCOL_VERSION

from meshnode.net.discovery import Discovered, DiscoveryEvent
from meshnode.net.identity import NodeId
from meshnode.net.limits import DEFAULT_LIMITS, HOST_TARGETS_BURST
from meshnode.node.config import Address
from meshnode.node.dialer import Dialer, DialTarget

SPOOFED = 2_000
#: The dial interval: backoff doubles from it, so refused dials fail fast.
INTERVAL_S = 0.01
JOIN_TIMEOUT_S = 60.0


def _closed_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return int(listener.getsockname()[1])


def _advert(node_id: str, host: str, port: int) -> Discovered:
    return Discovered(node_id, host, port, PROTOCOL_VERSION)


async def test_a_real_node_is_dialed_after_a_flood_of_spoofed_adverts() -> None:
    connected: set[NodeId] = set()
    joined = trio.Event()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    real = Address("127.0.0.1", listeners[0].socket.getsockname()[1])

    async def run_session(stream: trio.SSLStream[trio.SocketStream], target: DialTarget) -> bool:
        # Stands in for TLS and Hello: only the real node's listener answers.
        await stream.transport_stream.aclose()
        if target.address != real or target.node_id is None:
            return False
        connected.add(target.node_id)
        joined.set()
        return True

    dialer = Dialer(
        NodeId("self"), (), interval_s=INTERVAL_S, client_context=ssl.create_default_context(),
        run_session=run_session, connected=lambda n: n in connected,
    )  # fmt: skip
    send, receive = trio.open_memory_channel[DiscoveryEvent](SPOOFED + 1)
    port = _closed_port()
    for i in range(SPOOFED):  # each from its own loopback host, as a spoofer may claim
        send.send_nowait(_advert(f"spoof{i}", f"127.1.{i // 250}.{i % 250 + 1}", port))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(dialer.run, nursery)
        nursery.start_soon(dialer.consume_discovery, receive)
        nursery.start_soon(trio.serve_listeners, _drop, listeners)
        with trio.fail_after(JOIN_TIMEOUT_S):
            # The node appears once the table is full of spoofed targets that were dialed.
            while not _full_and_dialed(dialer):  # noqa: ASYNC110  (no event per dial)
                await trio.sleep(INTERVAL_S)
            await send.send(_advert("real", real.host, real.port))
            await joined.wait()
        nursery.cancel_scope.cancel()
    assert NodeId("real") in connected


def _full_and_dialed(dialer: Dialer) -> bool:
    full = len(dialer.targets) >= DEFAULT_LIMITS.max_learned_targets
    return full and any(t.failures for t in dialer.targets.values())


async def test_one_host_adds_a_handful_of_targets_however_many_it_advertises() -> None:
    dialer = Dialer(
        NodeId("self"), (), interval_s=1.0, client_context=ssl.create_default_context(),
        run_session=_refuse, connected=lambda n: False,
    )  # fmt: skip
    send, receive = trio.open_memory_channel[DiscoveryEvent](SPOOFED)
    for i in range(SPOOFED):
        send.send_nowait(_advert(f"spoof{i}", "10.0.0.66", 1_000 + i))
    send.close()
    await dialer.consume_discovery(receive)  # all in well under a second of the clock
    assert HOST_TARGETS_BURST <= len(dialer.targets) <= HOST_TARGETS_BURST + 2


async def _refuse(stream: trio.SSLStream[trio.SocketStream], target: DialTarget) -> bool:
    return False


async def _drop(stream: trio.SocketStream) -> None:
    await stream.aclose()
