"""``Connection``: the sans-IO codec. Bytes in, messages out; messages in, bytes out.

It never touches a socket (``meshnode.net`` moves the bytes), so it is tested by feeding it
bytes. The transport's loop is::

    conn.receive_data(await stream.receive_some())     # b"" at EOF
    while (msg := conn.next_message()) is not NEED_DATA:
        if msg is CONNECTION_CLOSED: ...; break
        handle(msg)

and on ``RemoteProtocolError as exc``: ``await stream.send_all(conn.send(exc.to_error()))``,
then close that stream.
"""

from __future__ import annotations

import enum
from typing import Final, Literal

from meshnode_protocol._errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from meshnode_protocol._framing import (
    LENGTH,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_PRE_HELLO_FRAME_BYTES,
    ReceiveBuffer,
    decode_frame,
    encode_header,
    frame_length,
)
from meshnode_protocol._messages import DEFAULT_FEATURES, PROTOCOL_VERSION, Error, Hello, Message
from meshnode_protocol._state import ConnectionState, Role, State
from meshnode_protocol._tensor import Tensor


class Signal(enum.Enum):
    """Non-message results of ``Connection.next_message``."""

    NEED_DATA = "NEED_DATA"
    CONNECTION_CLOSED = "CONNECTION_CLOSED"


NEED_DATA: Final = Signal.NEED_DATA
"""``next_message`` needs more bytes: call ``receive_data`` first."""

CONNECTION_CLOSED: Final = Signal.CONNECTION_CLOSED
"""The peer's stream ended at a frame boundary; nothing more will arrive."""

NeedData = Literal[Signal.NEED_DATA]
ConnectionClosed = Literal[Signal.CONNECTION_CLOSED]


