"""Live figures in ``/metrics``: what the console's speed view computes its rates from.

The console charts differences of counters between two polls a second apart, so tokens and
first-token times must be counted as they happen, not when a request ends; compute is
counted per stage, and the waiting gauge reads the scheduler.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from meshnode.engine.sampling import GREEDY
from meshnode.generation.state import GenerationParams
from meshnode.serve.service import ServeService


async def test_metrics_count_tokens_and_first_token_as_they_come(
    serve_service: ServeService,
) -> None:
    service = serve_service
    request = GenerationParams(12, GREEDY)
    run = await service.start(lambda: service.text_prompt("Once upon a time"), request)
    seen_mid_stream = []
    async for _delta in service.stream(run):
        produced = len(run.state.tokens)
        if 0 < produced < 12:
            seen_mid_stream.append(produced)
            # Live, not at the end of the request: the speed view's tokens/s and TTFT.
            assert service.metrics.generation_tokens.get() == produced
            assert service.metrics.ttft.count == 1
    assert seen_mid_stream
    assert service.metrics.generation_tokens.get() == len(run.state.tokens) == 12
    assert service.metrics.ttft.count == 1
    passes = service.metrics.stage_compute.count
    assert passes == run.timings.passes
    # One stage here: all the compute is stage 0's, and the by-stage counter says so.
    stage0 = service.metrics.stage_seconds.get(stage="0")
    assert stage0 == pytest.approx(service.metrics.stage_compute.total)
    assert stage0 > 0
    text = service.metrics.render()
    assert 'meshnode_stage_seconds_total{stage="0"} ' in text
    assert "meshnode_requests_waiting 0\n" in text


async def test_the_waiting_gauge_counts_requests_queued_for_a_slot(
    serve_service: ServeService,
) -> None:
    scheduler = serve_service.scheduler
    release = trio.Event()

    async def hold() -> None:
        async with scheduler.admit():
            await release.wait()

    async with trio.open_nursery() as nursery:
        for _ in range(scheduler.limits.max_in_flight + 2):
            nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        assert "meshnode_requests_waiting 2\n" in serve_service.metrics.render()
        release.set()
    assert "meshnode_requests_waiting 0\n" in serve_service.metrics.render()
