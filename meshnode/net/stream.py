"""A framed, authenticated peer stream: trio bytes in and out of a sans-IO ``Connection``.

:class:`PeerStream` owns one ``trio`` stream (a ``trio.SSLStream`` over TCP in the daemon)
and one ``meshnode_protocol.Connection``. ``receive()`` feeds bytes to the codec until it
yields a message; ``send()`` encodes and writes under a FIFO lock so that concurrent senders
(heartbeats, replies) never interleave frames. Frames are encoded into one buffer per
stream, reused by every send (the lock serializes them, so one suffices): the decode loop's
activation frames cost no per-token frame allocation (``Connection.send_into``).

When the peer breaks the protocol (``RemoteProtocolError``), the stream answers with the
matching ``Error`` frame, closes, and re-raises: that one connection ends, the node goes on.
The codec bounds every frame (``MAX_FRAME_BYTES``), so a peer cannot make us buffer more
than one frame plus one read.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from typing import Final

import trio
from meshnode_protocol import (
    CONNECTION_CLOSED,
    NEED_DATA,
    Connection,
    Error,
    Goodbye,
    Message,
    RemoteProtocolError,
    State,
)

log = logging.getLogger(__name__)

# One read; small enough to bound memory per connection, large enough that a hidden-state
# activation frame (a few KiB per token) arrives in a handful of reads.
RECEIVE_CHUNK_BYTES = 64 * 1024
# The send buffer keeps its size up to this (a 256-token f32 prefill chunk of a 4096-wide
# model is 4 MiB); a larger frame is encoded into a buffer of its own and dropped after.
SEND_BUFFER_KEEP_BYTES = 4 * 1024 * 1024
# Writing the Error frame to a peer that stopped reading must not hang the session.
ERROR_SEND_TIMEOUT_S = 2.0

# What a broken or vanished transport raises; callers treat all of them as "connection lost".
TRANSPORT_ERRORS: Final = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    ssl.SSLError,
    OSError,
)
# What sending to a peer *by node id* raises: no session with it (KeyError, the daemon's
# ``Node.send``) or a transport that broke. Callers treat both as "that node is gone".
SEND_ERRORS: Final = (KeyError, *TRANSPORT_ERRORS)


class PeerStream:
    """Messages over a byte stream; not safe to ``receive()`` from two tasks at once."""

    def __init__(self, stream: trio.abc.Stream, connection: Connection) -> None:
        self._stream = stream
        self._conn = connection
        self._send_lock = trio.StrictFIFOLock()
        self._send_buffer = bytearray()  # reused by every send, under _send_lock
        self._finished = False  # we sent Goodbye or a fatal Error: nothing may follow

    @property
    def stream(self) -> trio.abc.Stream:
        """The underlying stream (for ``getpeercert`` and friends)."""
        return self._stream

    async def send(self, message: Message) -> None:
        """Encode and write one message.

        Raises ``trio.ClosedResourceError`` once a ``Goodbye`` or fatal ``Error`` went out,
        or once the peer broke the protocol (only our ``Error`` may follow then): a
        heartbeat racing a shutdown is a closed connection, not a bug. Transport errors
        propagate if the stream broke.
        """
        async with self._send_lock:
            if self._finished:
                raise trio.ClosedResourceError("this side already said goodbye")
            fatal = isinstance(message, Error) and message.fatal
            if self._conn.their_state is State.ERROR and not fatal:
                # Only our fatal Error may follow (the codec's rule): a reply of a task that
                # outlived the session (a Load failing in the background) is a closed
                # connection too, not a LocalProtocolError that would end the node.
                raise trio.ClosedResourceError("the peer broke the protocol: closing")
            self._finished = isinstance(message, Goodbye) or fatal
            frame = self._conn.send_into(message, self._send_buffer)
            try:
                # send_all returns once the bytes are handed over (an SSLStream has
                # encrypted them into its own buffer), so the buffer is free again after.
                await self._stream.send_all(frame)
            finally:
                frame.release()  # a live view would stop the buffer from growing
                if len(self._send_buffer) > SEND_BUFFER_KEEP_BYTES:
                    self._send_buffer = bytearray()

    async def receive(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream.

        Raises ``RemoteProtocolError`` after answering it with an ``Error`` frame and
        closing the stream; transport errors propagate unchanged.
        """
        while True:
            try:
                message = self._conn.next_message()
            except RemoteProtocolError as exc:
                await self._fail(exc)
                raise
            if message is CONNECTION_CLOSED:
                return None
            if message is not NEED_DATA:
                return message
            self._conn.receive_data(await self._stream.receive_some(RECEIVE_CHUNK_BYTES))

    async def _fail(self, exc: RemoteProtocolError) -> None:
        log.info("peer broke the protocol (%s): answering Error and closing", exc)
        with trio.move_on_after(ERROR_SEND_TIMEOUT_S):
            # The peer may already be gone; closing is all that is left then.
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await self.send(exc.to_error())
        await self.aclose()

    async def aclose(self) -> None:
        """Close the stream (sends TLS close_notify when possible); never raises."""
        with trio.move_on_after(ERROR_SEND_TIMEOUT_S) as scope:
            scope.shield = True
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await self._stream.aclose()
