"""The transport of protocol/README.md §1, checked from both sides: its test vectors
against the spec-only peer (:mod:`tests.protocol.minimal_peer`) and against meshnode's
own identity code, and that peer joining a real node on loopback (TLS, Hello both ways,
a heartbeat each way, Goodbye)."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import trio
from cryptography.hazmat.primitives.asymmetric import ec

from meshnode.net.identity import JoinToken, NodeId, mesh_ca_certificate, node_id_of
from meshnode.node.membership import Event, RttMeasured
from tests.node.member import start_node
from tests.protocol import minimal_peer

VECTORS = json.loads(
    (Path(__file__).parents[2] / "protocol" / "transport-vectors.json").read_text()
)


def _node_key() -> ec.EllipticCurvePrivateKey:
    return ec.derive_private_key(int(VECTORS["node_private_scalar_hex"], 16), ec.SECP256R1())


def test_the_spec_only_peer_derives_the_vectors() -> None:
    secret = minimal_peer.token_secret(VECTORS["token"])
    assert secret.hex() == VECTORS["secret_hex"]
    assert minimal_peer.mesh_id(secret) == VECTORS["mesh_id"]
    ca = minimal_peer.ca_key(secret)
    assert format(ca.private_numbers().private_value, "064x") == VECTORS["ca_private_scalar_hex"]
    cert = minimal_peer.ca_certificate(secret)
    ca_public = cert.public_key()
    assert isinstance(ca_public, ec.EllipticCurvePublicKey)
    assert hashlib.sha256(minimal_peer.spki(ca_public)).hexdigest() == VECTORS["ca_spki_sha256"]
    assert cert.subject.rfc4514_string() == "CN=" + VECTORS["ca_subject_cn"]
    assert cert.serial_number == VECTORS["ca_serial"]
    public = _node_key().public_key()
    assert minimal_peer.spki(public).hex() == VECTORS["node_spki_der_hex"]
    assert minimal_peer.node_id(public) == VECTORS["node_id"]


def test_meshnode_derives_the_vectors() -> None:
    token = JoinToken.parse(VECTORS["token"])
    assert (token.secret.hex(), token.name) == (VECTORS["secret_hex"], VECTORS["mesh_name"])
    assert token.mesh_id == VECTORS["mesh_id"]
    cert = mesh_ca_certificate(token)
    assert cert.subject.rfc4514_string() == "CN=" + VECTORS["ca_subject_cn"]
    assert cert.serial_number == VECTORS["ca_serial"]
    ca_public = cert.public_key()
    assert isinstance(ca_public, ec.EllipticCurvePublicKey)
    assert hashlib.sha256(minimal_peer.spki(ca_public)).hexdigest() == VECTORS["ca_spki_sha256"]
    assert node_id_of(_node_key().public_key()) == VECTORS["node_id"]


async def test_a_peer_written_from_the_spec_joins_a_real_node(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    token = JoinToken.generate("spec-peer")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    assert node.listen is not None
    measured = trio.Event()  # the node took an RTT from the peer's echo of its heartbeat
    observe = node.observe

    def observed(event: Event) -> None:
        observe(event)
        if isinstance(event, RttMeasured):
            measured.set()

    node.observe = observed  # type: ignore[method-assign]
    seen: dict[str, bool] = {}

    def check(session: minimal_peer.Session) -> None:
        # from the peer's thread, before its Goodbye: the node holds the session
        async def look() -> None:
            with trio.fail_after(minimal_peer.TIMEOUT_S):
                await measured.wait()
            seen["live"] = NodeId(session.our_id) in node.sessions.live
            seen["rtt"] = node.table.peers[NodeId(session.our_id)].rtt_s is not None

        trio.from_thread.run(look)

    session = await trio.to_thread.run_sync(
        minimal_peer.join, str(token), node.listen.host, node.listen.port, check
    )
    assert session.node_cert_id == node.node_id
    assert session.node_hello["node_id"] == node.node_id
    assert session.node_hello["mesh_id_hash"] == token.mesh_id
    assert session.rtt_s >= 0
    assert session.answered >= 1
    assert seen == {"live": True, "rtt": True}
    assert node.sessions.protocol_errors == 0
    assert node.sessions.refused_handshakes == 0


def test_the_peer_imports_nothing_of_meshnode() -> None:
    tree = ast.parse(Path(minimal_peer.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {n for n in names if n.split(".")[0] in ("meshnode", "meshnode_protocol", "tests")}
    assert {n.split(".")[0] for n in names} <= {
        "__future__", "base64", "cbor2", "collections", "cryptography", "dataclasses",
        "datetime", "hashlib", "pathlib", "socket", "ssl", "struct", "tempfile", "time", "typing",
    }  # fmt: skip
