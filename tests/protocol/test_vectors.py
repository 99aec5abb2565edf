"""Golden frames in protocol/vectors/, checked both ways without regenerating them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from meshnode_protocol import (
    MESSAGE_TYPES,
    NEED_DATA,
    Connection,
    ErrorCode,
    Hello,
    Message,
    RemoteProtocolError,
    Role,
    State,
    decode_frame,
    encode_frame,
)
from meshnode_protocol.vectors import EXAMPLES, from_json, message_class, vector_document

from .helpers import HELLO_A, receive_all

VECTORS = Path(__file__).resolve().parents[2] / "protocol" / "vectors"
VECTOR_FILES = sorted(VECTORS.glob("*.json"))


def _load(path: Path) -> tuple[Message, bytes, dict[str, Any]]:
    doc = json.loads(path.read_text())
    msg = from_json(message_class(doc["message"]), doc["fields"])
    return msg, bytes.fromhex(doc["frame_hex"]), doc


def _receiver_for(msg: Message) -> tuple[Connection, bytes]:
    """A listener, plus the bytes that must precede ``msg`` (a Hello unless msg is one)."""
    conn = Connection(Role.LISTENER)
    return conn, b"" if isinstance(msg, Hello) else encode_frame(HELLO_A)


def test_every_message_type_has_a_vector() -> None:
    names = {json.loads(p.read_text())["message"] for p in VECTOR_FILES}
    assert names == {cls.__name__ for cls in MESSAGE_TYPES.values()}
    assert {p.stem for p in VECTOR_FILES} == set(EXAMPLES)


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_vector_encodes_to_its_bytes(path: Path) -> None:
    msg, frame, doc = _load(path)
    assert encode_frame(msg) == frame
    assert doc["type"] == msg.TYPE
    # The generator would write the same document today (catches stale files).
    assert vector_document(EXAMPLES[path.stem]) == doc


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_vector_decodes_to_its_message(path: Path) -> None:
    msg, frame, _ = _load(path)
    assert decode_frame(memoryview(frame)[4:]) == msg


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("chunk", [None, 1, 7], ids=["whole", "byte-by-byte", "7-bytes"])
def test_vector_through_a_connection(path: Path, chunk: int | None) -> None:
    msg, frame, _ = _load(path)
    conn, prefix = _receiver_for(msg)
    received = receive_all(conn, prefix + frame, chunk=chunk)
    assert received[-1] == msg
    assert conn.next_message() is NEED_DATA


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_vector_with_trailing_data(path: Path) -> None:
    """A frame followed by half of the next one decodes; the rest waits for more bytes."""
    msg, frame, _ = _load(path)
    conn, prefix = _receiver_for(msg)
    follow = EXAMPLES["heartbeat"]
    data = prefix + frame + encode_frame(follow)
    cut = len(data) - len(encode_frame(follow)) // 2
    received = receive_all(conn, data[:cut])
    assert received[-1] == msg
    conn.receive_data(data[cut:])
    if conn.their_state is State.CLOSED:  # Goodbye / fatal Error: nothing may follow
        with pytest.raises(RemoteProtocolError) as info:
            conn.next_message()
        assert info.value.code is ErrorCode.OUT_OF_ORDER
    else:
        assert conn.next_message() == follow
