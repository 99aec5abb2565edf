"""PeerStream over in-memory streams: framing, Error-then-close on bad input, goodbye."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from meshnode_protocol import (
    Connection,
    Error,
    ErrorCode,
    Goodbye,
    Heartbeat,
    Hello,
    RemoteProtocolError,
    Role,
)

from meshnode.net.stream import PeerStream


def hello(node_id: str) -> Hello:
    return Hello(
        node_id=node_id,
        mesh_id_hash="m",
        listen_address="127.0.0.1:1",
        device_kind="cpu",
        usable_memory=1,
    )


def pair() -> tuple[PeerStream, PeerStream]:
    left, right = trio.testing.memory_stream_pair()
    return (
        PeerStream(left, Connection(Role.DIALER)),
        PeerStream(right, Connection(Role.LISTENER)),
    )


async def test_messages_round_trip_and_eof_is_none() -> None:
    a, b = pair()
    with trio.fail_after(5):
        await a.send(hello("a"))
        await a.send(Heartbeat(node_id="a", nonce=7, sent_ns=1))
        assert await b.receive() == hello("a")
        assert await b.receive() == Heartbeat(node_id="a", nonce=7, sent_ns=1)
        await a.aclose()
        assert await b.receive() is None


async def test_bad_input_is_answered_with_an_error_and_closes() -> None:
    left, right = trio.testing.memory_stream_pair()
    b = PeerStream(right, Connection(Role.LISTENER))
    observer = Connection(Role.DIALER)
    with trio.fail_after(5):
        await left.send_all(b"\x00\x00\x00\x04junk")
        with pytest.raises(RemoteProtocolError):
            await b.receive()
        observer.receive_data(await left.receive_some())
        reply = observer.next_message()
        assert isinstance(reply, Error)
        assert reply.code == ErrorCode.MALFORMED_FRAME
        assert reply.fatal
        assert await left.receive_some() == b""  # closed after the Error


async def test_nothing_is_sent_after_goodbye() -> None:
    a, b = pair()
    with trio.fail_after(5):
        await a.send(hello("a"))
        await a.send(Goodbye(node_id="a"))
        with pytest.raises(trio.ClosedResourceError):
            await a.send(Heartbeat(node_id="a", nonce=1, sent_ns=1))
        assert isinstance(await b.receive(), Hello)
        assert isinstance(await b.receive(), Goodbye)


async def test_after_a_protocol_error_only_the_fatal_error_goes_out() -> None:
    """A task that answers with a non-fatal Error after the peer broke the protocol, but
    before the session's fatal Error went out (it queued first for the send lock: a Load
    failing in the background), gets a closed connection. Before, the codec's
    LocalProtocolError escaped that task and ended the node (found by the reliability
    fuzzer, which made a host exit)."""
    left, right = trio.testing.memory_stream_pair()
    conn = Connection(Role.LISTENER)
    b = PeerStream(right, conn)
    conn.receive_data(b"\x00\x00\x00\x04junk")  # the receive loop saw the bad frame...
    with pytest.raises(RemoteProtocolError) as broken:
        conn.next_message()
    late = Error(code=ErrorCode.LOAD_FAILED, message="nothing prepared", run_id="r")
    with trio.fail_after(5):
        with pytest.raises(trio.ClosedResourceError):
            await b.send(late)  # ...and another task's reply came first
        await b.send(broken.value.to_error())  # the session's own answer still goes out
        observer = Connection(Role.DIALER)
        observer.receive_data(await left.receive_some())
        reply = observer.next_message()
        assert isinstance(reply, Error)
        assert reply.fatal
