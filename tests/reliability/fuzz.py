"""Fuzzing a live node's mesh port with frames mutated from the protocol's golden vectors.

:func:`mutated_frames` derives frames from ``protocol/vectors/*.json``: one field of the
CBOR header set to an odd or perturbed value (edges of unsigned fields, type confusions,
path and URL refs, long strings, non-finite floats), or the bytes mutated (bit flips, CBOR's
special bytes, truncations, insertions, deletions, splices, random bodies, wrong length
prefixes, oversize lengths). :func:`classify` runs each through
the sans-IO codec in the state the node's session is in after a ``Hello``: a frame the codec
decodes is *accepted* (the node answers it or ignores it, the session goes on), one it
refuses is *malformed* (the node must answer with an ``Error`` and close that connection),
one that ends the session (``Hello`` again, ``Goodbye``) or waits for bytes that never come
is *closing*. Any other exception from the codec is a bug and is kept.

:func:`fuzz_node` sends them to a node over real mutual-TLS sessions: accepted frames in
batches on a few long-lived sessions (their replies drained by a reader), every malformed
and closing frame on a fresh connection of its own (up to ``closing_cap`` of them; the rest
are checked by the codec only), and counts what the node did.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cbor2
import trio
from meshnode_protocol import (
    CONNECTION_CLOSED,
    MAX_FRAME_BYTES,
    NEED_DATA,
    Connection,
    Error,
    Goodbye,
    Hello,
    RemoteProtocolError,
    Role,
)

from meshnode.net.address import Address
from meshnode.net.identity import NodeIdentity

VECTORS = Path(__file__).resolve().parents[2] / "protocol" / "vectors"
#: CBOR's special bytes (indefinite lengths, break, simple values, 8-byte heads, tags) and
#: integer edges: substitutions that reach the decoder's rarer paths.
SPECIAL_BYTES = (0x00, 0x17, 0x18, 0x1B, 0x1F, 0x3F, 0x5F, 0x7F, 0x9F, 0xBF, 0xC0, 0xF4,
                 0xF5, 0xF6, 0xF7, 0xF9, 0xFB, 0xFF, 0x80, 0xA0)  # fmt: skip
#: Accepted frames written per ``send_all`` on a long-lived session.
BATCH_FRAMES = 256
#: Seconds the node has to answer and close a connection that sent a malformed frame.
CLOSE_TIMEOUT_S = 20.0
#: Seconds a TLS connect and handshake may take on a loaded box.
CONNECT_TIMEOUT_S = 20.0
# Tries of one connection whose handshake the node reset to make room (``_connect``).
CONNECT_ATTEMPTS = 5


def seed_frames() -> list[bytes]:
    """The encoded frame of every golden vector."""
    frames = []
    for path in sorted(VECTORS.glob("*.json")):
        vector = json.loads(path.read_text())
        frames.append(bytes.fromhex(vector["frame_hex"]))
    return frames


def _framed(body: bytes | bytearray, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return size.to_bytes(4, "big") + bytes(body)


#: Values a field is set to: edges of the unsigned fields, type confusions, refs a member
#: might try, long and odd strings, non-finite floats.
ODD_VALUES: tuple[object, ...] = (
    0, 1, -1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 255, 65536, "", "x" * 4096, "é\u2028",
    "../../../../etc/passwd", "hf://org/model@../../x", "http://127.0.0.1:9/model",
    "/etc/hostname", [], [2**32 - 1], [0] * 300, {}, True, False, None, 0.5, -0.0,
    math.inf, math.nan, b"\x00\xff",
)  # fmt: skip


def _mutate_field(rng: random.Random, frame: bytes) -> bytes:
    """Set one field of the frame's CBOR header (or of a record inside it) to an odd or
    perturbed value, keeping the key order and the raw payload: mostly frames the codec
    decodes, so they reach the node's handlers."""
    fp = io.BytesIO(frame[4:])
    header = cbor2.CBORDecoder(fp).decode()
    payload = frame[4 + fp.tell() :]
    target = header
    records = [v for v in header.values() if isinstance(v, dict) and v]
    if records and rng.random() < 0.25:
        target = rng.choice(records)
    keys = [k for k in target if isinstance(k, str)]
    if not keys:
        return frame
    key = rng.choice(keys)
    old = target[key]
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.5:
        target[key] = max(0, old + rng.choice((-1, 1, 7, 1000, 2**31)))
    elif isinstance(old, list) and old and rng.random() < 0.5:
        target[key] = [*old, *old] if rng.random() < 0.5 else old[:-1]
    else:
        target[key] = rng.choice(ODD_VALUES)
    return _framed(cbor2.dumps(header) + payload)


