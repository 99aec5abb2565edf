"""mDNS record contents: what we advertise and which records we accept."""

from __future__ import annotations

import socket

from zeroconf import ServiceInfo

from meshnode.net.discovery import (
    SERVICE_TYPE,
    Advert,
    Discovered,
    _parse_info,
    advertised_addresses,
)

ADVERT = Advert(
    node_id="n1", mesh_id="abc", protocol_version=1, device="cpu", usable_memory=5, port=7470
)


def info(properties: dict[str, str], port: int = 7470) -> ServiceInfo:
    return ServiceInfo(
        SERVICE_TYPE,
        f"n1.{SERVICE_TYPE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=port,
        properties=properties,
    )


def test_txt_record_carries_no_secret_only_public_fields() -> None:
    assert ADVERT.properties() == {"v": "1", "mesh": "abc", "id": "n1", "dev": "cpu", "mem": "5"}


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
