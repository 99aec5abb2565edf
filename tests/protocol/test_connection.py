"""Connection behaviour: bad input → RemoteProtocolError codes, state machine, buffers."""

from __future__ import annotations

import dataclasses
from typing import Any

import cbor2
import pytest
from meshnode_protocol import (
    CONNECTION_CLOSED,
    MAX_FRAME_BYTES,
    MAX_PRE_HELLO_FRAME_BYTES,
    NEED_DATA,
    ActivationFrame,
    Connection,
    Error,
    ErrorCode,
    Goodbye,
    Heartbeat,
    LocalProtocolError,
    RemoteProtocolError,
    Role,
    State,
    Tensor,
    encode_frame,
)

from .helpers import HELLO_A, HELLO_B, open_pair, receive_all

HEARTBEAT = Heartbeat(node_id="node-a", nonce=1, sent_ns=2)
HELLO_FRAME = encode_frame(HELLO_A)


def raw_frame(header: Any, payload: bytes = b"") -> bytes:
    """A frame with an arbitrary header (for input our encoder would never produce)."""
    body = cbor2.dumps(header) + payload
    return len(body).to_bytes(4, "big") + body


def heartbeat_header(**overrides: Any) -> dict[Any, Any]:
    header: dict[Any, Any] = {0: 3, 1: 1, "node_id": "n", "nonce": 1, "sent_ns": 2}
    header.update(overrides)
    return header


def activation(rows: int = 1, hidden: int = 4) -> ActivationFrame:
    return ActivationFrame(
        request_id="r",
        run_id="run",
        term=1,
        kind="prefill",
        start_pos=0,
        tokens=tuple(range(rows)),
        payload=Tensor("f16", (rows, hidden), bytes(2 * rows * hidden)),
    )


MALFORMED = ErrorCode.MALFORMED_FRAME
ACT_HEADER = cbor2.loads(encode_frame(activation())[4:])

# (id, bytes sent after the peer's Hello, expected code)
BAD_INPUT: list[tuple[str, bytes, ErrorCode]] = [
    ("oversize-frame", (MAX_FRAME_BYTES + 1).to_bytes(4, "big"), ErrorCode.FRAME_TOO_LARGE),
    ("garbage", b"\x00\x00\x00\x05\xff\xff\xff\xff\xff", ErrorCode.MALFORMED_FRAME),
    ("empty-frame", b"\x00\x00\x00\x00", ErrorCode.MALFORMED_FRAME),
    ("header-not-a-map", raw_frame([0, 3]), ErrorCode.MALFORMED_FRAME),
    ("no-type-key", raw_frame({1: 1}), ErrorCode.MALFORMED_FRAME),
    ("bool-type-key", raw_frame({0: True, 1: 1}), ErrorCode.MALFORMED_FRAME),
    ("unknown-type", raw_frame({0: 99, 1: 1}), ErrorCode.UNKNOWN_MESSAGE_TYPE),
    ("wrong-version", raw_frame({**heartbeat_header(), 1: 2}), ErrorCode.UNSUPPORTED_VERSION),
    ("wrong-field-type", raw_frame(heartbeat_header(nonce="1")), ErrorCode.INVALID_FIELD),
    ("bool-for-int", raw_frame(heartbeat_header(nonce=True)), ErrorCode.INVALID_FIELD),
    ("int-too-wide", raw_frame(heartbeat_header(nonce=2**70)), ErrorCode.MALFORMED_FRAME),
    ("missing-field", raw_frame({0: 3, 1: 1, "node_id": "n"}), ErrorCode.INVALID_FIELD),
    ("cbor-tag", raw_frame(heartbeat_header(node_id=cbor2.CBORTag(1, 0))), MALFORMED),
    ("duplicate-key", b"\x00\x00\x00\x05\xa2\x00\x03\x00\x03", MALFORMED),
    ("undescribed-payload", raw_frame(heartbeat_header(), b"xx"), ErrorCode.MALFORMED_FRAME),
    ("truncated-payload", raw_frame(ACT_HEADER, bytes(4)), ErrorCode.INVALID_FIELD),
    ("bad-tensor-nbytes", raw_frame({**ACT_HEADER, "payload": {"dtype": "f16", "shape": [1, 4],
     "nbytes": 9}}, bytes(9)), ErrorCode.INVALID_FIELD),
    ("bad-dtype", raw_frame({**ACT_HEADER, "payload": {"dtype": "f64", "shape": [1, 1],
     "nbytes": 8}}, bytes(8)), ErrorCode.INVALID_FIELD),
    ("bad-kind", raw_frame({**ACT_HEADER, "kind": "train"}, bytes(8)), ErrorCode.INVALID_FIELD),
    ("second-hello", HELLO_FRAME, ErrorCode.OUT_OF_ORDER),
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "code"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT]
)
def test_bad_input_is_a_remote_protocol_error(data: bytes, code: ErrorCode) -> None:
    conn = Connection(Role.LISTENER)
    receive_all(conn, HELLO_FRAME)
    conn.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_message()
    assert info.value.code is code
    assert conn.their_state is State.ERROR
    # The connection refuses further use, and can still say why before closing.
    with pytest.raises(RemoteProtocolError):
        conn.next_message()
    with pytest.raises(LocalProtocolError):
        conn.send(HEARTBEAT)
    error = info.value.to_error()
    assert error.fatal
    assert error.code == code
    assert conn.send(error) == encode_frame(error)
    assert conn.our_state is State.CLOSED


