"""Join tokens, the token-derived mesh CA, and mutual TLS 1.3 over real loopback sockets."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from meshnode.net.identity import (
    JoinToken,
    NodeIdentity,
    PeerIdentityError,
    TokenError,
    certified_node_id,
    load_or_create_node_key,
    mesh_ca_certificate,
    node_id_of,
    write_token_file,
)
from tests.node.forgery import forged_identity


def test_token_round_trips_through_its_text_form() -> None:
    token = JoinToken.generate("lab")
    text = str(token)
    assert text.startswith("mesh1-")
    parsed = JoinToken.parse(text)
    assert parsed == token
    assert parsed.name == "lab"
    assert JoinToken.parse(text.upper().replace("MESH1-", "mesh1-")) == token


@pytest.mark.parametrize("text", ["", "mesh2-abc", "mesh1-!!!!", "mesh1-aaaa"])
def test_malformed_tokens_are_rejected(text: str) -> None:
    with pytest.raises(TokenError):
        JoinToken.parse(text)


def test_ca_key_and_mesh_id_are_deterministic_and_token_specific() -> None:
    secret = bytes(range(32))
    a, b = JoinToken(secret, "x"), JoinToken(secret, "y")
    other = JoinToken(bytes(32), "x")
    assert a.mesh_id == b.mesh_id != other.mesh_id
    assert a.ca_key().private_numbers() == b.ca_key().private_numbers()
    assert a.ca_key().private_numbers() != other.ca_key().private_numbers()
    # The advertised id never contains the secret.
    assert secret.hex()[:32] != a.mesh_id
    ca = mesh_ca_certificate(a)
    assert ca.public_key() == a.ca_key().public_key()


def test_node_key_persists_with_mode_0600(tmp_path: Path) -> None:
    key = load_or_create_node_key(tmp_path)
    again = load_or_create_node_key(tmp_path)
    assert node_id_of(key.public_key()) == node_id_of(again.public_key())
    assert stat.S_IMODE((tmp_path / "node.key").stat().st_mode) == 0o600


def test_token_file_is_private(tmp_path: Path) -> None:
    token = JoinToken.generate("m")
    path = tmp_path / "token"
    write_token_file(path, token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert JoinToken.parse(path.read_text()) == token


async def _handshake(server: NodeIdentity, client: NodeIdentity) -> tuple[object, object]:
    """Run one mutual-TLS handshake on loopback; return (server result, client result)."""
    results: dict[str, object] = {}
    listeners = await trio.open_ssl_over_tcp_listeners(0, server.server_context(), host="127.0.0.1")
    port = listeners[0].transport_listener.socket.getsockname()[1]  # type: ignore[attr-defined]

    async def accept_one() -> None:
        stream = await listeners[0].accept()
        try:
            await stream.do_handshake()
            results["server"] = certified_node_id(stream.getpeercert(binary_form=True))
            await stream.send_all(b"ok")
        except (trio.BrokenResourceError, ssl.SSLError, PeerIdentityError) as exc:
            results["server"] = exc
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_one)
        stream = await trio.open_ssl_over_tcp_stream(
            "127.0.0.1", port, ssl_context=client.client_context()
        )
        try:
            await stream.do_handshake()
            der = stream.getpeercert(binary_form=True)
            results["client"] = (certified_node_id(der), await stream.receive_some())
        except (trio.BrokenResourceError, ssl.SSLError, PeerIdentityError) as exc:
            results["client"] = exc
        finally:
            await stream.aclose()
    await listeners[0].aclose()
    return results["server"], results["client"]


async def _run_handshake(server: NodeIdentity, client: NodeIdentity) -> tuple[object, object]:
    with trio.fail_after(10):
        return await _handshake(server, client)


async def test_same_token_nodes_authenticate_each_other(tmp_path: Path) -> None:
    token = JoinToken.generate("m")
    a = NodeIdentity.provision(token, tmp_path / "a")
    b = NodeIdentity.provision(token, tmp_path / "b")
    server, client = await _run_handshake(a, b)
    assert server == b.node_id
    assert client == (a.node_id, b"ok")


async def test_foreign_token_is_refused_in_the_handshake(tmp_path: Path) -> None:
    good = NodeIdentity.provision(JoinToken.generate("m"), tmp_path / "good")
    evil = NodeIdentity.provision(JoinToken.generate("m"), tmp_path / "evil")
    server, client = await _run_handshake(good, evil)
    assert isinstance(server, trio.BrokenResourceError | ssl.SSLError)
    assert isinstance(client, trio.BrokenResourceError | ssl.SSLError)


def test_a_certificate_proves_only_its_own_keys_id(tmp_path: Path) -> None:
    """Issue 15 item 2: the CN must be node_id_of(the certificate's key)."""
    token = JoinToken.generate("m")
    honest = NodeIdentity.provision(token, tmp_path / "honest")
    assert certified_node_id(_der(honest)) == honest.node_id
    forged = forged_identity(token, tmp_path / "forger", victim=honest.node_id)
    with pytest.raises(PeerIdentityError, match="claims node id"):
        certified_node_id(_der(forged))
    with pytest.raises(PeerIdentityError, match="no certificate"):
        certified_node_id(None)


async def test_forged_node_id_passes_tls_but_is_refused_on_both_sides(tmp_path: Path) -> None:
    """The mesh CA signs anything a member asks: only the key binding catches a forgery."""
    token = JoinToken.generate("m")
    honest = NodeIdentity.provision(token, tmp_path / "honest")
    victim = NodeIdentity.provision(token, tmp_path / "victim")
    forged = forged_identity(token, tmp_path / "forger", victim=victim.node_id)
    server, _ = await _run_handshake(honest, forged)  # the forger dials
    assert isinstance(server, PeerIdentityError)
    _, client = await _run_handshake(forged, honest)  # the forger listens
    assert isinstance(client, PeerIdentityError)


def _der(identity: NodeIdentity) -> bytes:
    pem = identity.cert_path.read_bytes()
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