def _mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    if rng.random() < 0.55:
        return _mutate_field(rng, rng.choice(seeds))
    body = bytearray(rng.choice(seeds)[4:])
    op = rng.random()
    if op < 0.30:
        for _ in range(rng.randint(1, 3)):
            body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
    elif op < 0.50:
        for _ in range(rng.randint(1, 2)):
            body[rng.randrange(len(body))] = rng.choice(SPECIAL_BYTES)
    elif op < 0.58:
        del body[rng.randrange(len(body)) :]
    elif op < 0.66:
        at = rng.randrange(len(body) + 1)
        body[at:at] = rng.randbytes(rng.randint(1, 16))
    elif op < 0.74:
        at = rng.randrange(len(body))
        del body[at : at + rng.randint(1, 16)]
    elif op < 0.82:
        other = rng.choice(seeds)[4:]
        body = body[: rng.randrange(len(body))] + other[rng.randrange(len(other)) :]
    elif op < 0.88:
        body = bytearray(rng.randbytes(rng.randint(0, 64)))
    elif op < 0.95:
        return _framed(body, max(0, len(body) + rng.choice((-3, -1, 1, 2, 64))))
    else:
        return _framed(body, rng.choice((MAX_FRAME_BYTES + 1, 2**32 - 1)))
    return _framed(body)


def mutated_frames(count: int, seed: int) -> Iterator[bytes]:
    """``count`` frames mutated from the golden vectors, reproducibly from ``seed``."""
    rng = random.Random(seed)
    seeds = seed_frames()
    for _ in range(count):
        yield _mutate(rng, seeds)


@dataclass
class Classifier:
    """The codec in the state a node's session is in after our ``Hello``."""

    hello: Hello
    _conn: Connection | None = None

    def classify(self, frame: bytes) -> str:
        """``accepted``, ``malformed``, ``closing``, ``incomplete`` (a frame shorter than its
        length prefix: the node waits for the rest), or ``bug: <exception>``."""
        conn = self._conn or self._fresh()
        self._conn = None
        conn.receive_data(frame)
        try:
            message = conn.next_message()
        except RemoteProtocolError:
            return "malformed"
        except Exception as exc:  # the codec must raise nothing else on peer bytes
            return f"bug: {type(exc).__name__}: {exc}"
        if message is NEED_DATA:
            return "incomplete"
        if message is CONNECTION_CLOSED or isinstance(message, Hello | Goodbye):
            return "closing"
        self._conn = conn
        return "accepted"

    def _fresh(self) -> Connection:
        conn = Connection(Role.LISTENER)
        # The Hello as the codec would have decoded it, without decoding it again for each
        # of ~10⁶ frames (that would cost more than classifying the frame itself).
        conn._process_theirs(self.hello)
        return conn


def hello_of(identity: NodeIdentity) -> Hello:
    return Hello(
        node_id=identity.node_id,
        mesh_id_hash=identity.mesh_id,
        listen_address="127.0.0.1:1",
        device_kind="cpu",
        usable_memory=0,
    )


@dataclass
class FuzzStats:
    """What was sent and what the node did."""

    frames: int = 0
    accepted_sent: int = 0  # decodable frames written on long-lived sessions
    closing_sent: int = 0  # malformed/closing frames, each on its own connection
    incomplete_sent: int = 0  # frames shorter than their length (we close those connections)
    codec_only: int = 0  # malformed frames past closing_cap: checked by the codec only
    errors_received: int = 0  # Error frames the node sent on those connections
    closed_by_node: int = 0  # of those connections, closed by the node
    sessions_reopened: int = 0  # long-lived sessions the node ended (a frame it refused)
    bugs: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        rate = self.frames / self.seconds if self.seconds else 0.0
        return (
            f"{self.frames} frames in {self.seconds:.1f} s ({rate:,.0f}/s): "
            f"{self.accepted_sent} accepted on long-lived TLS sessions "
            f"({self.sessions_reopened} sessions ended by the node), {self.closing_sent} "
            f"malformed or closing, each on its own TLS connection ({self.closed_by_node} "
            f"closed by the node, {self.errors_received} Error frames), "
            f"{self.incomplete_sent} incomplete on their own connections (closed by us), "
            f"{self.codec_only} more malformed through the codec only; bugs: {len(self.bugs)}"
        )


async def _connect(identity: NodeIdentity, address: Address) -> trio.SSLStream[trio.SocketStream]:
    """A TLS connection to the node. A handshake the node resets is tried again (at most
    :data:`CONNECT_ATTEMPTS` times): with more than its per-address share of connections
    still before Hello (the fuzzer opens them fast, a loaded node answers slowly), the node
    closes the oldest to make room, as it does for a flood (issue 36, item 1)."""
    for attempt in range(CONNECT_ATTEMPTS):
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                stream = await trio.open_ssl_over_tcp_stream(
                    address.host, address.port, ssl_context=identity.client_context()
                )
                try:
                    await stream.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(stream)  # no socket left open
                    raise
            return stream
        except (trio.BrokenResourceError, ConnectionError):
            if attempt == CONNECT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable: the last attempt raises")


