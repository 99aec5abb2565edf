"""A replay reuses what the surviving stages still hold (issue 30, node.prefix_keep).

When the host re-plans the same pipeline (here: a pass lost without a trace, which blames
nobody the first time, so the plan is made again as it was), every stage keeps its cached
blocks across the new ``Load`` and reports them in ``Ready``; the replayed request resumes
its prompt from them. Its tokens equal a single whole-model stage's greedy ones, and
every stage counts the resumed positions as hits. A stage's keys are seeded by what
changes its own K/V (its range, the arithmetic before it), not by its node nor by the
stages after it: when a stage is killed and a spare takes its range, the stages after it
keep their blocks and resume there while the spare, and every stage before it, compute
the prompt from 0 (each sends the next only the rows it needs); a stage whose range moved
serves nothing of the old plan.

The coordinator, the workers and the generation loop are real; the transport is in memory
(tests/node/inmemory.py). Plans are by memory, so that speeds measured while serving do
not move the layers between the two runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio

from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.sampling import SamplingParams
from meshnode.node.planner import NodeCapacity
from meshnode.node.stage import StageRunner
from meshnode.node.worker import Worker
from tests.node.inmemory import HOST, InMemoryMesh, add_worker, greedy_reference
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


async def test_stages_whose_range_moved_serve_nothing_of_the_old_one(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """The middle stage is killed: the last stage's node ("b") moves to the middle range,
    the spare takes the last. Their keys differ from the old run's; the host's range is
    the same and it keeps its blocks, but the stages after it hold nothing, so it computes
    the prompt again for them: the replay resumes nowhere and gets the single stage's
    tokens."""
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

            before = _hits([first.runner])
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
            assert moved.prefix.salt != old.prefix.salt  # the keys differ
            assert second.runner.prefix is first.runner.prefix  # its range is the same
            # "stormy"'s prefill resumed on the host; its replay did not
            assert _hits([second.runner]) == [before[0] + 2 * B]
            assert _hits([moved, _runner(mesh.workers["spare"])]) == [0, 0]
            nursery.cancel_scope.cancel()


class Devices(InMemoryMesh):
    """The in-memory mesh with some nodes announcing another device kind (``devices``):
    only the prefix seeds read it here (every stage computes on this CPU)."""

    def __init__(self, devices: dict[str, str]) -> None:
        super().__init__(host_memory=1 << 34)
        self.devices = devices

    def live_nodes(self) -> list[NodeCapacity]:
        nodes = super().live_nodes()
        return [dataclasses.replace(n, device=self.devices.get(n.node_id, n.device)) for n in nodes]


@pytest.mark.parametrize(
    ("chunk", "device"),
    [(256, "cpu"), (16, "cpu"), (256, "cuda")],
    ids=["one-piece", "pieces", "another-device"],
)
async def test_the_stages_after_a_replaced_one_resume_their_part(
    tmp_path: Path, hub_ref: tuple[str, Path], chunk: int, device: str
) -> None:
    """The middle stage ("a") is killed and a spare ("b", which joined after the first
    plan) takes its very range; the last stage ("c") keeps its range and the arithmetic
    before it (the cuts too: float32 on the wire), so it keeps its blocks and resumes the
    replayed prompt at 2 blocks, while the spare and the host compute it from 0. In
    pieces of 16 tokens, those that end before the last stage's start go no further than
    the spare. A spare of another device kind changes the arithmetic before the last
    stage: its seed changes, it keeps nothing and the replay resumes nowhere. The tokens
    are the single stage's."""
    ref, package = hub_ref
    mesh = Devices({"b": device})
    host = Host(mesh, package, ref, split=3, place_by_speed=False)
    host.service.chunk_tokens = chunk
    single = greedy_reference(package, PROMPT, TOKENS, CONTEXT)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, ["a", "c"])
            first = await host.ready()
            assert first.stage_nodes == (HOST, "a", "c")
            add_worker(mesh, "b", tmp_path / "b-cache", nursery)  # a spare, not yet asked
            warm, _ = await host.stream("calm", PROMPT, GREEDY)
            assert warm == single
            middle, last = _runner(mesh.workers["a"]), _runner(mesh.workers["c"])
            before = _hits([first.runner, last])

            async def kill_the_middle_stage(produced: int) -> None:
                if produced >= 6 and "a" in mesh.workers:
                    kill(mesh, "a")

            replayed, run = await host.stream(
                "stormy", PROMPT, GREEDY, on_tokens=kill_the_middle_stage
            )
            assert replayed == single
            assert run.replays == 1
            assert run.cached_tokens == 2 * B  # its first prefill resumed on every stage
            assert run.replay_cached_tokens == 0  # the host computed the replay from 0 ...
            second = await host.ready(2)
            assert second.stage_nodes == (HOST, "b", "c")
            spare, now = _runner(mesh.workers["b"]), _runner(mesh.workers["c"])
            assert (spare.stage.start, spare.stage.end) == (middle.stage.start, middle.stage.end)
            assert (now.stage.start, now.stage.end) == (last.stage.start, last.stage.end)
            assert second.runner.prefix is first.runner.prefix
            assert _hits([spare]) == [0]  # ... and so did the spare
            if device == "cpu":  # the last stage resumed both the prefill and the replay
                assert now.prefix is last.prefix
                after = _hits([second.runner, last])
                assert [a - b for a, b in zip(after, before, strict=True)] == [2 * B, 4 * B]
            else:
                assert now.prefix is not last.prefix
                assert now.prefix.salt != last.prefix.salt
                assert _hits([now]) == [0]
            nursery.cancel_scope.cancel()


async def test_a_stage_after_the_host_resumes_when_the_host_kept_nothing(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stages; the host's own pool is dropped between the runs (as when a stage-0
    forward hangs: its thread may still write the pool). The worker's stage is the same,
    so it keeps its blocks: the replay computes the prompt from 0 on the host and only the
    suffix on the worker, with the single stage's tokens."""

    async def dropped(self: object) -> None:
        return None

    monkeypatch.setattr("meshnode.node.remote.RemotePipeline.keep_prefix", dropped)
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    host = Host(mesh, package, ref, split=2, place_by_speed=False)
    single = greedy_reference(package, PROMPT, TOKENS, CONTEXT)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, ["a"])
            first = await host.ready()
            warm, _ = await host.stream("calm", PROMPT, GREEDY)
            assert warm == single
            worker = _runner(mesh.workers["a"])
            before = _hits([worker])

            async def lose_a_pass(produced: int) -> None:
                if produced == 5 and first.failure is None:
                    first.fail("a pass did not come back")

            replayed, run = await host.stream("stormy", PROMPT, GREEDY, on_tokens=lose_a_pass)
            assert replayed == single
            assert run.replays == 1
            assert run.replay_cached_tokens == 0
            second = await host.ready(2)
            assert second.runner.prefix is not first.runner.prefix
            assert _runner(mesh.workers["a"]).prefix is worker.prefix
            assert _hits([second.runner]) == [0]
            assert _hits([worker]) == [before[0] + 4 * B]  # the prefill, then the replay
            nursery.cancel_scope.cancel()
