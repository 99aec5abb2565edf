"""Real `meshnode join` processes on loopback: discovery, membership, refusal, bad peers.

Every wait is a bounded poll; every child process is killed in fixture teardown.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from meshnode_protocol import (
    CONNECTION_CLOSED,
    NEED_DATA,
    Connection,
    Error,
    ErrorCode,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
)

from meshnode.net.identity import JoinToken, NodeIdentity
from tests.e2e.cluster import (
    DEAD_AFTER_S,
    JOIN_CODE,
    Cluster,
    Node,
    cli,
    hermetic_env,
    wait_for,
    wait_started,
)
from tests.node.forgery import forged_identity

SEE_EACH_OTHER_S = 10.0  # the bound

Spawn = Callable[..., Node]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "mesh.token"
    result = cli("init", "--name", "e2e", "--token-file", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == path.read_text().strip()
    assert (path.stat().st_mode & 0o777) == 0o600
    return path


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """`meshnode join` processes under ``tmp_path``; all are killed at teardown."""
    with Cluster(tmp_path) as started:
        yield started


@pytest.fixture
def spawn(cluster: Cluster) -> Spawn:
    return cluster.spawn


def other_token(tmp_path: Path) -> Path:
    path = tmp_path / "other.token"
    path.write_text(str(JoinToken.generate("e2e")) + "\n")
    return path


@pytest.mark.parametrize("mode", ["mdns", "static"])
def test_three_nodes_form_a_mesh_and_notice_departures(
    mode: str, spawn: Spawn, token_file: Path, tmp_path: Path
) -> None:
    mdns = mode == "mdns"
    a = spawn("a", token_file, mdns=mdns)
    wait_started(a)
    static_a = [] if mdns else ["--peer", a.listen]
    b = spawn("b", token_file, *static_a, mdns=mdns)
    wait_started(b)
    # Statically, `c` knows only `a`: it learns of `b` from the peer list in a's Hello.
    c = spawn("c", token_file, *static_a, mdns=mdns)
    # The impostor dials `a` directly too, so that its attempts are seen to be refused.
    evil = spawn("evil", other_token(tmp_path), "--peer", a.listen, mdns=mdns)
    wait_started(c, evil)
    good = [a, b, c]
    ids = {n.name: n.node_id() for n in good}
    evil_id = evil.node_id()

    def full_mesh() -> bool:
        return all(
            n.peer_states() == {ids[m.name]: "alive" for m in good if m is not n} for n in good
        )

    took = wait_for(full_mesh, SEE_EACH_OTHER_S, "three nodes to see each other")
    assert took < SEE_EACH_OTHER_S

    # The same view through the CLI.
    result = cli("status", "--state-dir", str(a.state_dir), "--json")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["node"]["node_id"] == ids["a"]
    assert {p["node_id"] for p in body["peers"]} == {ids["b"], ids["c"]}
    assert {p["state"] for p in body["peers"]} == {"alive"}

    # The impostor was refused in the TLS handshake and is listed nowhere.
    wait_for(lambda: a.status()["node"]["refused_handshakes"] > 0, 10, "a refused handshake")
    assert all(evil_id not in n.peer_states() for n in good)
    assert evil.peer_states() == {}
    assert "TLS handshake failed" in a.log()

    # SIGKILL: no goodbye; peers notice within the dead timeout.
    c.process.kill()
    killed_at = time.monotonic()
    wait_for(
        lambda: (
            a.peer_states().get(ids["c"]) in {"dead", None}
            and b.peer_states().get(ids["c"]) in {"dead", None}
        ),
        DEAD_AFTER_S + 3.0,
        "c to be declared dead",
    )
    assert time.monotonic() - killed_at < DEAD_AFTER_S + 3.0

    # SIGINT: goodbye; `a` drops `b` at once, well before the suspect timeout.
    b.process.send_signal(signal.SIGINT)
    # Without a goodbye `b` would stay listed (suspect, then dead) for 4 x DEAD_AFTER_S;
    # its disappearance within the dead timeout is the goodbye at work.
    took = wait_for(lambda: ids["b"] not in a.peer_states(), DEAD_AFTER_S, "a to drop b")
    assert took < DEAD_AFTER_S
    assert b.process.wait(timeout=10) == 0
    assert f"peer {ids['b']} left the mesh" in a.log()
    assert not (b.state_dir / "node.json").exists()


def test_status_without_a_daemon_exits_1(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = cli("status", "--api", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert "no meshnode daemon answers" in result.stderr
    result = cli("status", "--state-dir", str(tmp_path), "--api", f"127.0.0.1:{port}", "--json")
    assert result.returncode == 1


def test_join_without_a_token_creates_a_mesh(tmp_path: Path) -> None:
    # A first node needs no token: it creates a mesh and keeps the token 0600 for others.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            JOIN_CODE,
            "join",
            "--state-dir",
            str(tmp_path),
            "--no-mdns",
            "--listen",
            "127.0.0.1:0",
            "--api",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=hermetic_env(),
    )
    try:
        token_file = tmp_path / "mesh-token"
        deadline = time.monotonic() + 20
        while not (tmp_path / "node.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "node.json").exists()
        assert token_file.stat().st_mode & 0o777 == 0o600
        assert token_file.read_text().startswith("mesh1-")
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "created mesh" in output
    assert token_file.read_text() not in output  # the secret is never logged


# ---- bad peers over real sockets -----------------------------------------------------------


def _hello(identity: NodeIdentity) -> Hello:
    return Hello(
        node_id=identity.node_id,
        mesh_id_hash=identity.mesh_id,
        listen_address="127.0.0.1:1",
        device_kind="cpu",
        usable_memory=0,
    )


def _encoded_hello(identity: NodeIdentity) -> bytes:
    return Connection().send(_hello(identity))


def _encoded_hello_goodbye(identity: NodeIdentity) -> bytes:
    conn = Connection()
    return conn.send(_hello(identity)) + conn.send(Goodbye(node_id=identity.node_id))


def _encoded_heartbeat(identity: NodeIdentity) -> bytes:
    """A Heartbeat frame alone: valid, but out of order as a connection's first frame."""
    conn = Connection()
    conn.send(_hello(identity))  # the codec only lets a Heartbeat follow a Hello
    return conn.send(Heartbeat(node_id=identity.node_id, nonce=1, sent_ns=0))


