"""The coordinator with real workers in this process, joined by an in-memory mesh
(:mod:`tests.node.inmemory`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
from meshnode_packaging.refs import open_ref

from meshnode.engine.backend import cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.errors import ConfigError
from meshnode.node import coordinator as coordinator_module
from meshnode.node.coordinator import Coordinator
from meshnode.node.footprint import model_footprint
from meshnode.node.mesh import CoordinatorSettings
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame
from meshnode.node.remote import RemotePipeline
from meshnode.node.speeds import MIN_SAMPLES
from tests.node.inmemory import (
    BRING_UP_TIMEOUT_S,
    CONTEXT,
    GREEDY,
    HOST,
    PROMPT,
    STEPS,
    InMemoryMesh,
    NextPipeline,
    add_worker,
    decode,
    finish,
    greedy_reference,
    prefill,
    serve,
    split_host,
)


async def test_a_failed_prepare_replans_without_the_node(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    ref, package = hub_ref
    config = ModelConfig.from_hf(open_ref(package).config)
    footprint = model_footprint(config)
    # The host holds about half the model, so every plan needs at least one worker.
    whole = sum(footprint.layer_bytes) + footprint.embed_bytes * 2 + footprint.head_bytes
    whole += footprint.kv_bytes_per_token_per_layer * config.num_layers * CONTEXT
    mesh = InMemoryMesh(host_memory=whole // 2)
    # "broken" cannot materialize: its cache directory lies under a regular file.
    (tmp_path / "not-a-dir").write_text("")
    served: list[RemotePipeline] = []
    serving = trio.Event()

    def on_pipeline(pipeline: RemotePipeline | None) -> None:
        if pipeline is not None:
            served.append(pipeline)
            serving.set()

    async with trio.open_nursery() as nursery:
        add_worker(mesh, "broken", tmp_path / "not-a-dir" / "cache", nursery)
        add_worker(mesh, "good", tmp_path / "good-cache", nursery)
        coordinator = Coordinator(
            mesh,
            CoordinatorSettings(model_ref=ref, context_size=CONTEXT, split=3),
            source=open_ref(package),
            backend=cpu_backend(),
            on_pipeline=on_pipeline,
        )
        mesh.coordinator = coordinator
        nursery.start_soon(coordinator.run)
        with trio.fail_after(BRING_UP_TIMEOUT_S):
            await serving.wait()
        assert "node broken could not prepare" in coordinator.status()["last_failure"]
        tokens = await decode(served[0])
        nursery.cancel_scope.cancel()
    # The first run (three stages) failed on "broken"; the replan ran without it.
    assert served[0].stage_nodes == (HOST, "good")
    assert mesh.workers["broken"].run is None  # stopped with the failed run
    assert tokens == greedy_reference(package)


async def _lose_and_serve_alone(
    mesh: InMemoryMesh, coordinator: Coordinator, next_pipeline: NextPipeline
) -> RemotePipeline:
    """Two stages (host and "w"); "w" is lost; the host's one-stage pipeline."""
    first = await next_pipeline()
    assert first is not None
    assert first.stage_nodes == (HOST, "w")
    del mesh.workers["w"]
    coordinator.peer_lost("w")
    mesh.changed()
    assert await next_pipeline() is None
    alone = await next_pipeline()
    assert alone is not None
    assert alone.stage_nodes == (HOST,)
    return alone


