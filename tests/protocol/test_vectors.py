"""Golden frames in protocol/vectors/, checked both ways without regenerating them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from meshnode_protocol import (
    CONNECTION_CLOSED,
    DEFAULT_FEATURES,
    MESSAGE_TYPES,
    NEED_DATA,
    ActivationFrame,
    Connection,
    ErrorCode,
    Hello,
    Message,
    Prediction,
    RemoteProtocolError,
    Role,
    State,
    Tensor,
    decode_frame,
    encode_frame,
)
from meshnode_protocol.vector_json import from_json, message_class
from meshnode_protocol.vectors import EXAMPLES, all_documents, vector_document

from .helpers import HELLO_A, receive_all

VECTORS = Path(__file__).resolve().parents[2] / "protocol" / "vectors"
VECTOR_FILES = sorted(VECTORS.glob("*.json"))
LENIENT_FILES = sorted((VECTORS / "lenient").glob("*.json"))
MALFORMED_FILES = sorted((VECTORS / "malformed").glob("*.json"))


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


def test_vector_files_are_what_the_generator_writes() -> None:
    """No file is stale, missing or left over (lenient/ and malformed/ included)."""
    on_disk = {
        str(p.relative_to(VECTORS)): json.loads(p.read_text()) for p in VECTORS.rglob("*.json")
    }
    assert on_disk == all_documents()


def test_vectors_cover_the_shapes_a_second_implementation_must_get_right() -> None:
    """Shapes the first 23 vectors missed: each is in a canonical vector (issue 15)."""
    msgs = list(EXAMPLES.values())
    assert any(isinstance(m, Prediction) and m.top_logprobs for m in msgs)
    assert any(isinstance(m, Hello) and m.features != DEFAULT_FEATURES for m in msgs)
    assert any(
        isinstance(m, ActivationFrame)
        and isinstance(m.draft_probs, Tensor)
        and m.draft_probs.dtype == "f16"
        for m in msgs
    )
    lenient = {json.loads(p.read_text())["frame_hex"] for p in LENIENT_FILES}
    assert len(lenient) == len(LENIENT_FILES) >= 7


@pytest.mark.parametrize("path", LENIENT_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "byte-by-byte"])
def test_lenient_vector_decodes_and_reencodes_canonically(path: Path, chunk: int | None) -> None:
    doc = json.loads(path.read_text())
    msg = from_json(message_class(doc["message"]), doc["fields"])
    frame, canonical = bytes.fromhex(doc["frame_hex"]), bytes.fromhex(doc["canonical_hex"])
    assert frame != canonical
    assert decode_frame(memoryview(frame)[4:]) == msg
    conn, prefix = _receiver_for(msg)
    assert receive_all(conn, prefix + frame, chunk=chunk)[-1] == msg
    assert encode_frame(msg) == canonical
    assert decode_frame(memoryview(canonical)[4:]) == msg


def _feed_until_error(
    conn: Connection, stream: bytes, chunk: int | None, eof: bool
) -> tuple[list[Message], RemoteProtocolError | None]:
    """Feed ``stream`` (then EOF if ``eof``); the messages decoded and the error, if any."""
    received: list[Message] = []
    step = chunk or len(stream)
    try:
        for start in range(0, len(stream), step):
            conn.receive_data(stream[start : start + step])
            while (msg := conn.next_message()) is not NEED_DATA:
                assert isinstance(msg, Message)
                received.append(msg)
        if eof:
            conn.receive_data(b"")
            assert conn.next_message() is CONNECTION_CLOSED
    except RemoteProtocolError as exc:
        return received, exc
    return received, None


@pytest.mark.parametrize("path", MALFORMED_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "byte-by-byte"])
def test_malformed_vector_fails_with_its_code(path: Path, chunk: int | None) -> None:
    doc = json.loads(path.read_text())
    conn = Connection(Role.LISTENER)
    received, error = _feed_until_error(conn, bytes.fromhex(doc["stream_hex"]), chunk, doc["eof"])
    assert error is not None, "the stream was accepted"
    assert len(received) == doc["messages_before"]
    assert error.code is ErrorCode[doc["error"]]
    assert error.code == doc["code"]
    assert conn.their_state is State.ERROR
