"""Fuzzing the decoder: random and mutated frames raise RemoteProtocolError and nothing else."""

from __future__ import annotations

import cbor2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshnode_protocol import (
    CONNECTION_CLOSED,
    MESSAGE_TYPES,
    NEED_DATA,
    Connection,
    Message,
    RemoteProtocolError,
    Role,
    encode_frame,
)
from meshnode_protocol._fields import compile_fields
from meshnode_protocol.vectors import EXAMPLES

from .helpers import HELLO_A
from .strategies import any_message

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID_FRAMES = [encode_frame(m) for m in EXAMPLES.values()]


def drain(data: bytes, chunk: int) -> None:
    """Feed ``data`` then EOF after a Hello; only RemoteProtocolError may escape."""
    conn = Connection(Role.LISTENER, max_frame_bytes=1 << 16)
    conn.receive_data(encode_frame(HELLO_A))
    assert isinstance(conn.next_message(), Message)
    try:
        for start in range(0, len(data), chunk):
            conn.receive_data(data[start : start + chunk])
            while isinstance(conn.next_message(), Message):
                pass
        conn.receive_data(b"")
        while (msg := conn.next_message()) is not CONNECTION_CLOSED:
            assert msg is not NEED_DATA  # after EOF the decoder never waits
    except RemoteProtocolError:
        pass


def framed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    frame = bytearray(draw(st.sampled_from(VALID_FRAMES) | any_message.map(encode_frame)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "relength"]))
        at = draw(st.integers(0, max(len(frame) - 1, 0)))
        if op == "flip" and frame:
            frame[at] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del frame[at:]
        elif op == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del frame[at : at + draw(st.integers(1, 8))]
        elif op == "relength" and len(frame) >= 4:
            frame[0:4] = (len(frame) - 4 + draw(st.integers(-8, 8))).to_bytes(4, "big", signed=True)
    return bytes(frame)


@FUZZ
@given(st.binary(max_size=256), st.integers(1, 32))
def test_random_bytes(data: bytes, chunk: int) -> None:
    drain(data, chunk)


@FUZZ
@given(st.binary(max_size=256), st.integers(1, 32))
def test_random_bodies_with_a_valid_length(body: bytes, chunk: int) -> None:
    drain(framed(body), chunk)


@FUZZ
@given(st.lists(mutated_frames(), min_size=1, max_size=3), st.integers(1, 64))
def test_mutated_frames(frames: list[bytes], chunk: int) -> None:
    drain(b"".join(frames), chunk)


any_cbor = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.integers(0, 3) | st.text(max_size=6), inner, max_size=6),
    max_leaves=20,
)  # fmt: skip


FIELD_NAMES = sorted({f.name for cls in MESSAGE_TYPES.values() for f in compile_fields(cls)})
field_maps = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), any_cbor)


@FUZZ
@given(st.integers(0, 40), any_cbor, field_maps)
def test_well_formed_cbor_with_wrong_contents(
    tag: int, version: object, fields: dict[str, object]
) -> None:
    """Valid CBOR maps with a plausible type tag, real field names and arbitrary values."""
    header: dict[object, object] = {0: tag, 1: version}
    header.update(fields)
    drain(framed(cbor2.dumps(header)), 1 << 16)
    drain(framed(cbor2.dumps({**header, 1: 1})), 1 << 16)