class Connection:
    """One end of a meshnode connection (see the module docstring for the loop).

    ``our_role`` labels our side in error messages (the state machine is symmetric).
    ``max_frame_bytes`` bounds every frame in both directions; ``max_header_bytes`` bounds
    the CBOR header of received frames; ``max_pre_hello_frame_bytes`` bounds the frames
    received before the peer's ``Hello`` (header-only messages).
    """

    def __init__(
        self,
        our_role: Role = Role.DIALER,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_pre_hello_frame_bytes: int = MAX_PRE_HELLO_FRAME_BYTES,
    ) -> None:
        self.our_role = our_role
        self.their_role = our_role.peer
        self.max_frame_bytes = max_frame_bytes
        self.max_header_bytes = max_header_bytes
        self.max_pre_hello_frame_bytes = max_pre_hello_frame_bytes
        self.our_hello: Hello | None = None
        self.their_hello: Hello | None = None
        self._state = ConnectionState()
        self._buffer = ReceiveBuffer()
        self._eof = False
        self._error: RemoteProtocolError | None = None

    # -- introspection -------------------------------------------------------------------

    @property
    def our_state(self) -> State:
        """Our side's state."""
        return self._state.states[self.our_role]

    @property
    def their_state(self) -> State:
        """The peer's side's state."""
        return self._state.states[self.their_role]

    @property
    def features(self) -> frozenset[str]:
        """Features both Hellos offered (empty until both have been exchanged)."""
        if self.our_hello is None or self.their_hello is None:
            return frozenset()
        return frozenset(self.our_hello.features) & frozenset(self.their_hello.features)

    # -- receiving -----------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes from the peer; ``b""`` means the stream ended (EOF).

        Raises ``LocalProtocolError`` when called with data after EOF.
        """
        if self._eof and data:
            raise LocalProtocolError("received data after EOF")
        if not data:
            self._eof = True
            return
        self._buffer.append(data if isinstance(data, bytes) else bytes(data))

    def next_message(self) -> Message | NeedData | ConnectionClosed:
        """The next complete message, ``NEED_DATA``, or ``CONNECTION_CLOSED`` after EOF.

        Raises ``RemoteProtocolError`` when the peer breaks the protocol (malformed, oversize
        or truncated frame, unknown type, bad field, wrong version, out-of-order message);
        from then on every call raises it again.
        """
        if self._error is not None:
            raise RemoteProtocolError(
                f"connection unusable after an earlier error: {self._error}", self._error.code
            )
        try:
            return self._next_message()
        except RemoteProtocolError as exc:
            self._error = exc
            self._state.fail(self.their_role)
            raise

    def _next_message(self) -> Message | NeedData | ConnectionClosed:
        frame = self._next_frame()
        if frame is None:
            if not self._eof:
                return NEED_DATA
            if len(self._buffer):
                raise RemoteProtocolError(
                    f"stream ended inside a frame ({len(self._buffer)} bytes pending)",
                    ErrorCode.TRUNCATED_FRAME,
                )
            self._state.close(self.their_role)
            return CONNECTION_CLOSED
        msg = decode_frame(frame, self.max_header_bytes)
        self._process_theirs(msg)
        return msg

    def _next_frame(self) -> memoryview | None:
        length = self._buffer.peek_length()
        if length is None:
            return None
        limit, name = self._frame_limit()
        if length > limit:
            raise RemoteProtocolError(
                f"frame of {length} bytes exceeds {name}={limit}", ErrorCode.FRAME_TOO_LARGE
            )
        if len(self._buffer) < LENGTH.size + length:
            return None
        return self._buffer.take(LENGTH.size + length)[LENGTH.size :]

    def _frame_limit(self) -> tuple[int, str]:
        # Until the peer's Hello only header-only frames are legal (MAX_PRE_HELLO_FRAME_BYTES).
        if self.their_state is State.SEND_HELLO:
            return min(self.max_frame_bytes, self.max_pre_hello_frame_bytes), (
                "max_pre_hello_frame_bytes"
            )
        return self.max_frame_bytes, "max_frame_bytes"

    def _process_theirs(self, msg: Message) -> None:
        try:
            self._state.process(self.their_role, msg)
        except LocalProtocolError as exc:
            raise RemoteProtocolError(str(exc), exc.code) from None
        if isinstance(msg, Hello):
            if msg.protocol_version != PROTOCOL_VERSION:
                raise RemoteProtocolError(
                    f"peer speaks protocol version {msg.protocol_version}; "
                    f"this side speaks {PROTOCOL_VERSION}",
                    ErrorCode.UNSUPPORTED_VERSION,
                )
            self.their_hello = msg

    # -- sending -------------------------------------------------------------------------

    def send(self, msg: Message) -> bytes:
        """Encode ``msg`` as one frame and return its bytes.

        Raises ``LocalProtocolError`` when the state machine forbids ``msg`` now or the
        frame would exceed ``max_frame_bytes``; our side is then in ``ERROR``. (After the
        peer's error only a fatal ``Error`` may be sent; trying anything else raises too,
        but leaves our side as it was.)
        """
        header, tensors, length = self._encode(msg)
        return b"".join([LENGTH.pack(length), header, *(t.data for t in tensors)])

    def send_into(self, msg: Message, buf: bytearray) -> memoryview:
        """Encode ``msg`` into the caller's ``buf`` and return a view of the frame in it.

        ``buf`` grows only when the frame does not fit, so a decode loop that reuses one
        buffer copies each activation once and allocates no payload-sized objects. Release
        the returned view before ``buf`` must grow (a ``bytearray`` with live views cannot
        resize: ``BufferError``). Raises as ``send``.
        """
        header, tensors, length = self._encode(msg)
        end = LENGTH.size + length
        if len(buf) < end:
            buf.extend(bytes(end - len(buf)))
        LENGTH.pack_into(buf, 0, length)
        offset = LENGTH.size + len(header)
        buf[LENGTH.size : offset] = header
        for tensor in tensors:
            buf[offset : offset + tensor.nbytes] = tensor.data
            offset += tensor.nbytes
        return memoryview(buf)[:end]

    def _encode(self, msg: Message) -> tuple[bytes, list[Tensor], int]:
        if not isinstance(msg, Message):
            raise LocalProtocolError(f"not a message: {type(msg).__name__}")
        self._check_send_allowed(msg)
        try:
            tensors: list[Tensor] = []
            header = encode_header(msg, tensors)
            length = frame_length(header, tensors, self.max_frame_bytes)
            self._state.process(self.our_role, msg)
        except LocalProtocolError:
            self._state.fail(self.our_role)
            raise
        if isinstance(msg, Hello):
            self.our_hello = msg
        return header, tensors, length

    def _check_send_allowed(self, msg: Message) -> None:
        # After the peer broke the protocol we only say why and close.
        if self.their_state is State.ERROR and not (isinstance(msg, Error) and msg.fatal):
            raise LocalProtocolError(
                f"peer is in state ERROR; only a fatal Error may be sent, not {type(msg).__name__}",
                ErrorCode.OUT_OF_ORDER,
            )


__all__ = [
    "CONNECTION_CLOSED",
    "DEFAULT_FEATURES",
    "NEED_DATA",
    "Connection",
    "ConnectionClosed",
    "NeedData",
    "Signal",
]
