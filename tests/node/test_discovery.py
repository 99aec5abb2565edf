"""mDNS record contents: what we advertise and which records we accept."""

from __future__ import annotations

import logging
import socket

import pytest
import trio
from zeroconf import ServiceInfo

# zeroconf re-exports these two at its top level without listing them in __all__.
from zeroconf._protocol.incoming import DNSIncoming
from zeroconf._protocol.outgoing import DNSOutgoing

from meshnode.net.discovery import (
    SERVICE_TYPE,
    Advert,
    Discovered,
    DiscoveryEvent,
    _parse_info,
    advertised_addresses,
    run_discovery,
)

ADVERT = Advert(node_id="n1", mesh_id="abc", protocol_version=1, port=7470)


def info(properties: dict[str, str], port: int = 7470) -> ServiceInfo:
    return ServiceInfo(
        SERVICE_TYPE,
        f"n1.{SERVICE_TYPE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=port,
        properties=properties,
    )


def test_txt_record_carries_no_secret_only_public_fields() -> None:
    # No device kind, no free memory (issue 36, item 4): members learn those from Hello.
    assert ADVERT.properties() == {"v": "1", "mesh": "abc", "id": "n1"}


def test_records_of_our_mesh_are_discovered() -> None:
    assert _parse_info(info(ADVERT.properties()), "abc") == Discovered("n1", "127.0.0.1", 7470, 1)


def test_records_of_other_meshes_or_malformed_are_ignored() -> None:
    assert _parse_info(info(ADVERT.properties()), "other-mesh") is None
    assert _parse_info(info({**ADVERT.properties(), "v": "x"}), "abc") is None
    props = ADVERT.properties()
    del props["id"]
    assert _parse_info(info(props), "abc") is None


def test_advertised_addresses_prefer_the_listen_host_then_the_interface() -> None:
    assert advertised_addresses("10.1.2.3", "127.0.0.1") == ["10.1.2.3"]
    assert advertised_addresses("0.0.0.0", "127.0.0.1") == ["127.0.0.1"]
    assert advertised_addresses("0.0.0.0", None)  # some address, never empty


# mDNS's group and port, and the flags of an authoritative response (RFC 6762).
MDNS_GROUP, MDNS_PORT, RESPONSE_FLAGS = "224.0.0.251", 5353, 0x8400


def defender_socket() -> trio.socket.SocketType:
    """A UDP socket on port 5353 in loopback's mDNS group that multicasts back to it."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    loopback = socket.inet_aton("127.0.0.1")
    group = socket.inet_aton(MDNS_GROUP) + loopback
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, loopback)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    return sock


async def defend(squatter: ServiceInfo, sock: trio.socket.SocketType) -> None:
    """Answer every question for ``squatter``'s service type with its records, by multicast.

    A host that already holds a name defends it against a probe (RFC 6762 section 8.1);
    zeroconf's own responder would answer a probe by unicast to 127.0.0.1:5353, and with
    two responders on one host that datagram reaches only one of the sockets sharing the
    port (SO_REUSEPORT picks by a hash of the addresses), on some machines always its own.
    A multicast answer reaches every socket in the group, as the defender's unicast
    answer reaches a node on another host.
    """
    answer = DNSOutgoing(RESPONSE_FLAGS)
    for record in (squatter.dns_pointer(), squatter.dns_service(), squatter.dns_text()):
        answer.add_answer_at_time(record, 0)
    packets = answer.packets()
    while True:
        data, _ = await sock.recvfrom(9000)
        query = DNSIncoming(data)
        if query.is_query() and any(q.name == squatter.type for q in query.questions):
            for packet in packets:
                await sock.sendto(packet, (MDNS_GROUP, MDNS_PORT))


async def test_a_name_conflict_renames_our_record_instead_of_stopping_the_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 15 item 6: another host answering for our instance name (here a defender on
    loopback) used to raise NonUniqueNameException out of the daemon's start."""
    advert = Advert(node_id="conflicted", mesh_id="abc", protocol_version=1, port=7471)
    squatter = ServiceInfo(
        SERVICE_TYPE,
        f"conflicted.{SERVICE_TYPE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=9,
        properties={"v": "1", "mesh": "other", "id": "squatter"},
        server="squatter.local.",
    )
    send, receive = trio.open_memory_channel[DiscoveryEvent](8)
    with defender_socket() as sock:
        await sock.bind(("", MDNS_PORT))
        try:
            with caplog.at_level(logging.WARNING), trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(defend, squatter, sock)
                    await nursery.start(run_discovery, advert, ["127.0.0.1"], "127.0.0.1", send)
                    nursery.cancel_scope.cancel()
        finally:
            receive.close()
    assert f"another host answers for conflicted.{SERVICE_TYPE}" in caplog.text
    assert f"advertising as conflicted-2.{SERVICE_TYPE}" in caplog.text