def test_oversize_frame_is_refused_before_its_body_arrives() -> None:
    conn = Connection(Role.LISTENER, max_frame_bytes=1000)
    receive_all(conn, HELLO_FRAME)
    conn.receive_data((1001).to_bytes(4, "big"))
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_message()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_before_hello_only_a_header_sized_frame_is_buffered() -> None:
    """Issue 15 item 12: a member cannot make us buffer 64 MiB before it says Hello."""
    big = (MAX_PRE_HELLO_FRAME_BYTES + 1).to_bytes(4, "big")
    before = Connection(Role.LISTENER)
    before.receive_data(big)
    with pytest.raises(RemoteProtocolError) as info:
        before.next_message()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert "max_pre_hello_frame_bytes" in str(info.value)
    after = Connection(Role.LISTENER)
    receive_all(after, HELLO_FRAME)
    after.receive_data(big)
    assert after.next_message() is NEED_DATA  # the full limit applies once Hello arrived


def test_oversize_header_is_refused() -> None:
    conn = Connection(Role.LISTENER, max_header_bytes=200)
    receive_all(conn, HELLO_FRAME)
    conn.receive_data(raw_frame(heartbeat_header(node_id="x" * 300)))
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_message()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_peer_hello_with_another_version_is_refused() -> None:
    conn = Connection(Role.LISTENER)
    hello = dataclasses.replace(HELLO_A, protocol_version=2)
    conn.receive_data(raw_frame({**cbor2.loads(encode_frame(hello)[4:]), 1: 2}))
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_message()
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION
    assert "version 2" in str(info.value)


@pytest.mark.parametrize(
    "before",
    [[], [HELLO_A, Goodbye(node_id="node-a")], [HELLO_A, Error(code=1, message="x", fatal=True)]],
    ids=["before-hello", "after-goodbye", "after-fatal-error"],
)
def test_message_out_of_order_names_role_state_and_event(before: list[Any]) -> None:
    conn = Connection(Role.LISTENER)
    receive_all(conn, b"".join(encode_frame(m) for m in before))
    conn.receive_data(encode_frame(HEARTBEAT))
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_message()
    assert info.value.code is ErrorCode.OUT_OF_ORDER
    assert "dialer in state" in str(info.value)
    assert "Heartbeat" in str(info.value)


def test_listener_may_refuse_before_its_own_hello() -> None:
    conn = Connection(Role.LISTENER)
    conn.send(Error(code=ErrorCode.MESH_MISMATCH, message="other mesh", fatal=True))
    assert conn.our_state is State.CLOSED


