"""The protocol's exception tree and the error codes that travel in ``Error`` frames.

::

    ProtocolError               base; carries an ``ErrorCode``
    ├── LocalProtocolError      we tried to send something the protocol forbids (our bug)
    └── RemoteProtocolError     the peer sent something the protocol forbids (their bug,
                                or an attacker); answer with ``exc.to_error()`` and close

As in h11, the split says whose fault it is: a ``LocalProtocolError`` is a programming error
in this process, a ``RemoteProtocolError`` is input we refuse. After either, the direction it
happened in is in the ``ERROR`` state and refuses further use.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshnode_protocol._messages import Error


class ErrorCode(enum.IntEnum):
    """Codes carried by ``Error`` frames (the table is in ``protocol/README.md``).

    1–99 are connection-level codec errors: the sender closes the connection after the
    ``Error`` frame. 100–199 are control-plane refusals and 200–299 data-plane refusals;
    they answer one message and the connection stays open. Receivers must accept codes
    they do not know (a newer peer may send them) and treat them by range.
    """

    MALFORMED_FRAME = 1
    FRAME_TOO_LARGE = 2
    TRUNCATED_FRAME = 3
    UNSUPPORTED_VERSION = 4
    UNKNOWN_MESSAGE_TYPE = 5
    INVALID_FIELD = 6
    OUT_OF_ORDER = 7

    STALE_TERM = 100
    UNKNOWN_RUN = 101
    BUSY = 102
    MESH_MISMATCH = 103
    PREPARE_FAILED = 104
    LOAD_FAILED = 105
    OUT_OF_MEMORY = 106
    SHUTTING_DOWN = 107
    INTERNAL = 108

    UNKNOWN_REQUEST = 200
    NOT_READY = 201
    CAPACITY = 202
    BAD_ACTIVATION = 203
    ROLLBACK_TOO_DEEP = 204
    PREFIX_MISS = 205

    @property
    def closes_connection(self) -> bool:
        """True for codec errors (1–99), after which the sender closes the connection."""
        return self < 100


class ProtocolError(Exception):
    """Base class of the protocol's errors; ``code`` says which ``ErrorCode`` applies."""

    def __init__(self, msg: str, code: ErrorCode = ErrorCode.MALFORMED_FRAME) -> None:
        super().__init__(msg)
        self.code = code

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r}, code={self.code.name})"


class LocalProtocolError(ProtocolError):
    """Raised by ``Connection.send`` (and message constructors) for something we must not send."""


class RemoteProtocolError(ProtocolError):
    """Raised by ``Connection.next_message`` when the peer breaks the protocol.

    The transport should send ``Connection.send(exc.to_error())`` and close the connection;
    every other connection is unaffected.
    """

    def to_error(self) -> Error:
        """The ``Error`` frame that reports this error to the peer (fatal: we close next)."""
        from meshnode_protocol._messages import Error

        return Error(code=int(self.code), message=str(self), fatal=True)
