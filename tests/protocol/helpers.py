"""Shared helpers for the protocol tests."""

from __future__ import annotations

from meshnode_protocol import (
    NEED_DATA,
    Connection,
    Hello,
    Message,
    Role,
)

HELLO_A = Hello(
    node_id="node-a",
    mesh_id_hash="m",
    listen_address="127.0.0.1:7420",
    device_kind="cpu",
    usable_memory=1 << 30,
)
HELLO_B = Hello(
    node_id="node-b",
    mesh_id_hash="m",
    listen_address="127.0.0.1:7421",
    device_kind="cpu",
    usable_memory=2 << 30,
    features=("bf16",),
)


def open_pair() -> tuple[Connection, Connection]:
    """A dialer and a listener that have exchanged Hellos in memory."""
    dialer, listener = Connection(Role.DIALER), Connection(Role.LISTENER)
    listener.receive_data(dialer.send(HELLO_A))
    dialer.receive_data(listener.send(HELLO_B))
    assert listener.next_message() == HELLO_A
    assert dialer.next_message() == HELLO_B
    return dialer, listener


def receive_all(conn: Connection, data: bytes, *, chunk: int | None = None) -> list[Message]:
    """Feed ``data`` (whole, or ``chunk`` bytes at a time) and collect every message."""
    out: list[Message] = []
    step = chunk or max(len(data), 1)
    for start in range(0, len(data), step):
        conn.receive_data(data[start : start + step])
        while (msg := conn.next_message()) is not NEED_DATA:
            assert isinstance(msg, Message)
            out.append(msg)
    return out
