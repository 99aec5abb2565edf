"""Bounds on what the network can make a node hold or do (issue 15 item 6)."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import pytest
import trio

from meshnode.net.identity import JoinToken, NodeId, NodeIdentity
from meshnode.net.limits import DEFAULT_LIMITS, MeshLimits, RateLimitedLog
from meshnode.node.config import Address
from meshnode.node.dialer import Dialer, DialTarget, RunSession
from meshnode.node.sessions import HANDSHAKE_TIMEOUT_S, SessionOwner, Sessions


def test_refusal_logs_are_rate_limited_and_count_what_they_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limited = RateLimitedLog(logging.getLogger("test.limits"), interval_s=10.0)
    with caplog.at_level(logging.WARNING):
        logged = [limited.warning("tls", t, "refused %s", "x") for t in (0.0, 1.0, 2.0, 9.9)]
        logged.append(limited.warning("mdns", 3.0, "too many targets"))  # another kind
        logged.append(limited.warning("tls", 10.0, "refused %s", "y"))
    assert logged == [True, False, False, False, True, True]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused x",
        "too many targets",
        "refused y (3 more like this in the last 10 s)",
    ]


def _dialer(run_session: RunSession, limits: MeshLimits = DEFAULT_LIMITS) -> Dialer:
    return Dialer(
        NodeId("self"),
        (Address("127.0.0.1", 1),),  # one static peer: never counted, never dropped
        interval_s=1.0,
        client_context=ssl.create_default_context(),
        run_session=run_session,
        connected=lambda node_id: False,
        limits=limits,
    )


async def _never(stream: trio.SSLStream[trio.SocketStream], target: DialTarget) -> bool:
    raise AssertionError("not dialed in this test")


async def test_learned_targets_are_capped(caplog: pytest.LogCaptureFixture) -> None:
    """Spoofed mDNS adverts (or a peer list) cannot add unbounded dial targets."""
    dialer = _dialer(_never)
    cap = DEFAULT_LIMITS.max_learned_targets
    with caplog.at_level(logging.WARNING):
        for i in range(cap + 50):
            dialer.learn(Address(f"10.9.{i // 250}.{i % 250 + 1}", 7470), None)
    assert sum(not t.static for t in dialer.targets.values()) == cap
    assert Address("127.0.0.1", 1) in dialer.targets
    assert len(caplog.records) == 1  # 50 refusals, one log line
    assert "max_learned_targets" in caplog.text


async def test_concurrent_dials_are_capped() -> None:
    """Targets that accept TCP and then say nothing hold at most max_concurrent_dials."""
    count = DEFAULT_LIMITS.max_concurrent_dials + 10
    accepted: list[trio.SocketStream] = []
    opened: list[trio.SocketListener] = []
    holding = trio.Event()

    async def hold(stream: trio.SSLStream[trio.SocketStream], target: DialTarget) -> bool:
        holding.set()
        try:
            await trio.sleep_forever()
        finally:
            await trio.aclose_forcefully(stream)
        raise AssertionError("unreachable")

    async with trio.open_nursery() as nursery:
        dialer = _dialer(hold)
        for _ in range(count):
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            opened.extend(listeners)
            port = listeners[0].socket.getsockname()[1]
            nursery.start_soon(trio.serve_listeners, _collect(accepted), listeners)
            dialer.learn(Address("127.0.0.1", port), None)
        nursery.start_soon(dialer.run, nursery)
        with trio.fail_after(10):
            await holding.wait()
            await _until(lambda: len(accepted) >= DEFAULT_LIMITS.max_concurrent_dials)
        await trio.sleep(0.3)  # time enough for more dials, were they allowed
        assert len(accepted) == DEFAULT_LIMITS.max_concurrent_dials
        assert dialer.connecting() == DEFAULT_LIMITS.max_concurrent_dials
        nursery.cancel_scope.cancel()
    for listener in opened:
        await listener.aclose()


def _collect(into: list[trio.SocketStream]) -> Callable[[trio.SocketStream], Awaitable[None]]:
    async def handler(stream: trio.SocketStream) -> None:
        into.append(stream)
        try:
            await trio.sleep_forever()
        finally:
            await trio.aclose_forcefully(stream)

    return handler


async def test_pending_inbound_handshakes_are_capped(tmp_path: Path) -> None:
    """Idle connections that never start TLS cannot pile up: beyond the cap each new one
    closes the oldest idle one (counted as refused), so the count stays at the cap and a
    newcomer is always taken (issue 36, item 1; before, newcomers were the ones refused)."""
    limits = MeshLimits(max_pending_handshakes=4, client_hello_timeout_s=60.0)
    identity = NodeIdentity.provision(JoinToken.generate("m"), tmp_path)
    owner = cast(SessionOwner, object())  # never consulted: nobody gets past TLS here
    sessions = Sessions(
        identity.node_id, identity.mesh_id, owner, interval_s=1.0,
        server_context=identity.server_context(), limits=limits,
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, sessions.handle_inbound, listeners)
        with trio.fail_after(10):
            idle = []
            for _ in range(4):
                idle.append(await trio.open_tcp_stream("127.0.0.1", port))
                await _until(lambda: len(sessions._pending) == len(idle))
            extra = []
            for n in range(3):
                extra.append(await trio.open_tcp_stream("127.0.0.1", port))
                assert await _closed_by_peer(idle[n])  # the oldest idle one made room
            assert sessions.refused_handshakes == 3
            assert len(sessions._pending) == 4
        for stream in [idle[3], *extra]:
            await stream.aclose()
        nursery.cancel_scope.cancel()
    for listener in listeners:
        await listener.aclose()


async def _closed_by_peer(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some() == b""
    except trio.BrokenResourceError:
        return True
    finally:
        await stream.aclose()


async def _until(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` (socket events reach the server without a trio event to wait on);
    the caller bounds the wait with ``fail_after``."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.01)


async def test_a_connection_that_says_nothing_is_closed_after_the_client_hello_deadline(
    tmp_path: Path,
) -> None:
    limits = MeshLimits(client_hello_timeout_s=0.2)
    identity = NodeIdentity.provision(JoinToken.generate("m"), tmp_path)
    sessions = Sessions(
        identity.node_id, identity.mesh_id, cast(SessionOwner, object()), interval_s=1.0,
        server_context=identity.server_context(), limits=limits,
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, sessions.handle_inbound, listeners)
        with trio.fail_after(HANDSHAKE_TIMEOUT_S - 1):  # before, it was that timeout
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            assert await _closed_by_peer(idle)
        assert sessions.refused_handshakes == 1
        assert len(sessions._pending) == 0
        nursery.cancel_scope.cancel()
    for listener in listeners:
        await listener.aclose()