async def _drain(stream: trio.SSLStream[trio.SocketStream], closed: trio.Event) -> None:
    """Read (and drop) what the node sends on a long-lived session until it closes."""
    try:
        while await stream.receive_some(1 << 16):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    closed.set()


class _Session:
    """A long-lived session carrying accepted frames."""

    def __init__(self, identity: NodeIdentity, address: Address) -> None:
        self.identity = identity
        self.address = address
        self.stream: trio.SSLStream[trio.SocketStream] | None = None
        self.closed = trio.Event()

    async def send(self, nursery: trio.Nursery, data: bytes, stats: FuzzStats) -> None:
        for _attempt in range(3):
            if self.stream is None or self.closed.is_set():
                if self.stream is not None:
                    stats.sessions_reopened += 1
                    await self.stream.aclose()
                self.stream = await _connect(self.identity, self.address)
                self.closed = trio.Event()
                await self.stream.send_all(Connection().send(hello_of(self.identity)))
                nursery.start_soon(_drain, self.stream, self.closed)
            try:
                await self.stream.send_all(data)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.closed.set()
        raise AssertionError("the node ended three long-lived sessions in a row")

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


async def _one_closing(
    identity: NodeIdentity, address: Address, frame: bytes, stats: FuzzStats, *, wait: bool
) -> None:
    """Hello, then ``frame`` on a fresh connection; with ``wait``, the node must close it
    (an incomplete frame it cannot: we close it, and the node must let it go)."""
    stream = await _connect(identity, address)
    conn = Connection()
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(conn.send(hello_of(identity)) + frame)
        if not wait:
            return
        with trio.fail_after(CLOSE_TIMEOUT_S):
            while True:
                try:
                    data = await stream.receive_some(1 << 16)
                except trio.BrokenResourceError:
                    data = b""
                try:
                    conn.receive_data(data)
                    while (msg := conn.next_message()) is not NEED_DATA:
                        if msg is CONNECTION_CLOSED:
                            stats.closed_by_node += 1
                            return
                        if isinstance(msg, Error):
                            stats.errors_received += 1
                except RemoteProtocolError:
                    stats.closed_by_node += 1  # the stream ended inside a frame: closed
                    return


async def fuzz_node(
    make_identity: Callable[[str], NodeIdentity],
    address: Address,
    *,
    count: int,
    seed: int,
    closing_cap: int,
    lanes: int = 8,
    progress: Callable[[FuzzStats], None] | None = None,
) -> FuzzStats:
    """Send ``count`` mutated frames to the node at ``address`` (see the module docstring)."""
    stats = FuzzStats()
    member = make_identity("long")
    classifier = Classifier(hello_of(member))
    send_closing, receive_closing = trio.open_memory_channel[tuple[bytes, bool]](lanes * 4)
    began = time.monotonic()

    async def lane(index: int) -> None:
        identity = make_identity(f"lane{index}")
        async for frame, wait in receive_closing:
            await _one_closing(identity, address, frame, stats, wait=wait)

    async with trio.open_nursery() as nursery:
        session = _Session(member, address)
        async with trio.open_nursery() as lanes_nursery:
            for index in range(lanes):
                lanes_nursery.start_soon(lane, index)
            async with send_closing:
                batch: list[bytes] = []
                for frame in mutated_frames(count, seed):
                    stats.frames += 1
                    kind = classifier.classify(frame)
                    if kind == "accepted":
                        batch.append(frame)
                        if len(batch) == BATCH_FRAMES:
                            await session.send(nursery, b"".join(batch), stats)
                            stats.accepted_sent += len(batch)
                            batch.clear()
                    elif kind.startswith("bug"):
                        stats.bugs.append(kind)
                    elif stats.closing_sent + stats.incomplete_sent < closing_cap:
                        wait = kind != "incomplete"
                        if wait:
                            stats.closing_sent += 1
                        else:
                            stats.incomplete_sent += 1
                        await send_closing.send((frame, wait))
                    else:
                        stats.codec_only += 1
                    if progress is not None and stats.frames % 50_000 == 0:
                        stats.seconds = time.monotonic() - began
                        progress(stats)
                if batch:
                    await session.send(nursery, b"".join(batch), stats)
                    stats.accepted_sent += len(batch)
        await session.aclose()
        nursery.cancel_scope.cancel()
    stats.seconds = time.monotonic() - began
    return stats
