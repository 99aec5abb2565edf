"""Mesh membership as X.509: join tokens, the token-derived mesh CA, node certificates.

Theory of operation. A mesh is a 32-byte random secret wrapped in a join token. Every
member derives the same mesh CA private key from that secret with HKDF-SHA256 (RFC 5869),
so each node can sign its *own* node certificate without any CA service, and Python's
``ssl`` verifies peers against the mesh CA certificate: mutual TLS 1.3, certificates
required both ways. A node without the token cannot produce a certificate that chains to
the CA, so it is refused in the handshake before a single frame is read.

The public mesh id (carried in mDNS TXT records) is a separate HKDF output of the same
secret: it names the mesh without revealing anything that helps sign a certificate.

Node identity is an EC P-256 key generated once and persisted 0600 in the state dir; the
node id is a hash of its public key, so it stays stable across restarts and a certificate
cannot claim another node's id without that node's key.

Binding the id to the key is checked on every handshake (:func:`certified_node_id`): the
mesh CA key is derivable by every member, so a CA signature proves membership only, and a
member could sign a certificate with any CN. TLS proves the peer holds the certificate's
private key; requiring CN = ``node_id_of(that key)`` makes the CN unforgeable.

Errors: :class:`TokenError` for a malformed token (user input), :class:`PeerIdentityError`
for a peer certificate whose CN is not its own key's id.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import secrets
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import NewType

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshnode.errors import ConfigError, MeshnodeError
from meshnode.net.secret_files import SecretFileError, read_private, write_private

NodeId = NewType("NodeId", str)

TOKEN_PREFIX = "mesh1-"
SECRET_BYTES = 32
# The mesh name travels inside the token so `join` can log it; keep tokens pasteable.
MAX_MESH_NAME_BYTES = 64
# P-256 group order: a derived scalar must lie in [1, n-1].
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
# Node certificates are re-signed at every start; a year only bounds a stolen file's use.
NODE_CERT_VALIDITY = datetime.timedelta(days=365)
# Tolerate peers whose clocks run a little ahead of ours.
CLOCK_SKEW = datetime.timedelta(hours=1)

NODE_KEY_FILE = "node.key"
NODE_CERT_FILE = "node.crt"
MESH_CA_FILE = "mesh-ca.crt"


class TokenError(ConfigError):
    """A join token that is not of the form ``mesh1-<base32>`` or decodes badly."""


class PeerIdentityError(MeshnodeError, ValueError):
    """A verified peer certificate that does not prove its node id (refuse the peer)."""


@dataclass(frozen=True, slots=True)
class JoinToken:
    """The mesh secret and the mesh's human name; ``str(token)`` is the pasteable form."""

    secret: bytes = field(repr=False)
    name: str

    def __post_init__(self) -> None:
        if len(self.secret) != SECRET_BYTES:
            raise TokenError(f"mesh secret must be {SECRET_BYTES} bytes")
        if len(self.name.encode()) > MAX_MESH_NAME_BYTES:
            raise TokenError(f"mesh name longer than {MAX_MESH_NAME_BYTES} bytes")

    @classmethod
    def generate(cls, name: str) -> JoinToken:
        """A fresh token for a new mesh called ``name``."""
        return cls(secrets.token_bytes(SECRET_BYTES), name)

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        """Decode the pasteable form; raises :class:`TokenError`."""
        text = text.strip()
        if not text.startswith(TOKEN_PREFIX):
            raise TokenError(f"a join token starts with {TOKEN_PREFIX!r}")
        body = text[len(TOKEN_PREFIX) :].upper()
        try:
            raw = base64.b32decode(body + "=" * (-len(body) % 8))
            name = raw[SECRET_BYTES:].decode()
        except (ValueError, UnicodeDecodeError) as exc:
            raise TokenError("join token is not valid base32") from exc
        return cls(raw[:SECRET_BYTES], name)

    def __str__(self) -> str:
        body = base64.b32encode(self.secret + self.name.encode()).decode().rstrip("=")
        return TOKEN_PREFIX + body.lower()

    def _derive(self, info: bytes, length: int) -> bytes:
        hkdf = HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info)
        return hkdf.derive(self.secret)

    @property
    def mesh_id(self) -> str:
        """Public mesh id (hex): a one-way derivation, safe to advertise over mDNS."""
        return self._derive(b"meshnode/v1/mesh-id", 16).hex()

    def ca_key(self) -> ec.EllipticCurvePrivateKey:
        """The mesh CA's P-256 key, identical on every node holding this token.

        48 bytes of HKDF output reduced mod n-1, plus one: the "extra random bits"
        method of FIPS 186-5 A.2.1, which keeps the modulo bias below 2**-128.
        """
        okm = int.from_bytes(self._derive(b"meshnode/v1/ca-key", 48), "big")
        return ec.derive_private_key(okm % (_P256_ORDER - 1) + 1, ec.SECP256R1())


