"""Placement by what the nodes claim of themselves (issue 34), with real workers on an
in-memory mesh: a node too slow for the calibration request is placed by its own claim, a
lie; the serving watch times what it really does and moves the layers off it between
requests; the tokens stay those of one whole-model stage."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from meshnode.node import calibration, speeds, worker
from meshnode.node.selfmeasure import SelfMeasure
from meshnode.node.stage import StageRunner
from tests.node.inmemory import HOST, InMemoryMesh, add_worker, decode, greedy_reference, split_host
from tests.node.test_replace_by_speed import _runner_of, _width


def slow_down_to(
    monkeypatch: pytest.MonkeyPatch, is_slow: Callable[[StageRunner], bool], rate: float
) -> None:
    """Make every forward of a runner ``is_slow`` picks sleep its weight bytes over
    ``rate``: inside the compute a stage times (the last stage times its own)."""
    forward = StageRunner._forward

    def slowed(runner: StageRunner, *args: Any) -> Any:
        if is_slow(runner):
            time.sleep(runner.stage.weights.nbytes() / rate)
        return forward(runner, *args)

    monkeypatch.setattr(StageRunner, "_forward", slowed)


async def test_a_node_that_lies_about_its_speed_is_re_placed_by_what_it_does(
    tmp_path: Path,
    hub_ref: tuple[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    reference = greedy_reference(hub_ref[1])
    # the tiny model's layers take well under a millisecond: any predicted gain counts
    monkeypatch.setattr(speeds, "MIN_GAIN_S", 0.0)
    monkeypatch.setattr(speeds, "SERVE_BEFORE_REPLACING_S", 0.0)
    monkeypatch.setattr(calibration, "TIMEOUT_S", 0.2)  # w's passes take longer

    async def lie(*_: object) -> SelfMeasure:
        return SelfMeasure(1e-5, 1e-5, 1e-5, 1, 0.0)  # a layer in ten microseconds

    monkeypatch.setattr(worker, "measure_part", lie)
    caplog.set_level(logging.INFO, logger="meshnode.coordinator")
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        coordinator, next_pipeline = split_host(mesh, hub_ref, nursery, calibrate=True)
        # w really runs at 20 MB/s of weights (a sleep in proportion to its stage's bytes,
        # head and all, as the planner models a stage's time)
        slow_down_to(monkeypatch, lambda r: _runner_of(mesh, coordinator, "w") is r, 20e6)
        first = await next_pipeline()
        assert first is not None
        # the calibration ran out of time: w's claim took it a layer more
        assert "host[0:1), w[1:3) is faster than host[0:2), w[2:3)" in caplog.text
        status = coordinator.status()
        assert status["calibration"].startswith("failed: did not finish")
        stages = {s["node_id"]: s for s in status["stages"]}
        assert _width(stages["w"]) == 2
        assert stages["w"]["self_measured"]["decode_us"] == 10.0  # its claim, shown
        # one request: the watch times every stage, and between requests moves the
        # layers back off w on what it really does
        assert await decode(first) == reference
        assert await next_pipeline() is None
        moved = await next_pipeline()
        assert moved is not None
        assert "host[0:2), w[2:3) is faster than host[0:1), w[1:3)" in caplog.text
        stages = {s["node_id"]: s for s in coordinator.status()["stages"]}
        assert _width(stages["w"]) == 1
        assert _width(stages[HOST]) == 2
        assert await decode(moved, "req-2") == reference
        nursery.cancel_scope.cancel()
