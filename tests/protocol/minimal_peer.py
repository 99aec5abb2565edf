"""A second implementation of the mesh transport, written from protocol/README.md alone.

Nothing here imports meshnode or meshnode_protocol: only ``cryptography``, ``cbor2`` and
the standard library (``ssl``, ``socket``), as an implementer in another codebase would.
It derives the mesh CA from a join token (§1.1), signs its own node certificate (§1.2),
dials a node with mutual TLS 1.3 (§1.3), exchanges ``Hello`` (§1.4) and heartbeats
(§1.6) in blocking socket code, and says ``Goodbye``. tests/protocol/test_transport.py
runs it against a real node.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import socket
import ssl
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
HELLO, GOODBYE, HEARTBEAT, ERROR = 1, 2, 3, 4
TIMEOUT_S = 60.0


def token_secret(token: str) -> bytes:
    """§1.1: ``mesh1-`` + lowercase base32 (no padding) of 32 secret bytes + the name."""
    body = token.strip().removeprefix("mesh1-").upper()
    return base64.b32decode(body + "=" * (-len(body) % 8))[:32]


def hkdf(secret: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def mesh_id(secret: bytes) -> str:
    return hkdf(secret, b"meshnode/v1/mesh-id", 16).hex()


def ca_key(secret: bytes) -> ec.EllipticCurvePrivateKey:
    scalar = int.from_bytes(hkdf(secret, b"meshnode/v1/ca-key", 48), "big")
    return ec.derive_private_key(scalar % (P256_ORDER - 1) + 1, ec.SECP256R1())


def spki(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def node_id(key: ec.EllipticCurvePublicKey) -> str:
    """§1.2: the first 16 hex digits of SHA-256 over the key's DER SubjectPublicKeyInfo."""
    return hashlib.sha256(spki(key)).hexdigest()[:16]


def ca_name(secret: bytes) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshnode mesh {mesh_id(secret)}")])


def ca_certificate(secret: bytes) -> x509.Certificate:
    """§1.1: the self-signed mesh CA certificate."""
    key, name = ca_key(secret), ca_name(secret)
    usage = dict.fromkeys(
        ["digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
         "key_agreement", "encipher_only", "decipher_only"], False,
    )  # fmt: skip
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(int(mesh_id(secret), 16) >> 1 or 1)
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(key_cert_sign=True, crl_sign=True, **usage), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def node_certificate(secret: bytes, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    """§1.2: this node's certificate, issued by the mesh CA, CN = its node id."""
    now = datetime.datetime.now(datetime.UTC)
    public, ca = key.public_key(), ca_key(secret)
    eku = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id(public))]))
        .issuer_name(ca_name(secret))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(eku), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False
        )
        .sign(ca, hashes.SHA256())
    )


def client_context(secret: bytes, key: ec.EllipticCurvePrivateKey, folder: Path) -> ssl.SSLContext:
    """§1.3: TLS 1.3 only, the mesh CA as the only trust anchor, our certificate sent, no
    host name check (no SNI, no ALPN)."""
    pem = serialization.Encoding.PEM
    (folder / "ca.pem").write_bytes(ca_certificate(secret).public_bytes(pem))
    (folder / "node.pem").write_bytes(node_certificate(secret, key).public_bytes(pem))
    (folder / "node.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(folder / "ca.pem"))
    ctx.load_cert_chain(str(folder / "node.pem"), str(folder / "node.key"))
    return ctx


def frame(tag: int, fields: dict[str, Any]) -> bytes:
    """§2: u32 big-endian length, then a CBOR map {0: type, 1: version 1, fields...}."""
    keys: dict[int | str, Any] = {0: tag, 1: 1}
    header = cbor2.dumps(keys | fields)
    return struct.pack(">I", len(header)) + header


class Frames:
    """Frames read off a blocking socket (header only: these messages have no payload)."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock, self.buffer = sock, b""

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("the node closed the connection")
            self.buffer += data
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def next(self) -> dict[Any, Any]:
        (length,) = struct.unpack(">I", self._take(4))
        header: dict[Any, Any] = cbor2.loads(self._take(length))
        return header


@dataclass
class Session:
    """What the minimal peer saw of one session with a node."""

    our_id: str
    node_cert_id: str = ""
    node_hello: dict[Any, Any] = field(default_factory=dict)
    rtt_s: float = -1.0  # from the node's echo of our heartbeat
    answered: int = 0  # the node's heartbeats we echoed
    other: list[int] = field(default_factory=list)  # types of other frames it sent


def join(
    token: str, host: str, port: int, before_goodbye: Callable[[Session], None] = lambda s: None
) -> Session:
    """Dial the node at ``host:port`` as a new member of the token's mesh: TLS, Hello both
    ways, one heartbeat each way (ours echoed, one of theirs answered), ``Goodbye``."""
    secret = token_secret(token)
    key = ec.generate_private_key(ec.SECP256R1())
    session = Session(our_id=node_id(key.public_key()))
    with tempfile.TemporaryDirectory() as folder:
        ctx = client_context(secret, key, Path(folder))
        raw = socket.create_connection((host, port), timeout=TIMEOUT_S)
        with ctx.wrap_socket(raw, server_hostname=None) as tls:
            cert = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True) or b"")
            (cn,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            public = cert.public_key()
            assert isinstance(public, ec.EllipticCurvePublicKey)
            assert cn.value == node_id(public), "the node's CN is not its key's id"
            session.node_cert_id = node_id(public)
            _exchange(tls, secret, session)
            before_goodbye(session)
            tls.sendall(frame(GOODBYE, {"node_id": session.our_id, "reason": "done"}))
    return session


def _exchange(tls: ssl.SSLSocket, secret: bytes, session: Session) -> None:
    """§1.4 and §1.6: the dialer's Hello first, the node's Hello, then heartbeats."""
    frames = Frames(tls)
    hello = {
        "node_id": session.our_id,
        "mesh_id_hash": mesh_id(secret),
        "listen_address": "127.0.0.1:1",
        "device_kind": "cpu",
        "usable_memory": 0,
    }
    tls.sendall(frame(HELLO, hello))
    session.node_hello = frames.next()
    assert session.node_hello[0] == HELLO, session.node_hello
    sent_ns = time.monotonic_ns()
    tls.sendall(frame(HEARTBEAT, {"node_id": session.our_id, "nonce": 1, "sent_ns": sent_ns}))
    nonce = 1
    while session.rtt_s < 0 or session.answered == 0:
        header = frames.next()
        if header[0] != HEARTBEAT:
            session.other.append(header[0])
            continue
        if header.get("echo_nonce") is not None:  # the answer to ours
            assert header["echo_nonce"] == 1
            assert header["echo_sent_ns"] == sent_ns
            session.rtt_s = (time.monotonic_ns() - sent_ns) / 1e9
            continue
        nonce += 1  # theirs: echo it
        echo = {"echo_nonce": header["nonce"], "echo_sent_ns": header["sent_ns"]}
        beat = {"node_id": session.our_id, "nonce": nonce, "sent_ns": time.monotonic_ns()}
        tls.sendall(frame(HEARTBEAT, beat | echo))
        session.answered += 1
