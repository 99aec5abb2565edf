"""The connection state machine, as data.

Theory of operation (compare h11's ``_state.py``). A connection has two sides, ours and
theirs, each in one of four states; each side moves only on the messages *it* sends:

- ``SEND_HELLO``: nothing sent yet. The only legal messages are ``Hello`` and a fatal
  ``Error`` (to refuse a peer before introducing ourselves, e.g. on a version mismatch).
- ``OPEN``: Hello sent; any message except a second ``Hello``.
- ``CLOSED``: the side sent ``Goodbye`` or a fatal ``Error`` (or, for their side, the
  stream ended); it sends nothing more.
- ``ERROR``: the side broke the protocol; the connection refuses further use in that
  direction. (We may still send a fatal ``Error`` to say why, then close.)

The machine is symmetric: the dialer (who opened the TCP/TLS connection) and the listener
both send ``Hello`` first, without waiting for each other, so no handshake order can
deadlock. Roles only label the sides in error messages and logs.
"""

from __future__ import annotations

import enum
from typing import Final

from meshnode_protocol._errors import ErrorCode, LocalProtocolError
from meshnode_protocol._messages import Error, Goodbye, Hello, Message


class Role(enum.Enum):
    """Which end of the connection a side is."""

    DIALER = "dialer"
    LISTENER = "listener"

    @property
    def peer(self) -> Role:
        """The other end."""
        return Role.LISTENER if self is Role.DIALER else Role.DIALER


class State(enum.Enum):
    """State of one side of a connection (see the module docstring)."""

    SEND_HELLO = "SEND_HELLO"
    OPEN = "OPEN"
    CLOSED = "CLOSED"
    ERROR = "ERROR"


class Event(enum.Enum):
    """What a message means to the state machine."""

    HELLO = "Hello"
    GOODBYE = "Goodbye"
    FATAL_ERROR = "fatal Error"
    MESSAGE = "message"


TRANSITIONS: Final[dict[State, dict[Event, State]]] = {
    State.SEND_HELLO: {Event.HELLO: State.OPEN, Event.FATAL_ERROR: State.CLOSED},
    State.OPEN: {
        Event.MESSAGE: State.OPEN,
        Event.GOODBYE: State.CLOSED,
        Event.FATAL_ERROR: State.CLOSED,
    },
    State.CLOSED: {},
    State.ERROR: {},
}


def event_of(msg: Message) -> Event:
    """Classify a message for the state machine."""
    if isinstance(msg, Hello):
        return Event.HELLO
    if isinstance(msg, Goodbye):
        return Event.GOODBYE
    if isinstance(msg, Error) and msg.fatal:
        return Event.FATAL_ERROR
    return Event.MESSAGE


class ConnectionState:
    """Both sides' states; ``process`` applies one side's message or raises."""

    def __init__(self) -> None:
        self.states: dict[Role, State] = {
            Role.DIALER: State.SEND_HELLO,
            Role.LISTENER: State.SEND_HELLO,
        }

    def process(self, role: Role, msg: Message) -> None:
        """Move ``role``'s side for sending ``msg``.

        Raises ``LocalProtocolError`` (code ``OUT_OF_ORDER``) naming role, state and event
        when the table has no such transition; the caller re-raises it as remote for the
        peer's messages.
        """
        state, event = self.states[role], event_of(msg)
        new_state = TRANSITIONS[state].get(event)
        if new_state is None:
            raise LocalProtocolError(
                f"{role.value} in state {state.value} cannot send "
                f"{type(msg).__name__} ({event.value})",
                ErrorCode.OUT_OF_ORDER,
            )
        self.states[role] = new_state

    def close(self, role: Role) -> None:
        """The side's stream ended (EOF): it can send nothing more."""
        if self.states[role] is not State.ERROR:
            self.states[role] = State.CLOSED

    def fail(self, role: Role) -> None:
        """The side broke the protocol."""
        self.states[role] = State.ERROR
