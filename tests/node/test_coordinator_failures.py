"""The coordinator's failure handling against what the host observes (issue 36 items 5
and 7), with real workers on an in-memory mesh (:mod:`tests.node.inmemory`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio
from meshnode_protocol import ActivationBatch, ActivationFrame, Message

from meshnode.node import decisions
from meshnode.node.coordinator import next_term
from meshnode.node.pipeline import StageLostError
from meshnode.node.remote import PassDeadline
from meshnode.node.worker import Worker
from meshnode.node.worker_run import WorkerRun
from tests.node.inmemory import (
    HOST,
    InMemoryMesh,
    add_worker,
    decode,
    greedy_reference,
    split_host,
)


def _drop_passes(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker`` takes every activation frame and does nothing with it; everything else
    (heartbeats, the coordinator's probe, answered idle) it handles as before."""
    handle = worker.handle

    async def dropping(peer: str, message: Message) -> Any:
        if isinstance(message, ActivationFrame | ActivationBatch):
            return True
        return await handle(peer, message)

    monkeypatch.setattr(worker, "handle", dropping)


async def test_a_stage_that_answers_probes_but_never_passes_frames_on_is_blamed(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36 item 5: "w" stays connected and answers the probe as idle (busy 0 ms) but
    no pass through it comes back. The host blames it from what it observes (the reply
    missing, pass after pass, with "w" the only remote stage), cools it off and serves
    alone, instead of re-placing onto it forever."""
    reference = greedy_reference(hub_ref[1])
    mesh = InMemoryMesh(host_memory=1 << 34)  # the host alone fits the model
    deadline = PassDeadline(base_s=1.0, per_token_s=0.0)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        coordinator, next_pipeline = split_host(mesh, hub_ref, nursery, deadline)
        pipeline = await next_pipeline()
        assert pipeline is not None
        assert pipeline.stage_nodes == (HOST, "w")
        _drop_passes(mesh.workers["w"], monkeypatch)
        placements: list[tuple[str, ...]] = []
        for _ in range(decisions.UNTRACED_LOSSES_TO_BLAME + 1):
            if len(pipeline.stage_nodes) == 1:  # the host alone: "w" was blamed
                break
            with pytest.raises(StageLostError, match="did not come back"):
                await decode(pipeline)
            assert await next_pipeline() is None
            pipeline = await next_pipeline()
            assert pipeline is not None
            placements.append(pipeline.stage_nodes)
        assert placements[-1] == (HOST,), placements
        assert await decode(pipeline) == reference
        status = coordinator.status()
        assert set(status["cooling_off"]) == {"w"}
        assert "blamed on stage node w" in status["last_failure"]
        nursery.cancel_scope.cancel()


async def test_the_plan_grows_back_once_a_worker_that_refused_the_claim_is_free(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36 item 7: the worker is another host's when this one starts (``--split 2``),
    so its Claim is refused and the host serves alone. The worker is freed without leaving
    the mesh (no membership change); the plan grows back to two stages all the same."""
    # Longer than the first back-off (0.5 s), so the host serves alone in between.
    monkeypatch.setattr(decisions, "CLAIM_RETRY_FIRST_S", 2.0)
    reference = greedy_reference(hub_ref[1])
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        worker = mesh.workers["w"]
        worker.run = WorkerRun("theirs", next_term(0, time.time_ns()), "other-host")
        coordinator, next_pipeline = split_host(mesh, hub_ref, nursery)
        alone = await next_pipeline()
        assert alone is not None
        assert alone.stage_nodes == (HOST,)
        assert "claimed by another node" in coordinator.status()["last_failure"]
        worker.stop("the other host let go")  # "w" never left: no membership change
        # Re-placed between requests, once its Claim is due again (a try that comes before
        # the stop above, on a slow machine, is refused and serves alone once more).
        grown = alone
        placements: list[tuple[str, ...]] = []
        while grown.stage_nodes != (HOST, "w") and len(placements) < 3:
            assert await next_pipeline() is None
            placed = await next_pipeline()
            assert placed is not None
            grown = placed
            placements.append(grown.stage_nodes)
        assert grown.stage_nodes == (HOST, "w"), placements
        assert await decode(grown) == reference
        nursery.cancel_scope.cancel()