@pytest.mark.parametrize(
    "sequence",
    [[HEARTBEAT], [HELLO_A, HELLO_A], [HELLO_A, Goodbye(node_id="a"), HEARTBEAT]],
    ids=["before-hello", "second-hello", "after-goodbye"],
)
def test_sending_out_of_order_is_a_local_error(sequence: list[Any]) -> None:
    conn = Connection(Role.DIALER)
    for msg in sequence[:-1]:
        conn.send(msg)
    with pytest.raises(LocalProtocolError) as info:
        conn.send(sequence[-1])
    assert info.value.code is ErrorCode.OUT_OF_ORDER
    assert conn.our_state is State.ERROR


def test_sending_an_oversize_frame_is_a_local_error() -> None:
    dialer, _ = open_pair()
    dialer.max_frame_bytes = 100
    with pytest.raises(LocalProtocolError) as info:
        dialer.send(activation(rows=8))
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_eof_at_a_frame_boundary_closes_cleanly() -> None:
    dialer, listener = open_pair()
    listener.receive_data(dialer.send(HEARTBEAT) + dialer.send(Goodbye(node_id="node-a")))
    listener.receive_data(b"")
    assert listener.next_message() == HEARTBEAT
    assert listener.next_message() == Goodbye(node_id="node-a")
    assert listener.next_message() is CONNECTION_CLOSED
    assert listener.their_state is State.CLOSED
    with pytest.raises(LocalProtocolError):
        listener.receive_data(b"more")


def test_eof_inside_a_frame_is_truncation() -> None:
    dialer, listener = open_pair()
    listener.receive_data(dialer.send(activation())[:-3])
    assert listener.next_message() is NEED_DATA
    listener.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as info:
        listener.next_message()
    assert info.value.code is ErrorCode.TRUNCATED_FRAME


def test_unknown_fields_are_ignored_and_missing_optional_fields_default() -> None:
    conn = Connection(Role.LISTENER)
    receive_all(conn, HELLO_FRAME)
    conn.receive_data(raw_frame({**heartbeat_header(added_in_v1_7="x"), 7: "future key"}))
    assert conn.next_message() == Heartbeat(node_id="n", nonce=1, sent_ns=2)


def test_features_are_the_intersection_of_both_hellos() -> None:
    dialer, listener = open_pair()
    assert dialer.features == listener.features == frozenset({"bf16"})
    assert dialer.their_hello == HELLO_B
    assert listener.their_hello == HELLO_A


def test_full_conversation_round_trips_in_memory() -> None:
    dialer, listener = open_pair()
    sent = [activation(rows=3), HEARTBEAT, Error(code=100, message="stale", term=1)]
    received = receive_all(listener, b"".join(dialer.send(m) for m in sent), chunk=5)
    assert received == sent


def test_decoded_payload_is_a_view_of_the_received_chunk() -> None:
    dialer, listener = open_pair()
    data = dialer.send(activation(rows=2))
    listener.receive_data(data)
    msg = listener.next_message()
    assert isinstance(msg, ActivationFrame)
    assert msg.payload is not None
    assert isinstance(msg.payload.data, memoryview)
    assert msg.payload.data.obj is data  # no copy: a window on the bytes we were handed


def test_large_frame_in_many_chunks() -> None:
    dialer, listener = open_pair()
    msg = activation(rows=64, hidden=512)
    assert receive_all(listener, dialer.send(msg), chunk=4096) == [msg]


def test_send_into_reuses_the_callers_buffer() -> None:
    dialer, listener = open_pair()
    buf = bytearray()
    msg = activation(rows=2)
    view = dialer.send_into(msg, buf)
    assert bytes(view) == encode_frame(msg)
    size = len(buf)
    view.release()
    smaller = activation(rows=1)
    view = dialer.send_into(smaller, buf)
    assert len(buf) == size  # fits: no growth, no new buffer
    assert bytes(view) == encode_frame(smaller)
    listener.receive_data(bytes(view))
    assert listener.next_message() == smaller


def test_to_error_frame_reaches_the_peer() -> None:
    dialer, listener = open_pair()
    listener.receive_data(b"\x00\x00\x00\x01\xff")
    with pytest.raises(RemoteProtocolError) as info:
        listener.next_message()
    dialer.receive_data(listener.send(info.value.to_error()))
    error = dialer.next_message()
    assert isinstance(error, Error)
    assert error.fatal
    assert error.code == ErrorCode.MALFORMED_FRAME
    assert dialer.their_state is State.CLOSED