async def _exchange(identity: NodeIdentity, address: str, payload: bytes) -> list[Message]:
    """Open an authenticated connection, send raw ``payload``, return all messages until EOF."""
    host, port = address.rsplit(":", 1)
    messages: list[Message] = []
    conn = Connection()
    with trio.fail_after(10):
        stream = await trio.open_ssl_over_tcp_stream(
            host, int(port), ssl_context=identity.client_context()
        )
        await stream.do_handshake()
        await stream.send_all(payload)
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            conn.receive_data(data)
            while (msg := conn.next_message()) is not NEED_DATA:
                if msg is CONNECTION_CLOSED:
                    await stream.aclose()
                    return messages
                messages.append(msg)


@pytest.fixture
def lone_node(spawn: Spawn, token_file: Path) -> Node:
    node = spawn("lone", token_file, mdns=False)
    wait_started(node)
    return node


def test_raw_garbage_without_tls_fails_the_handshake(lone_node: Node) -> None:
    host, port = lone_node.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"\x16\x03\x01garbage, not a TLS ClientHello" * 4)
        sock.settimeout(5)
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
    assert b"meshnode" not in received  # nothing but (at most) a TLS alert came back
    wait_for(lambda: lone_node.status()["node"]["refused_handshakes"] == 1, 5, "refusal count")


