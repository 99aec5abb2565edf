"""Golden frames at the edges of the spec: lenient encodings and malformed streams.

Two tables beside :data:`meshnode_protocol.vectors.EXAMPLES` (the canonical frames):

- :data:`LENIENT`: frames no conforming encoder writes but every decoder must accept
  (integers in float fields, short floats, any key order, unknown keys, defaults written
  out, non-preferred integer heads, indefinite lengths, nesting at the depth limit). Each
  decodes to a message, and that message re-encodes to its *canonical* frame.
- :data:`MALFORMED`: byte streams a receiver must refuse, with the ``ErrorCode`` each one
  must produce and how many messages decode before it. Several exist to pin the **order**
  of the checks (protocol/README.md §6) where one frame breaks two rules.

Headers are spelled out with :func:`cbor_map` (pairs in the given order, duplicates
allowed) so that a vector is exactly the bytes it claims, whatever cbor2 would write.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import cbor2

from meshnode_protocol._errors import ErrorCode
from meshnode_protocol._framing import MAX_FRAME_BYTES, MAX_PRE_HELLO_FRAME_BYTES, encode_frame
from meshnode_protocol._messages import (
    ActivationFrame,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    Sampling,
)
from meshnode_protocol.vector_json import to_json


def cbor_map(*pairs: tuple[Any, Any], head: bytes | None = None) -> bytes:
    """A CBOR map of ``pairs`` in this order (each key and value encoded by cbor2).

    ``head`` replaces the map's initial byte(s), e.g. ``b"\\xbf"`` for an indefinite-length
    map (the caller then appends the ``0xff`` break).
    """
    body = b"".join(
        cbor2.dumps(k) + (v if isinstance(v, Raw) else cbor2.dumps(v)) for k, v in pairs
    )
    return (_map_head(len(pairs)) if head is None else head) + body


class Raw(bytes):
    """A value already encoded as CBOR (written as is by :func:`cbor_map`)."""


def _map_head(count: int) -> bytes:
    assert count < 24  # the vectors' maps are small: one-byte head
    return bytes([0xA0 | count])


def frame(header: bytes, payload: bytes = b"") -> bytes:
    """Length prefix + ``header`` + ``payload``."""
    return (len(header) + len(payload)).to_bytes(4, "big") + header + payload


# -- the messages the edge vectors are built around ------------------------------------------

HELLO: Final = Hello(
    node_id="node-a",
    mesh_id_hash="5d41402abc4b2a76",
    listen_address="10.0.0.1:7420",
    device_kind="cpu",
    usable_memory=1 << 30,
)
BEAT: Final = Heartbeat(node_id="node-a", nonce=17, sent_ns=1_000_000_123)
_BEAT_PAIRS: Final = (
    (0, 3),
    (1, 1),
    ("node_id", "node-a"),
    ("nonce", 17),
    ("sent_ns", 1_000_000_123),
)


def _beat(*changes: tuple[Any, Any], drop: str = "") -> bytes:
    """The Heartbeat header with keys replaced (in place) or appended, one key dropped."""
    pairs = [p for p in _BEAT_PAIRS if p[0] != drop]
    for key, value in changes:
        index = next((i for i, p in enumerate(pairs) if p[0] == key), None)
        if index is None:
            pairs.append((key, value))
        else:
            pairs[index] = (key, value)
    return frame(cbor_map(*pairs))


_ACT_PAIRS: Final = (
    (0, 30),
    (1, 1),
    ("request_id", "req-1"),
    ("run_id", "run-7f3a"),
    ("term", 3),
    ("kind", "decode"),
    ("start_pos", 9),
    ("tokens", [42]),
)
_ACT: Final = ActivationFrame(
    request_id="req-1", run_id="run-7f3a", term=3, kind="decode", start_pos=9, tokens=(42,)
)


def _act(*extra: tuple[Any, Any], payload: bytes = b"") -> bytes:
    return frame(cbor_map(*_ACT_PAIRS, *extra), payload)


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


# -- lenient: accepted, then re-encoded canonically -------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Lenient:
    """A non-canonical ``frame`` that decodes to ``message`` (which encodes canonically)."""

    description: str
    frame: bytes
    message: Message


LENIENT: Final[dict[str, Lenient]] = {
    "int_in_float": Lenient(
        "integers in float fields are floats: temperature 0 is 0.0 (written back as float64), "
        "top_p 1 is 1.0, its default (left out when written back)",
        _act(("sampling", {"temperature": 0, "top_p": 1})),
        dataclasses.replace(_ACT, sampling=Sampling(temperature=0.0)),
    ),
    "short_floats": Lenient(
        "floats of any width: temperature as float16 0.5, top_p as float32 0.25",
        _act(
            (
                "sampling",
                Raw(
                    bytes.fromhex("a2")
                    + cbor2.dumps("temperature")
                    + bytes.fromhex("f93800")
                    + cbor2.dumps("top_p")
                    + bytes.fromhex("fa3e800000")
                ),
            )
        ),
        dataclasses.replace(_ACT, sampling=Sampling(temperature=0.5, top_p=0.25)),
    ),
    "any_key_order_and_unknown_keys": Lenient(
        "keys in reverse order, an unknown integer key (7) and an unknown field name: ignored",
        frame(cbor_map(*reversed(_BEAT_PAIRS), (7, "x"), ("future_field", [1, {"a": None}]))),
        BEAT,
    ),
    "defaults_written": Lenient(
        "fields holding their default may be written (null echo fields here): same message",
        _beat(("echo_nonce", None), ("echo_sent_ns", None)),
        BEAT,
    ),
    "non_preferred_heads": Lenient(
        "integers and lengths in longer heads than needed (17 as 1a00000011, a map of 5 as "
        "b8 05): accepted, written back in the shortest form",
        frame(
            bytes.fromhex("b805")
            + cbor_map(
                *_BEAT_PAIRS[:3], ("nonce", Raw(bytes.fromhex("1a00000011"))), _BEAT_PAIRS[4]
            )[1:]
        ),
        BEAT,
    ),
    "indefinite_lengths": Lenient(
        "an indefinite-length header map, tokens array and text string",
        frame(
            cbor_map(
                *_ACT_PAIRS[:2],
                ("request_id", Raw(bytes.fromhex("7f6372657162") + b"-1" + b"\xff")),
                *_ACT_PAIRS[3:7],
                ("tokens", Raw(bytes.fromhex("9f182aff"))),
                head=b"\xbf",
            )
            + b"\xff"
        ),
        _ACT,
    ),
    "depth_limit": Lenient(
        "an unknown field nested to the limit: its innermost item has 6 enclosing containers "
        "(the header map and 5 arrays)",
        _beat(("future_field", _nested(5))),
        BEAT,
    ),
}


# -- malformed: refused with a code ---------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Malformed:
    """A byte stream that must fail with ``error`` after ``messages_before`` messages."""

    description: str
    stream: bytes
    error: ErrorCode
    messages_before: int = 1
    eof: bool = False


_HELLO_FRAME: Final = encode_frame(HELLO)
_BEAT_FRAME: Final = encode_frame(BEAT)
_MALFORMED = ErrorCode.MALFORMED_FRAME
_INVALID = ErrorCode.INVALID_FIELD
_TOO_LARGE = ErrorCode.FRAME_TOO_LARGE


def _after_hello(description: str, data: bytes, error: ErrorCode) -> Malformed:
    return Malformed(description, _HELLO_FRAME + data, error)


_F16_PAYLOAD: Final = {"dtype": "f16", "shape": [1, 2], "nbytes": 4}

MALFORMED: Final[dict[str, Malformed]] = {
    "frame_too_large": _after_hello(
        "length prefix MAX_FRAME_BYTES + 1: refused as soon as the 4 length bytes arrive",
        (MAX_FRAME_BYTES + 1).to_bytes(4, "big"),
        _TOO_LARGE,
    ),
    "pre_hello_frame_too_large": Malformed(
        "before the peer's Hello the limit is MAX_PRE_HELLO_FRAME_BYTES (64 KiB)",
        (MAX_PRE_HELLO_FRAME_BYTES + 1).to_bytes(4, "big"),
        _TOO_LARGE,
        messages_before=0,
    ),
    "truncated_frame": Malformed(
        "the stream ends 3 bytes before the end of a frame",
        _HELLO_FRAME + _BEAT_FRAME[:-3],
        ErrorCode.TRUNCATED_FRAME,
        eof=True,
    ),
    "not_cbor": _after_hello(
        "the header is not CBOR (a lone break byte)", frame(b"\xff"), _MALFORMED
    ),
    "empty_frame": _after_hello("a frame of length 0 has no header", frame(b""), _MALFORMED),
    "header_not_a_map": _after_hello(
        "the header is an array", frame(cbor2.dumps([3, 1])), _MALFORMED
    ),
    "no_type_key": _after_hello(
        "the header lacks key 0", frame(cbor_map(*_BEAT_PAIRS[1:])), _MALFORMED
    ),
    "type_not_an_int": _after_hello('the type tag is the text "3"', _beat((0, "3")), _MALFORMED),
    "bool_version_key": _after_hello(
        "key 1 written as `true` (equal to 1 in some languages): keys 0 and 1 are integers",
        frame(cbor_map(*[(True if k == 1 else k, v) for k, v in _BEAT_PAIRS])),
        _MALFORMED,
    ),
    "cbor_tag": _after_hello(
        "a tagged item (tag 1, epoch time) as a field value",
        _beat(("sent_ns", cbor2.CBORTag(1, 1_000_000_123))),
        _MALFORMED,
    ),
    "bignum": _after_hello(
        "an integer wider than 64 bits needs a bignum tag (2): tags are malformed",
        _beat(("nonce", 2**70)),
        _MALFORMED,
    ),
    "duplicate_key": _after_hello(
        'the field name "nonce" twice in one map',
        frame(cbor_map(*_BEAT_PAIRS, ("nonce", 18))),
        _MALFORMED,
    ),
    "too_deep": _after_hello(
        "an unknown field whose innermost item has 7 enclosing containers (limit 6)",
        _beat(("future_field", _nested(6))),
        _MALFORMED,
    ),
    "undescribed_payload": _after_hello(
        "2 payload bytes after a header that describes no tensor",
        frame(cbor_map(*_BEAT_PAIRS), b"xx"),
        _MALFORMED,
    ),
    "unknown_type": _after_hello(
        "type tag 99", frame(cbor_map((0, 99), (1, 1))), ErrorCode.UNKNOWN_MESSAGE_TYPE
    ),
    "unknown_type_before_version": _after_hello(
        "type 99 and version 2: the type is checked first",
        frame(cbor_map((0, 99), (1, 2))),
        ErrorCode.UNKNOWN_MESSAGE_TYPE,
    ),
    "unsupported_version": _after_hello(
        "a Heartbeat with header version 2", _beat((1, 2)), ErrorCode.UNSUPPORTED_VERSION
    ),
    "version_before_fields": _after_hello(
        "header version 2 and a bad field: the version is checked first",
        _beat((1, 2), ("nonce", "x")),
        ErrorCode.UNSUPPORTED_VERSION,
    ),
    "hello_other_version": Malformed(
        "a Hello (header version 2, protocol_version 2) is decoded, then refused by version",
        frame(
            cbor_map(
                (0, 1),
                (1, 2),
                ("protocol_version", 2),
                ("node_id", "node-z"),
                ("mesh_id_hash", "5d41402abc4b2a76"),
                ("listen_address", "10.0.0.9:7420"),
                ("device_kind", "cpu"),
                ("usable_memory", 0),
            )
        ),
        ErrorCode.UNSUPPORTED_VERSION,
        messages_before=0,
    ),
    "missing_required_field": _after_hello(
        "a Heartbeat without nonce", _beat(drop="nonce"), _INVALID
    ),
    "wrong_cbor_type": _after_hello("nonce as text", _beat(("nonce", "17")), _INVALID),
    "bool_for_int": _after_hello("nonce as `true`", _beat(("nonce", True)), _INVALID),
    "int_below_int64": _after_hello(
        "nonce (a signed 64-bit field) = -2**63 - 1", _beat(("nonce", -(2**63) - 1)), _INVALID
    ),
    "int_above_int64": _after_hello(
        "sent_ns (a signed 64-bit field) = 2**63", _beat(("sent_ns", 2**63)), _INVALID
    ),
    "negative_uint": _after_hello(
        "term (an unsigned field) = -1",
        frame(cbor_map((0, 32), (1, 1), ("request_id", "r"), ("run_id", "x"), ("term", -1))),
        _INVALID,
    ),
    "float_for_int": _after_hello("nonce as 17.0", _beat(("nonce", 17.0)), _INVALID),
    "record_not_a_map": _after_hello("sampling as an array", _act(("sampling", [0.5])), _INVALID),
    "record_value_rule": _after_hello(
        "sampling.top_p = 0 (must be in (0, 1])", _act(("sampling", {"top_p": 0.0})), _INVALID
    ),
    "cross_field_rule": _after_hello(
        "out_rows 2 on a frame of 1 row", _act(("out_rows", 2)), _INVALID
    ),
    "resume_on_a_decode_frame": _after_hello(
        "resume_starts on a decode frame (a prompt's frames only say where later stages start)",
        _act(("resume_starts", [9]), ("resume_keys", [""])),
        _INVALID,
    ),
    "bad_tensor_dtype": _after_hello(
        "a payload descriptor with dtype f64",
        _act(("payload", {"dtype": "f64", "shape": [1, 1], "nbytes": 8}), payload=bytes(8)),
        _INVALID,
    ),
    "tensor_nbytes_disagrees": _after_hello(
        "nbytes 5 for an f16 [1, 2] tensor",
        _act(("payload", {**_F16_PAYLOAD, "nbytes": 5}), payload=bytes(5)),
        _INVALID,
    ),
    "tensor_beyond_payload": _after_hello(
        "a 4-byte tensor with 2 payload bytes",
        _act(("payload", _F16_PAYLOAD), payload=bytes(2)),
        _INVALID,
    ),
    "field_before_payload_length": _after_hello(
        "a bad field and undescribed payload bytes: fields are checked first",
        frame(cbor_map(*_BEAT_PAIRS[:3], ("nonce", "x"), _BEAT_PAIRS[4]), b"xx"),
        _INVALID,
    ),
    # -- the four points two implementers could read two ways (README §2, §5, §6) --------
    "negative_type": _after_hello(
        "type tag -3 (a CBOR negative integer): an integer, but no message type",
        _beat((0, -3)),
        ErrorCode.UNKNOWN_MESSAGE_TYPE,
    ),
    "negative_version": _after_hello(
        "a Heartbeat with header version -1: an integer, but not our version",
        _beat((1, -1)),
        ErrorCode.UNSUPPORTED_VERSION,
    ),
    "true_key_beside_version": _after_hello(
        "a key `true` beside keys 0 and 1 (true equals 1 in some languages): malformed",
        _beat((True, 5)),
        _MALFORMED,
    ),
    "float_key_beside_type": _after_hello(
        "a key 0.0 beside keys 0 and 1: a float key equal to 0 or 1 is malformed",
        _beat((0.0, 5)),
        _MALFORMED,
    ),
    "version_checked_after_an_error": Malformed(
        "an Error of header version 2 is decoded (Error is exempt); a Heartbeat of version "
        "2 after it is not",
        _HELLO_FRAME
        + frame(cbor_map((0, 4), (1, 2), ("code", 108), ("message", "x")))
        + _beat((1, 2)),
        ErrorCode.UNSUPPORTED_VERSION,
        messages_before=2,
    ),
    "batch_repeats_a_request": _after_hello(
        "an ActivationBatch with two frames of one request_id: a batch rule is the codec's",
        frame(
            cbor_map(
                (0, 33),
                (1, 1),
                ("run_id", "run-7f3a"),
                ("term", 3),
                ("frames", [dict(_ACT_PAIRS[2:]), dict(_ACT_PAIRS[2:])]),
            )
        ),
        _INVALID,
    ),
    "message_before_hello": Malformed(
        "a Heartbeat as the first frame", _BEAT_FRAME, ErrorCode.OUT_OF_ORDER, messages_before=0
    ),
    "malformed_before_hello": Malformed(
        "a malformed first frame is MALFORMED_FRAME, not OUT_OF_ORDER: decoding comes first",
        frame(b"\xff"),
        _MALFORMED,
        messages_before=0,
    ),
    "second_hello": _after_hello("Hello twice", _HELLO_FRAME, ErrorCode.OUT_OF_ORDER),
    "frame_after_goodbye": Malformed(
        "a Heartbeat after the peer's Goodbye",
        _HELLO_FRAME + encode_frame(Goodbye(node_id="node-a")) + _BEAT_FRAME,
        ErrorCode.OUT_OF_ORDER,
        messages_before=2,
    ),
    "frame_after_fatal_error": Malformed(
        "a Heartbeat after the peer's fatal Error",
        _HELLO_FRAME + encode_frame(Error(code=6, message="x", fatal=True)) + _BEAT_FRAME,
        ErrorCode.OUT_OF_ORDER,
        messages_before=2,
    ),
}


def lenient_document(vector: Lenient) -> dict[str, Any]:
    """The JSON document stored for one lenient vector."""
    msg = vector.message
    return {
        "description": vector.description,
        "message": type(msg).__name__,
        "type": msg.TYPE,
        "fields": to_json(msg),
        "frame_hex": vector.frame.hex(),
        "canonical_hex": encode_frame(msg).hex(),
    }


def malformed_document(vector: Malformed) -> dict[str, Any]:
    """The JSON document stored for one malformed vector."""
    return {
        "description": vector.description,
        "stream_hex": vector.stream.hex(),
        "eof": vector.eof,
        "messages_before": vector.messages_before,
        "error": vector.error.name,
        "code": int(vector.error),
    }


__all__ = ["LENIENT", "MALFORMED", "Lenient", "Malformed", "lenient_document", "malformed_document"]
