"""A member joins while strangers hold idle connections to the mesh port (issue 36, item 1).

Before, 32 idle TCP connections, re-opened as the node dropped each after its 5 s
handshake timeout, kept every pre-Hello slot busy: member dials succeeded 0 times in 60 and
a restarted worker could not rejoin. Now a new connection evicts the oldest idle one, one
address holds at most a few slots, and a connection that sends nothing is dropped after a
short ClientHello deadline, so a member's handshake (which speaks at once) gets through.

The node is the real daemon on loopback; the strangers re-open their connections as soon
as the node closes them, for as long as the member keeps dialing.
"""

from __future__ import annotations

from pathlib import Path

import trio

from meshnode.net.address import Address
from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.net.limits import DEFAULT_LIMITS
from tests.node.member import Member, start_node

#: Idle connections the strangers keep open: more than every slot the node has.
STRANGERS = DEFAULT_LIMITS.max_pending_handshakes + 8
MEMBER_DIALS = 10
FLOOD_TIMEOUT_S = 120.0


async def _stranger(address: Address, flooding: trio.Event) -> None:
    """Hold an idle connection, re-opened each time the node closes it."""
    while not flooding.is_set():
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            try:
                while await stream.receive_some():  # never anything but the close
                    pass
            except trio.BrokenResourceError:
                pass


async def test_a_member_joins_during_a_flood_of_idle_connections(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    token = JoinToken.generate("m")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    assert node.listen is not None
    # A new member each time: a rejoin of the same id would race the old session's end.
    members = [NodeIdentity.provision(token, tmp_path / f"me{i}") for i in range(MEMBER_DIALS)]
    done = trio.Event()
    joined = 0
    with trio.fail_after(FLOOD_TIMEOUT_S):
        async with trio.open_nursery() as flood:
            for _ in range(STRANGERS):
                flood.start_soon(_stranger, node.listen, done)
            while node.sessions.refused_handshakes < STRANGERS:  # noqa: ASYNC110  (a count)
                await trio.sleep(0.05)  # the flood holds every slot and is being turned away
            for identity in members:
                member = await Member.dial(identity, node.listen)  # TLS and Hello, both ways
                joined += 1
                await member.aclose()
            done.set()
            flood.cancel_scope.cancel()
    assert joined == MEMBER_DIALS
