"""Re-placement because of measured speeds (issue 34), with real workers on an in-memory mesh
(:mod:`tests.node.inmemory`): one stage is slowed by a test hook around its compute, the
host measures it while serving, and between requests the layers move off it; the tokens
stay those of one whole-model stage."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from meshnode.node import relay, remote
from meshnode.node.stage import StageRunner
from tests.node.inmemory import HOST, InMemoryMesh, add_worker, decode, greedy_reference, split_host

# The slowed stage sleeps this long a layer in every compute pass: far above a tiny
# model's ~1 ms a stage even on a busy machine, so the measured plan is clearly faster.
SLOW_S_PER_LAYER = 0.03


def _slow_down(monkeypatch: pytest.MonkeyPatch, is_slow: Callable[[StageRunner], bool]) -> None:
    """Make every compute pass of a runner ``is_slow`` picks sleep per layer it holds, on the
    host (``remote``) and on the workers (``relay``) alike: inside the timed compute."""
    for module in (remote, relay):
        for name in ("step_activations", "step_results"):
            step = getattr(module, name)

            def slowed(runner: StageRunner, slots: Any, step: Any = step) -> None:
                if is_slow(runner):
                    time.sleep(SLOW_S_PER_LAYER * (runner.stage.end - runner.stage.start))
                step(runner, slots)

            monkeypatch.setattr(module, name, slowed)


async def test_measured_speeds_move_layers_off_a_slow_stage_between_requests(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = greedy_reference(hub_ref[1])
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        coordinator, next_pipeline = split_host(mesh, hub_ref, nursery)
        first = await next_pipeline()
        assert first is not None
        assert coordinator.status()["placed_by"] == "memory"
        # slow down the stage the memory-weighted plan gave the most layers
        stages = coordinator.status()["stages"]
        widest = max(stages, key=lambda s: s["layers"][1] - s["layers"][0])
        slow_node = widest["node_id"]

        def is_slow(runner: StageRunner) -> bool:
            if slow_node == HOST:
                return coordinator.pipeline is not None and runner is coordinator.pipeline.runner
            run = mesh.workers[slow_node].run
            return run is not None and runner is run.runner

        _slow_down(monkeypatch, is_slow)
        # one request: MIN_SAMPLES one-row passes time every stage; no move mid-request
        assert await decode(first) == reference
        assert await next_pipeline() is None  # re-placing, between requests
        moved = await next_pipeline()
        assert moved is not None
        status = coordinator.status()
        assert status["placed_by"] == "speed"
        after = {s["node_id"]: s["layers"] for s in status["stages"]}
        assert after[slow_node][1] - after[slow_node][0] < widest["layers"][1] - widest["layers"][0]
        assert await decode(moved, "req-2") == reference
        # the same measurements never move it again: another request, and no new pipeline
        assert await decode(moved, "req-3") == reference
        with trio.move_on_after(0.5):
            await next_pipeline()
            raise AssertionError("re-placed again on the same measurements")
        nursery.cancel_scope.cancel()
