"""Coordinator terms survive a host restart (issue 15 item 11)."""

from __future__ import annotations

import time
from pathlib import Path

import trio
from meshnode_protocol import Claim, ClaimAccepted, ClaimRejected, Message, PeerInfo

from meshnode.engine.backend import cpu_backend
from meshnode.node.coordinator import next_term
from meshnode.node.worker import Worker

HOST = "host"


def test_terms_grow_within_a_process_and_across_restarts() -> None:
    t0 = 1_763_000_000 * 10**9  # some wall-clock instant, in ns
    first = next_term(0, t0)
    same_instant = next_term(first, t0)
    assert same_instant == first + 1  # two runs within a microsecond still differ
    assert next_term(same_instant, t0 + 5 * 10**9) > same_instant
    # A restarted process starts from 0 again, a second later: it is above the old terms.
    assert next_term(0, t0 + 10**9) > next_term(same_instant, t0 + 10**6)
    assert next_term(0, t0) < 2**53  # exact in JSON status output


async def test_a_restarted_hosts_first_claim_is_accepted(tmp_path: Path) -> None:
    replies: list[Message] = []

    async def send(peer: str, message: Message) -> None:
        replies.append(message)

    async def connect(info: PeerInfo) -> None:
        raise AssertionError("a claim dials nobody")

    async with trio.open_nursery() as nursery:
        worker = Worker(
            "w", send, connect=connect, backend=cpu_backend(), cache_dir=tmp_path, nursery=nursery
        )
        # The host's previous process replanned a few times, then restarted.
        term = 0
        for run in range(3):
            term = next_term(term, time.time_ns())
            assert await worker.handle(
                HOST, Claim(run_id=f"old-{run}", term=term, coordinator_id=HOST)
            )
            assert isinstance(replies[-1], ClaimAccepted)
        restarted = next_term(0, time.time_ns())
        assert await worker.handle(HOST, Claim(run_id="new", term=restarted, coordinator_id=HOST))
        assert isinstance(replies[-1], ClaimAccepted), replies[-1]
        # An old term of the same host is still fenced off.
        assert await worker.handle(HOST, Claim(run_id="old-2", term=term, coordinator_id=HOST))
        assert isinstance(replies[-1], ClaimRejected)
        nursery.cancel_scope.cancel()
