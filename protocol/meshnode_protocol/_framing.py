"""Framing: ``u32 length | CBOR header | raw payload``, its limits, and the receive buffer.

``length`` (big-endian) counts the header and the payload. The header is one CBOR map::

    {0: type tag (uint), 1: protocol version (uint), "field": value, ...}

Tensor-valued fields appear in the header as ``{"dtype", "shape", "nbytes"}`` descriptors;
their bytes follow the header, concatenated in field order, and the payload length
(``length`` minus the header's encoded length) must equal the sum of their ``nbytes``.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Final

import cbor2

from meshnode_protocol._errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from meshnode_protocol._fields import Payload, WireError, decode_fields, encode_fields
from meshnode_protocol._messages import MESSAGE_TYPES, PROTOCOL_VERSION, Error, Hello, Message
from meshnode_protocol._tensor import Tensor

MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
"""Largest frame (header + payload) accepted or sent: 64 MiB.

The biggest legitimate frame is a prefill chunk of activations: 2048 tokens of an
8192-wide model in f16 is 32 MiB, so 64 MiB leaves 2x headroom (f32 on the wire, or a
16384-wide model); senders split longer prompts into chunks. The bound is also what one
hostile or broken peer can make us buffer per connection before we refuse it.
"""

MAX_HEADER_BYTES: Final = 64 * 1024
"""Largest CBOR header: 64 KiB.

Headers are decoded into Python objects, so this bounds the work one frame can cost apart
from its raw payload. The largest legitimate header is a ``Hello`` listing known peers
(~100 bytes each: 600 peers fit) or a ``Prediction`` with logprobs (9 bytes a token).
"""

MAX_HEADER_DEPTH: Final = 6
"""Containers (arrays and maps) that may enclose any item of a header, the header map included.

