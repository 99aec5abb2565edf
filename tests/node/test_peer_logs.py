"""A member's text in the node's log (issue 36, item 9).

Before, a member's ``Error`` frames were logged as sent: a message with newlines wrote
lines that read as the node's own, and a flood of them wrote 30 MB of log in 2 s. Now every
record's message is one line (control characters escaped), a peer's text is cut short, and
each peer's lines come from a token bucket. The member is real (mutual TLS to the real
daemon on loopback); the flood ends with a heartbeat whose echo says every frame before it
was handled.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
from meshnode_protocol import Error, Heartbeat

from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.net.limits import PEER_LOG_BURST, PEER_LOG_PER_S, TokenBuckets
from meshnode.net.logtext import MAX_REMOTE_TEXT_CHARS, OneLineFormatter, one_line
from tests.node.member import Member, start_node

FLOOD_FRAMES = 400
#: A forged line, repeated to make each frame's text ~4 KB.
FORGED = "\n2026-01-01 00:00:00,000 INFO meshnode.node: run r1 ready\x1b[2J" * 60


async def test_a_members_error_flood_is_escaped_cut_and_rate_limited(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = JoinToken.generate("m")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    assert node.listen is not None
    member = await Member.dial(NodeIdentity.provision(token, tmp_path / "me"), node.listen)
    started = trio.current_time()
    with caplog.at_level(logging.WARNING, logger="meshnode"):
        for _ in range(FLOOD_FRAMES):
            await member.send(Error(code=1, message=FORGED))
        await member.send(Heartbeat(node_id=member.node_id, nonce=7, sent_ns=1))
        while True:  # the node's own heartbeats come too; the echo of ours ends the wait
            echo = await member.receive(Heartbeat)
            assert isinstance(echo, Heartbeat)
            if echo.echo_nonce == 7:
                break
    elapsed = trio.current_time() - started
    formatter = OneLineFormatter("%(levelname)s %(name)s: %(message)s")
    lines = [formatter.format(r) for r in caplog.records if "reported error" in r.getMessage()]
    assert lines, "the first errors are logged"
    assert len(lines) <= PEER_LOG_BURST + PEER_LOG_PER_S * elapsed + 1, (len(lines), elapsed)
    assert all("\n" not in line and "\x1b" not in line for line in lines)
    assert all(len(line) < MAX_REMOTE_TEXT_CHARS + 200 for line in lines)
    assert "\\n2026-01-01" in lines[0]  # the forged line is there, escaped, on ours
    await member.aclose()


def test_one_line_escapes_every_control_character() -> None:
    assert one_line("a\nb\r\tc\x00\x1b[0m\x85\u2028d") == "a\\nb\\r\\tc\\x00\\x1b[0m\\x85\\u2028d"
    assert one_line("plain — text") == "plain — text"


def test_the_peer_bucket_refills_counts_and_stays_bounded() -> None:
    limit = TokenBuckets(burst=2, per_s=1.0, max_keys=3)
    assert [limit.allow("a", 0.0) for _ in range(4)] == [0, 0, None, None]
    assert limit.allow("a", 1.0) == 2  # a token back after a second, with the count held
    for peer in "bcde":
        limit.allow(peer, 1.0)
    assert len(limit._buckets) == 3
    assert limit.allow("a", 1.0) == 0  # forgotten as the longest idle: a fresh bucket
