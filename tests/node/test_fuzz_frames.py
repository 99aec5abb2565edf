"""A live node under fuzzed frames, small enough for the default run (the reliability suite,
``pytest -m reliability``, sends ~10⁶ to a two-stage mesh serving a real model).

The node is the real daemon in this process; the frames are mutated from the protocol's
golden vectors (``tests/reliability/fuzz.py``) and sent over real mutual-TLS sessions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from meshnode_protocol import Hello

from meshnode.net.identity import JoinToken, NodeIdentity
from tests.node.member import Member, start_node
from tests.reliability.fuzz import fuzz_node

FRAMES = 10_000
#: Malformed frames sent each on its own TLS connection (a handshake each); the rest of
#: the malformed ones go through the codec only.
CLOSING = 150


async def test_fuzzed_frames_close_only_their_connection(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fuzzed Prepare may name a hub ref: nothing may be fetched from anywhere.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    token = JoinToken.generate("fuzz")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    assert node.listen is not None

    def identity(name: str) -> NodeIdentity:
        return NodeIdentity.provision(token, tmp_path / name)

    stats = await fuzz_node(identity, node.listen, count=FRAMES, seed=5, closing_cap=CLOSING)
    print(stats.line())
    assert stats.frames == FRAMES
    assert stats.bugs == []
    assert stats.accepted_sent > FRAMES // 10  # the mix reaches past the decoder
    assert stats.closing_sent + stats.incomplete_sent == CLOSING
    # Each malformed frame closed its connection, after an Error frame saying why.
    assert stats.closed_by_node == stats.closing_sent
    assert stats.errors_received >= stats.closing_sent // 2
    status = node.status()["node"]
    assert status["internal_errors"] == 0
    assert status["protocol_errors"] >= CLOSING // 2
    # The node keeps serving: a polite member gets its Hello.
    member = await Member.dial(identity("polite"), node.listen, hello=False)
    await member.send(member.hello())
    assert isinstance(await member.receive(Hello), Hello)
    await member.aclose()