The deepest legitimate item is a log-probability in ``Prediction.top_logprobs``: header map
→ ``top_logprobs`` array → ``TopLogprobs`` map → ``logprobs`` array → float, 4 enclosing
containers. 6 leaves room for one more level of records in a later version while keeping
a hostile header from recursing the decoder. (cbor2's ``max_depth`` counts the same way.)
"""

MAX_PRE_HELLO_FRAME_BYTES: Final = MAX_HEADER_BYTES
"""Largest frame accepted from a peer before its ``Hello``: 64 KiB, not ``MAX_FRAME_BYTES``.

The only messages legal before ``Hello`` are ``Hello`` and a fatal ``Error``, neither of
which carries a tensor, so such a frame is all header. Any TLS-authenticated member could
otherwise make every node it dials buffer a 64 MiB frame per connection before saying who
it is.
"""

LENGTH: Final = struct.Struct(">I")
KEY_TYPE: Final = 0
KEY_VERSION: Final = 1


def encode_header(msg: Message, tensors: list[Tensor]) -> bytes:
    """The CBOR header of ``msg``; its tensors are appended to ``tensors`` in wire order."""
    header: dict[Any, Any] = {KEY_TYPE: msg.TYPE, KEY_VERSION: PROTOCOL_VERSION}
    return cbor2.dumps(encode_fields(msg, tensors, header))


def header_size(msg: Message) -> int:
    """Bytes of ``msg``'s CBOR header: what must stay within ``MAX_HEADER_BYTES``."""
    return len(encode_header(msg, []))


def frame_length(header: bytes, tensors: list[Tensor], max_frame_bytes: int) -> int:
    """The value of the length prefix; raises ``LocalProtocolError`` past either limit
    (a header the peer would refuse is never sent)."""
    if len(header) > MAX_HEADER_BYTES:
        raise LocalProtocolError(
            f"header of {len(header)} bytes exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}; "
            "split the batch (or ask for fewer top_logprobs)",
            ErrorCode.FRAME_TOO_LARGE,
        )
    length = len(header)
    for tensor in tensors:
        length += tensor.nbytes
    if length > max_frame_bytes:
        raise LocalProtocolError(
            f"frame of {length} bytes exceeds max_frame_bytes={max_frame_bytes}; "
            "split the prefill into smaller chunks",
            ErrorCode.FRAME_TOO_LARGE,
        )
    return length


def _reject_tag(*_: object) -> Any:
    raise cbor2.CBORDecodeError("CBOR tags are not used by this protocol")


# Every tag, built-in or not, is refused: headers carry only plain CBOR (so a hostile header
# cannot make the decoder build datetimes, regexes, shared references or bignums).
_NO_TAGS: Final = dict.fromkeys(range(65536), _reject_tag)


def encode_frame(msg: Message, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """One complete frame for ``msg`` (length prefix included), outside any connection.

    ``Connection.send`` adds the state machine on top; this is for tests, vectors and tools.
    Raises ``LocalProtocolError`` past ``max_frame_bytes``.
    """
    tensors: list[Tensor] = []
    header = encode_header(msg, tensors)
    length = frame_length(header, tensors, max_frame_bytes)
    return b"".join([LENGTH.pack(length), header, *(t.data for t in tensors)])


def decode_frame(frame: memoryview, max_header_bytes: int = MAX_HEADER_BYTES) -> Message:
    """Decode one frame (without its length prefix); tensors view ``frame`` without copying.

    Raises ``RemoteProtocolError`` with the matching ``ErrorCode``.
    """
    header, header_len = _decode_header(frame, max_header_bytes)
    cls = _message_class(header)
    payload = Payload(frame[header_len:])
    try:
        msg: Message = decode_fields(cls, header, payload)
    except WireError as exc:
        raise RemoteProtocolError(str(exc), ErrorCode.INVALID_FIELD) from None
    if payload.offset != len(payload.view):
        raise RemoteProtocolError(
            f"{cls.__name__} frame has {len(payload.view) - payload.offset} payload bytes "
            "that no tensor describes",
            ErrorCode.MALFORMED_FRAME,
        )
    return msg


def _decode_header(frame: memoryview, max_header_bytes: int) -> tuple[dict[Any, Any], int]:
    # Only the header's possible extent is copied; the payload stays a view of the frame.
    fp = io.BytesIO(frame[:max_header_bytes])
    decoder = cbor2.CBORDecoder(
        fp,
        max_depth=MAX_HEADER_DEPTH,
        allow_duplicate_keys=False,
        tag_hook=_reject_tag,
        semantic_decoders=_NO_TAGS,
    )
    try:
        header = decoder.decode()
    except Exception as exc:  # cbor2 raises several types for bad input; all mean "malformed"
        if len(frame) > max_header_bytes and isinstance(exc, cbor2.CBORDecodeEOF):
            raise RemoteProtocolError(
                f"frame header exceeds max_header_bytes={max_header_bytes}",
                ErrorCode.FRAME_TOO_LARGE,
            ) from None
        raise RemoteProtocolError(f"bad CBOR header: {exc}", ErrorCode.MALFORMED_FRAME) from None
    if type(header) is not dict:
        raise RemoteProtocolError("frame header is not a CBOR map", ErrorCode.MALFORMED_FRAME)
    return header, fp.tell()


def _message_class(header: dict[Any, Any]) -> type[Message]:
    tag, version = header.get(KEY_TYPE), header.get(KEY_VERSION)
    # `true`, `0.0` or `1.0` as keys compare equal to the integers 0 and 1 in Python; the
    # spec makes the keys integers, so an impostor key is malformed, not a type or version.
    wrong_keys = [k for k in header if type(k) is not int and type(k) is not str and k in (0, 1)]
    if wrong_keys or type(tag) is not int or type(version) is not int:
        raise RemoteProtocolError(
            "frame header lacks an integer type (key 0) and version (key 1)",
            ErrorCode.MALFORMED_FRAME,
        )
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {tag}", ErrorCode.UNKNOWN_MESSAGE_TYPE)
    # Hello and Error keep their layout in every version, so that a version mismatch is
    # reported (by the Hello check, or by the peer's Error) rather than misparsed.
    if version != PROTOCOL_VERSION and cls not in (Hello, Error):
        raise RemoteProtocolError(
            f"{cls.__name__} frame has version {version}; this side speaks {PROTOCOL_VERSION}",
            ErrorCode.UNSUPPORTED_VERSION,
        )
    return cls


class ReceiveBuffer:
    """Bytes received but not yet framed, kept as the chunks the transport handed us.

    A frame that lies within one chunk is returned as a view of that chunk (no copy: the
    usual case for activations). Chunks are joined only once a whole frame has arrived, so
    a large frame arriving in many pieces costs one copy, not one per piece.
    """

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._offset = 0  # consumed bytes of _chunks[0]
        self._size = 0  # unconsumed bytes in all chunks

    def __len__(self) -> int:
        return self._size

    def append(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._size += len(data)

    def peek_length(self) -> int | None:
        """The next frame's length prefix, or ``None`` until 4 bytes have arrived."""
        if self._size < LENGTH.size:
            return None
        self._gather(LENGTH.size)
        (length,) = LENGTH.unpack_from(self._chunks[0], self._offset)
        return int(length)

    def take(self, nbytes: int) -> memoryview:
        """Remove and return the next ``nbytes`` (the caller checked they have arrived)."""
        self._gather(nbytes)
        view = memoryview(self._chunks[0])[self._offset : self._offset + nbytes]
        self._offset += nbytes
        self._size -= nbytes
        if self._offset == len(self._chunks[0]):
            del self._chunks[0]
            self._offset = 0
        return view

    def _gather(self, nbytes: int) -> None:
        # Make the first chunk hold at least nbytes unconsumed bytes.
        first = self._chunks[0]
        if len(first) - self._offset >= nbytes:
            return
        parts, have = [memoryview(first)[self._offset :]], len(first) - self._offset
        count = 1
        while have < nbytes:
            parts.append(memoryview(self._chunks[count]))
            have += len(self._chunks[count])
            count += 1
        self._chunks[:count] = [b"".join(parts)]
        self._offset = 0