@pytest.mark.parametrize(
    ("name", "payload", "code"),
    [
        ("garbage", lambda ident: b"\x00\x00\x00\x08notcbor!", ErrorCode.MALFORMED_FRAME),
        ("oversize", lambda ident: b"\xff\xff\xff\xff" + b"x" * 64, ErrorCode.FRAME_TOO_LARGE),
        ("before-hello", _encoded_heartbeat, ErrorCode.OUT_OF_ORDER),
        ("second-hello", lambda i: _encoded_hello(i) * 2, ErrorCode.OUT_OF_ORDER),
    ],
)
async def test_bad_frames_get_an_error_and_close(
    lone_node: Node,
    token_file: Path,
    tmp_path: Path,
    name: str,
    payload: Callable[[NodeIdentity], bytes],
    code: ErrorCode,
) -> None:
    token = JoinToken.parse(await trio.Path(token_file).read_text())
    identity = NodeIdentity.provision(token, tmp_path / f"client-{name}")
    messages = await _exchange(identity, lone_node.listen, payload(identity))
    # The listener answers the dialer's Hello; a bad first frame gets only the Error.
    # After a good Hello, the node's own Hello comes first.
    errors = [m for m in messages if isinstance(m, Error)]
    assert messages[-1:] == errors
    assert len(errors) == 1
    assert errors[0].code == code
    assert errors[0].fatal
    before = [type(m) for m in messages[:-1] if not isinstance(m, Heartbeat)]
    assert before == ([Hello] if name == "second-hello" else [])
    # The node keeps serving: its API answers and a well-behaved peer gets a Hello.
    assert lone_node.status()["node"]["protocol_errors"] >= 1
    polite = await _exchange(identity, lone_node.listen, _encoded_hello_goodbye(identity))
    assert isinstance(polite[0], Hello)
    assert not any(isinstance(m, Error) for m in polite)


async def _refused_exchange(identity: NodeIdentity, address: str) -> list[Message]:
    """``_exchange`` with a Hello, where a reset counts as the connection closing."""
    try:
        return await _exchange(identity, address, _encoded_hello(identity))
    except trio.BrokenResourceError:
        return []


async def _first_bytes_from_dialer(listener: trio.SSLListener[trio.SocketStream]) -> bytes:
    """Accept one dial, complete TLS (the forged chain is valid) and read until EOF."""
    stream = await listener.accept()
    await stream.do_handshake()
    received = b""
    with contextlib.suppress(trio.BrokenResourceError, ssl.SSLError):
        while chunk := await stream.receive_some():
            received += chunk
    await trio.aclose_forcefully(stream)
    return received


async def test_a_forged_node_id_is_refused_both_ways(
    lone_node: Node, spawn: Spawn, token_file: Path, tmp_path: Path
) -> None:
    """Issue 15 item 2: any member can sign a certificate with the token's CA, but one whose
    CN is another node's id is refused after TLS, counted, and never becomes a session."""
    token = JoinToken.parse(await trio.Path(token_file).read_text())
    victim = NodeIdentity.provision(token, tmp_path / "victim")
    forged = forged_identity(token, tmp_path / "forger", victim=victim.node_id)
    # The forger dials the node: no Hello comes back, and the node lists no peer.
    with trio.fail_after(10):
        assert await _refused_exchange(forged, lone_node.listen) == []
    wait_for(lambda: lone_node.status()["node"]["refused_handshakes"] == 1, 5, "refusal count")
    assert lone_node.peer_states() == {}
    assert "claims node id" in lone_node.log()
    # The node dials the forger (a static peer): it says nothing, not even its Hello.
    listeners = await trio.open_ssl_over_tcp_listeners(0, forged.server_context(), host="127.0.0.1")
    port = listeners[0].transport_listener.socket.getsockname()[1]  # type: ignore[attr-defined]
    dialer = spawn("dialer", token_file, "--peer", f"127.0.0.1:{port}", mdns=False)
    with trio.fail_after(30):
        assert await _first_bytes_from_dialer(listeners[0]) == b""
    await listeners[0].aclose()
    wait_for(lambda: dialer.status()["node"]["refused_handshakes"] >= 1, 10, "dialer refusal")
    assert dialer.peer_states() == {}