async def test_the_plan_grows_back_between_requests(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """``--split 2``: a lost worker shrinks the plan to one stage. When the worker is back
    while a request is in flight, the host keeps serving on the old pipeline (a request
    that comes meanwhile is admitted, not told 503) and re-places the model at the first
    moment no request is in flight: back to two stages, failing none."""
    reference = greedy_reference(hub_ref[1])
    mesh = InMemoryMesh(host_memory=1 << 34)  # the host alone fits the model
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        coordinator, next_pipeline = split_host(mesh, hub_ref, nursery)
        alone = await _lose_and_serve_alone(mesh, coordinator, next_pipeline)
        first, second = RequestId("in-flight"), RequestId("came-later")
        first_tokens = await prefill(alone, first)
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        mesh.changed()
        with trio.move_on_after(0.5):
            await next_pipeline()
            raise AssertionError("stopped serving while a request was in flight")
        assert coordinator.status()["state"] == "ready"
        second_tokens = await prefill(alone, second)  # admitted on the old pipeline
        assert await finish(alone, first, first_tokens) == reference
        with trio.move_on_after(0.5):
            await next_pipeline()
            raise AssertionError("stopped serving while a request was in flight")
        assert await finish(alone, second, second_tokens) == reference
        assert await next_pipeline() is None  # the moment none is in flight
        grown = await next_pipeline()
        assert grown is not None
        assert grown.stage_nodes == (HOST, "w")
        assert coordinator.status()["state"] == "ready"
        assert await decode(grown) == reference
        nursery.cancel_scope.cancel()


async def test_requests_that_keep_coming_are_drained_before_the_plan_grows_back(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When requests stay in flight for ``REGROW_IDLE_WAIT_S`` after the worker is back,
    the host stops admitting (503 while draining), lets them finish, then grows back."""
    monkeypatch.setattr(coordinator_module, "REGROW_IDLE_WAIT_S", 0.5)
    reference = greedy_reference(hub_ref[1])
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        coordinator, next_pipeline = split_host(mesh, hub_ref, nursery)
        alone = await _lose_and_serve_alone(mesh, coordinator, next_pipeline)
        request = RequestId("in-flight")
        tokens = await prefill(alone, request)
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        mesh.changed()
        assert await next_pipeline() is None  # after REGROW_IDLE_WAIT_S: draining
        assert coordinator.status()["state"] == "draining"
        with trio.move_on_after(0.5):
            await next_pipeline()
            raise AssertionError("re-placed while a request was in flight")
        assert await finish(alone, request, tokens) == reference
        grown = await next_pipeline()
        assert grown is not None
        assert grown.stage_nodes == (HOST, "w")
        nursery.cancel_scope.cancel()


async def test_a_stage_that_leaves_is_replanned_as_a_leave_not_a_loss(
    tmp_path: Path, hub_ref: tuple[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A stage node that said goodbye is replanned around as a lost one is, but the log
    (INFO, not WARNING) and the status's last failure say it left. As in the daemon, the
    membership drops it before its session ends: the coordinator sees both at once."""
    mesh = InMemoryMesh(host_memory=1 << 34)  # the host alone fits the model
    caplog.set_level(logging.INFO, logger="meshnode")
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "cache", nursery)
        coordinator, next_pipeline = split_host(mesh, hub_ref, nursery)
        first = await next_pipeline()
        assert first is not None
        assert first.stage_nodes == (HOST, "w")
        del mesh.workers["w"]  # the goodbye: out of the membership, then the session ends
        mesh.changed()
        coordinator.peer_lost("w", left=True)
        assert await next_pipeline() is None
        alone = await next_pipeline()
        assert alone is not None
        assert alone.stage_nodes == (HOST,)
        assert coordinator.status()["last_failure"] == "stage node w left the mesh; replanning"
        nursery.cancel_scope.cancel()
    assert first.failure is not None
    assert first.failure.left
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "stage node w" in r.getMessage()]
    assert said == [(logging.INFO, f"run {first.run_id}: stage node w left the mesh; replanning")]


async def test_every_stage_reports_its_compute_time(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    # Three stages: the middle one's compute reaches the host through the frame, so the
    # console can show compute per stage and the wire time as what is left of a pass.
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "a", tmp_path / "a-cache", nursery)
        add_worker(mesh, "b", tmp_path / "b-cache", nursery)
        pipeline = await serve(mesh, ref, package, 3, nursery)
        request = RequestId("req-1")
        result = await pipeline.run(StepFrame(request, FrameKind.PREFILL, 0, PROMPT, GREEDY))
        frame = StepFrame(request, FrameKind.DECODE, len(PROMPT), result.tokens, GREEDY)
        decoded = await pipeline.run(frame)
        await pipeline.release(request)
        nursery.cancel_scope.cancel()
    assert pipeline.stage_nodes == (HOST, "a", "b")
    for step in (result, decoded):
        assert len(step.stage_compute_s) == 3
        assert all(seconds > 0 for seconds in step.stage_compute_s)
        assert step.compute_s == pytest.approx(sum(step.stage_compute_s))


async def test_one_row_passes_measure_every_stages_decode_rate(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    # STEPS - 1 one-row decode passes (the prefill's rows do not count): enough for the
    # speed book, so the next plan places by time and the status shows each stage's rate.
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "a", tmp_path / "a-cache", nursery)
        pipeline = await serve(mesh, ref, package, 2, nursery)
        coordinator = mesh.coordinator
        assert coordinator is not None
        assert coordinator.speeds.speed(HOST) is None
        assert await decode(pipeline) == greedy_reference(package)
        stages = coordinator.status()["stages"]
        nursery.cancel_scope.cancel()
    assert STEPS - 1 >= MIN_SAMPLES
    for node, stage in zip((HOST, "a"), stages, strict=True):
        speed = coordinator.speeds.speed(node)
        assert speed is not None
        assert stage["node_id"] == node
        assert stage["decode_bytes_per_s"] == round(speed.decode_bytes_per_s)


def test_a_context_the_model_cannot_hold_is_a_config_error(hub_ref: tuple[str, Path]) -> None:
    """``--context`` past the model's positions stops ``join`` with one line, instead of a
    plan whose every worker refuses its ``Load``."""
    ref, package = hub_ref
    source = open_ref(package)
    limit = ModelConfig.from_hf(source.config).max_position_embeddings
    settings = CoordinatorSettings(model_ref=ref, context_size=limit + 1)
    with pytest.raises(ConfigError, match=f"--context {limit + 1} is more than the model holds"):
        Coordinator(
            InMemoryMesh(host_memory=1 << 30),
            settings,
            source=source,
            backend=cpu_backend(),
            on_pipeline=lambda pipeline: None,
        )
