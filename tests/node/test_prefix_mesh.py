"""Prefix sharing across a pipeline (node.prefix's rule, over the wire): a request resumes
from the prefix every stage holds, with the tokens it gets without the cache, and a stage
that lacks the prefix answers PREFIX_MISS, after which the host prefills from 0.

The coordinator and workers are real and every message crosses the wire codec
(tests/node/inmemory.py); the model is the tiny GGUF of the hub fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.pipeline import RequestId
from meshnode.node.remote import RemotePipeline
from meshnode.node.stage import StageRunner
from meshnode.node.worker import Worker
from meshnode.speculative.ngram import NgramProposer
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.window import WindowPolicy
from tests.node.inmemory import InMemoryMesh, add_worker, serve

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=77)
STEM = [(11 * i + 5) % 250 + 3 for i in range(B + 4)]  # shared by every prompt
PROMPTS = [[*STEM, 9, 8], [*STEM, 40, 41, 42, 43, 44], [*STEM[: B + 1], 7], [*STEM, 9, 8, 1]]


class SilentDetokenizer:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def _ngram(params: SamplingParams, capacity: int) -> Proposer:
    return NgramProposer()


NGRAM = Speculation(_ngram, WindowPolicy("fixed", 3, 1, 3), strategy="ngram")


def _runner(worker: Worker) -> StageRunner:
    assert worker.run is not None
    assert worker.run.runner is not None
    return worker.run.runner


async def _generate(
    pipeline: RemotePipeline,
    name: str,
    prompt: list[int],
    sampling: SamplingParams,
    *,
    cache: bool = True,
    speculation: Speculation | None = None,
) -> tuple[list[int], int]:
    params = GenerationParams(max_new_tokens=10, sampling=sampling, cache_prompt=cache)
    run = GenerationRun(
        RequestId(name), list(prompt), params, GenerationState(params, SilentDetokenizer())
    )
    async for _ in generate(pipeline, run, speculation=speculation, chunk_tokens=16):
        pass
    return run.state.tokens, run.cached_tokens


@pytest.mark.parametrize(
    ("stages", "sampling", "speculation"),
    [(2, GREEDY, None), (2, SEEDED, None), (2, GREEDY, NGRAM), (3, GREEDY, None)],
    ids=["2-greedy", "2-seeded", "2-ngram", "3-greedy"],
)
async def test_requests_resume_from_the_prefix_every_stage_holds(
    tmp_path: Path,
    hub_ref: tuple[str, Path],
    stages: int,
    sampling: SamplingParams,
    speculation: Speculation | None,
) -> None:
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        for name in "ab"[: stages - 1]:
            add_worker(mesh, name, tmp_path / f"{name}-cache", nursery)
        pipeline = await serve(mesh, ref, package, stages, nursery)
        assert len(pipeline.stage_nodes) == stages
        assert pipeline.prefix is not None  # every stage announced its pool in Ready
        for i, prompt in enumerate(PROMPTS):
            want, none = await _generate(
                pipeline, f"ref{i}", prompt, sampling, cache=False, speculation=speculation
            )
            got, cached = await _generate(
                pipeline, f"c{i}", prompt, sampling, speculation=speculation
            )
            assert none == 0
            assert cached == B  # the reference stored the stem's first block everywhere
            assert got == want
        await trio.testing.wait_all_tasks_blocked()
        for worker in mesh.workers.values():
            usage = _runner(worker).kv_usage()
            assert usage["prefix_hit_tokens"] == B * len(PROMPTS)
            assert usage["sequences"] == 0
            assert usage["prefix_blocks_used"] == 0
        nursery.cancel_scope.cancel()


async def test_a_stage_that_lacks_the_prefix_makes_the_host_start_over(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "a", tmp_path / "a-cache", nursery)
        add_worker(mesh, "b", tmp_path / "b-cache", nursery)
        pipeline = await serve(mesh, ref, package, 3, nursery)
        want, _ = await _generate(pipeline, "first", PROMPTS[1], GREEDY)
        await trio.testing.wait_all_tasks_blocked()
        last = _runner(mesh.workers["b"])
        assert last.prefix.pool is not None
        last.prefix.pool.clear()  # the last stage evicted it; the host does not know
        got, cached = await _generate(pipeline, "second", PROMPTS[1], GREEDY)
        assert got == want
        assert cached == 0
        got, cached = await _generate(pipeline, "third", PROMPTS[1], GREEDY)
        assert got == want
        assert cached == B  # the second run stored it again
        await trio.testing.wait_all_tasks_blocked()
        assert pipeline.runner.live_sequences == 0
        assert not any(_runner(w).live_sequences for w in mesh.workers.values())
        nursery.cancel_scope.cancel()


async def test_concurrent_requests_share_the_prefix_across_stages(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "a", tmp_path / "a-cache", nursery)
        pipeline = await serve(mesh, ref, package, 2, nursery)
        solo = [
            (await _generate(pipeline, f"s{i}", p, SEEDED, cache=False))[0]
            for i, p in enumerate(PROMPTS)
        ]
        outputs: list[tuple[list[int], int]] = [([], 0) for _ in PROMPTS]

        async def one(i: int) -> None:
            outputs[i] = await _generate(pipeline, f"r{i}", PROMPTS[i], SEEDED)

        async with trio.open_nursery() as streams:
            for i in range(len(PROMPTS)):
                streams.start_soon(one, i)
        assert [tokens for tokens, _ in outputs] == solo
        assert all(cached == B for _, cached in outputs)
        nursery.cancel_scope.cancel()
