"""A member's forgery: a certificate signed with the token-derived mesh CA, claiming another
node's id over the forger's own key (issue 15, item 2)."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshnode.net.identity import (
    MESH_CA_FILE,
    NODE_CERT_FILE,
    NODE_KEY_FILE,
    JoinToken,
    NodeId,
    NodeIdentity,
    mesh_ca_certificate,
)


def forged_certificate(
    token: JoinToken, key: ec.EllipticCurvePrivateKey, cn: str
) -> x509.Certificate:
    """A valid mesh certificate for ``key`` whose CN is ``cn`` (any member can make one)."""
    now = datetime.datetime.now(datetime.UTC)
    ca = mesh_ca_certificate(token)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(token.ca_key(), hashes.SHA256())
    )


def forged_identity(token: JoinToken, state_dir: Path, victim: str) -> NodeIdentity:
    """TLS files that chain to the mesh CA but claim ``victim``'s node id."""
    state_dir.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    (state_dir / NODE_KEY_FILE).write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert = forged_certificate(token, key, victim)
    (state_dir / NODE_CERT_FILE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    ca = mesh_ca_certificate(token).public_bytes(serialization.Encoding.PEM)
    (state_dir / MESH_CA_FILE).write_bytes(ca)
    return NodeIdentity(
        node_id=NodeId(victim),
        mesh_id=token.mesh_id,
        key_path=state_dir / NODE_KEY_FILE,
        cert_path=state_dir / NODE_CERT_FILE,
        ca_path=state_dir / MESH_CA_FILE,
    )