def _ca_name(mesh_id: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshnode mesh {mesh_id}")])


def mesh_ca_certificate(token: JoinToken) -> x509.Certificate:
    """The self-signed mesh CA certificate every node rebuilds from the token.

    Serial and validity are fixed, so only the (randomised) ECDSA signature differs
    between nodes; verification only needs the subject and public key to match.
    """
    key = token.ca_key()
    name = _ca_name(token.mesh_id)
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(int(token.mesh_id, 16) >> 1 or 1)
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )


def node_id_of(public_key: ec.EllipticCurvePublicKey) -> NodeId:
    """The node id: the first 16 hex digits of SHA-256 over the DER public key."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return NodeId(hashlib.sha256(der).hexdigest()[:16])


def load_or_create_node_key(state_dir: Path) -> ec.EllipticCurvePrivateKey:
    """Load ``<state_dir>/node.key``, creating it (mode 0600) on first use.

    An existing key readable by others is tightened to 0600 (with a warning); a key that
    is a link or not ours is refused: raises
    :class:`~meshnode.net.secret_files.SecretFileError`.
    """
    path = state_dir / NODE_KEY_FILE
    if not path.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        with contextlib.suppress(SecretFileError):  # a concurrent start made one first
            write_private(path, pem, overwrite=False)
    loaded = serialization.load_pem_private_key(read_private(path, fix=True), password=None)
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path} does not hold an EC private key")
    return loaded


def write_token_file(path: Path, token: JoinToken, *, overwrite: bool = False) -> None:
    """Store a join token in ``path`` (mode 0600, durable).

    A mesh's token is its only secret: an existing file is kept unless ``overwrite``
    (raises :class:`~meshnode.net.secret_files.SecretFileError`).
    """
    write_private(path, (str(token) + "\n").encode(), overwrite=overwrite)


def sign_node_certificate(
    token: JoinToken, node_key: ec.EllipticCurvePrivateKey, *, now: datetime.datetime
) -> x509.Certificate:
    """A certificate for this node's key, issued by the mesh CA; subject CN is the node id."""
    public = node_key.public_key()
    ca_public = token.ca_key().public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id_of(public))]))
        .issuer_name(_ca_name(token.mesh_id))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + NODE_CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False
        )
        .sign(token.ca_key(), hashes.SHA256())
    )


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """This node's id plus the files ``ssl`` loads: key, certificate, mesh CA."""

    node_id: NodeId
    mesh_id: str
    key_path: Path
    cert_path: Path
    ca_path: Path

    @classmethod
    def provision(cls, token: JoinToken, state_dir: Path) -> NodeIdentity:
        """Load or create the node key, sign a fresh certificate, write the PEM files."""
        key = load_or_create_node_key(state_dir)
        now = datetime.datetime.now(datetime.UTC)
        cert = sign_node_certificate(token, key, now=now)
        ca = mesh_ca_certificate(token)
        cert_path = state_dir / NODE_CERT_FILE
        ca_path = state_dir / MESH_CA_FILE
        # Replaced by rename, never written through: a link planted at either name is
        # replaced, not followed (issue 36, item 13).
        write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM), overwrite=True)
        write_private(ca_path, ca.public_bytes(serialization.Encoding.PEM), overwrite=True)
        return cls(
            node_id=node_id_of(key.public_key()),
            mesh_id=token.mesh_id,
            key_path=state_dir / NODE_KEY_FILE,
            cert_path=cert_path,
            ca_path=ca_path,
        )

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=str(self.ca_path))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        # Peers dial each other by IP; identity is the mesh CA signature plus the node id
        # in the certificate, not a host name.
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(str(self.cert_path), str(self.key_path))
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """TLS 1.3 server context that requires a client certificate from the mesh CA."""
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        """TLS 1.3 client context that requires a server certificate from the mesh CA."""
        return self._context(ssl.Purpose.SERVER_AUTH)


def certified_node_id(der: bytes | None) -> NodeId:
    """The node id a peer's verified certificate (DER, ``getpeercert(True)``) proves.

    The subject CN must equal :func:`node_id_of` the certificate's own public key; a
    certificate carrying another node's id, signed with the token-derived mesh CA by any
    member, is refused. Call after the TLS handshake verified the chain. Raises
    :class:`PeerIdentityError`.
    """
    if not der:
        raise PeerIdentityError("peer sent no certificate")
    cert = x509.load_der_x509_certificate(der)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    key = cert.public_key()
    if len(names) != 1 or not isinstance(key, ec.EllipticCurvePublicKey):
        raise PeerIdentityError("peer certificate needs one CN and an EC public key")
    claimed, actual = names[0].value, node_id_of(key)
    if claimed != actual:
        raise PeerIdentityError(
            f"peer certificate claims node id {claimed!r} but its key's id is {actual}"
        )
    return actual
