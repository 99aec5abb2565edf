"""A replay reuses what the surviving stages still hold (issue 30, node.prefix_keep).

When the host re-plans the same pipeline (here: a pass lost without a trace, which blames
nobody the first time, so the plan is made again as it was), every stage keeps its cached
blocks across the new ``Load`` and reports them in ``Ready``; the replayed request resumes
its prompt from them. Its tokens equal a single whole-model stage's greedy ones, and
every stage counts the resumed positions as hits. When a stage is killed and the plan is
made without it, the stages' layer ranges and nodes change, and so do the keys: no stage
serves a block of the old pipeline.

The coordinator, the workers and the generation loop are real; the transport is in memory
(tests/node/inmemory.py). Plans are by memory, so that speeds measured while serving do
not move the layers between the two runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.sampling import SamplingParams
from meshnode.node.stage import StageRunner
from meshnode.node.worker import Worker
from tests.node.inmemory import HOST, InMemoryMesh, greedy_reference
from tests.node.test_replay import CONTEXT, TEST_TIMEOUT_S, TOKENS, Host, kill, start

GREEDY = SamplingParams(temperature=0.0)
# Two full blocks and a few tokens: a resumed prompt starts at 2 B.
PROMPT = tuple((7 * i + 3) % 200 + 2 for i in range(2 * B + 7))


def _runner(worker: Worker) -> StageRunner:
    assert worker.run is not None
    assert worker.run.runner is not None
    return worker.run.runner


def _hits(runners: list[StageRunner]) -> list[int]:
    return [r.kv_usage()["prefix_hit_tokens"] for r in runners]


@pytest.mark.parametrize("stages", [2, 3], ids=["two-stages", "three-stages"])
async def test_a_replay_on_the_same_pipeline_resumes_from_the_kept_blocks(
    tmp_path: Path, hub_ref: tuple[str, Path], stages: int
) -> None:
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    host = Host(mesh, package, ref, split=stages, place_by_speed=False)
    workers = ["a", "b"][: stages - 1]
    single = greedy_reference(package, PROMPT, TOKENS, CONTEXT)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, workers)
            first = await host.ready()
            assert first.stage_nodes == (HOST, *workers)
            uncached, _ = await host.stream("calm", PROMPT, GREEDY, cache=False)
            assert uncached == single
            runners = [first.runner, *(_runner(mesh.workers[w]) for w in workers)]
            before = _hits(runners)

            async def lose_a_pass(produced: int) -> None:
                if produced == 5 and first.failure is None:
                    first.fail("a pass did not come back")  # as a missed deadline does

            replayed, run = await host.stream("stormy", PROMPT, GREEDY, on_tokens=lose_a_pass)
            assert replayed == single
            assert run.replays == 1
            assert run.cached_tokens == 2 * B  # its prefill resumed from "calm"'s blocks
            assert run.replay_cached_tokens == 2 * B  # ... and so did its replay
            second = await host.ready(2)
            assert second.stage_nodes == first.stage_nodes
            kept = [second.runner, *(_runner(mesh.workers[w]) for w in workers)]
            assert all(new.prefix is old.prefix for new, old in zip(kept, runners, strict=True))
            # Every stage, the host's too, served the prefix twice: prefill and replay.
            after = _hits(kept)
            assert [a - b for a, b in zip(after, before, strict=True)] == [4 * B] * stages
            nursery.cancel_scope.cancel()


async def test_stages_whose_pipeline_changed_serve_nothing_of_the_old_one(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """The middle stage is killed: the last stage's node ("b") moves to the middle range,
    the spare takes the last. Their keys differ from the old run's; the host's too (its
    range is the same, the pipeline after it is not): the replay computes the whole
    prompt again, and gets the single stage's tokens."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    host = Host(mesh, package, ref, split=3, place_by_speed=False)
    single = greedy_reference(package, PROMPT, TOKENS, CONTEXT)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, ["a", "b", "spare"])
            first = await host.ready()
            assert first.stage_nodes == (HOST, "a", "b")
            warm, _ = await host.stream("calm", PROMPT, GREEDY)
            assert warm == single
            old = _runner(mesh.workers["b"])
            old_range = (old.stage.start, old.stage.end)

            async def kill_the_middle_stage(produced: int) -> None:
                if produced >= 6 and "a" in mesh.workers:
                    kill(mesh, "a")

            replayed, run = await host.stream(
                "stormy", PROMPT, GREEDY, on_tokens=kill_the_middle_stage
            )
            assert replayed == single
            assert run.replays == 1
            assert run.replay_cached_tokens == 0
            second = await host.ready(2)
            assert second.stage_nodes == (HOST, "b", "spare")
            moved = _runner(mesh.workers["b"])
            assert (moved.stage.start, moved.stage.end) != old_range
            assert moved.prefix is not old.prefix
            assert second.runner.prefix is not first.runner.prefix
            assert moved.prefix.salt != old.prefix.salt  # the keys differ
            assert _hits([second.runner, moved]) == [0, 0]
            nursery.cancel_scope.cancel()
