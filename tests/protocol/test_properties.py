"""Property tests: every message type round-trips, through frames and through a Connection."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshnode_protocol import (
    MESSAGE_TYPES,
    Connection,
    Error,
    Goodbye,
    Hello,
    Message,
    Role,
    decode_frame,
    encode_frame,
)

from .helpers import HELLO_A, receive_all
from .strategies import any_message, messages_of

PROFILE = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("cls", MESSAGE_TYPES.values(), ids=lambda c: c.__name__)
def test_every_message_type_round_trips(cls: type[Message]) -> None:
    @PROFILE
    @given(messages_of(cls))
    def check(msg: Message) -> None:
        frame = encode_frame(msg)
        decoded = decode_frame(memoryview(frame)[4:])
        assert decoded == msg
        assert type(decoded) is cls
        assert encode_frame(decoded) == frame  # the encoding is canonical for our encoder

    check()


@PROFILE
@given(st.lists(any_message, max_size=6), st.integers(1, 64))
def test_a_stream_of_messages_survives_any_chunking(msgs: list[Message], chunk: int) -> None:
    msgs = [m for m in msgs if not isinstance(m, Hello) and _keeps_open(m)]
    sender, receiver = Connection(Role.DIALER), Connection(Role.LISTENER)
    data = sender.send(HELLO_A) + b"".join(sender.send(m) for m in msgs)
    assert receive_all(receiver, data, chunk=chunk) == [HELLO_A, *msgs]


def _keeps_open(msg: Message) -> bool:
    return not isinstance(msg, Goodbye) and not (isinstance(msg, Error) and msg.fatal)
