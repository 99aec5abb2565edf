"""Prefix sharing on hybrid stages (node.hybrid_prefix, engine.snapshots): a request whose
prompt begins with an earlier prompt's resumes from the recurrent snapshot its stages kept
at that prompt's last block boundary, and gets the bits it gets without the cache
(greedy and seeded, one stage and two, batched, speculating), on the tiny Qwen3.5
reference (tests/golden/tiny/qwen35-hybrid-tiny).

"Without the cache" is the same pipeline with ``cache_prompt: false``: both cut the prefill
at the same block boundaries (generation.prefix.prefill_pieces), so every row is computed
by the same path and the logits are equal bit for bit; a pipeline with no cache at all
cuts only at the chunk size, and its tokens are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
import trio

from meshnode.cli.mesh import format_status
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.prefix_cache import PrefixMissError, chain_keys
from meshnode.engine.recurrent import HybridCache, RollbackError
from meshnode.engine.sampling import SamplingParams
from meshnode.engine.snapshots import SnapshotPool
from meshnode.generation.driver import generate
from meshnode.generation.prefix import prefill_pieces
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.node.hybrid_prefix import SNAPSHOT_CONTEXTS, HybridPrefix, snapshot_bytes
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import FrameKind, Pipeline, RequestId, StepFrame, StepResult
from meshnode.node.prefix import (
    PrefixIndex,
    ResumePoint,
    host_pools,
    note_pass,
    note_release,
    snapshot_at,
)
from meshnode.node.stage import StageRunner
from meshnode.serve.node_metrics import status_metrics
from tests.engine.hybrid_model import HybridFolder, hybrid_golden
from tests.engine.moe_models import MOE_DIR
from tests.node.test_prefix import NGRAM, _run
from tests.node.test_status_text import host_body

CONTEXT = 320
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=1234)
_IDS = [t for p in hybrid_golden()["prompts"] for t in p["prompt_ids"]]
SYSTEM = (_IDS * 8)[: 3 * B + 5]  # a shared "system prompt" of the reference's tokens
Output = list[tuple[int, float]]


@pytest.fixture(scope="module")
def folder() -> HybridFolder:
    return HybridFolder()


def _stage(folder: HybridFolder, start: int, end: int) -> Stage:
    config = ModelConfig.from_hf(folder.config)
    first, last = start == 0, end == config.num_layers
    return Stage(config, folder, start, end, embed=first, head=last, mtp=False)


@pytest.fixture(scope="module")
def whole(folder: HybridFolder) -> Stage:
    return _stage(folder, 0, 8)


@pytest.fixture(scope="module")
def halves(folder: HybridFolder) -> tuple[Stage, Stage]:
    return _stage(folder, 0, 5), _stage(folder, 5, 8)  # cut inside a run of DeltaNet layers


def _runner(stage: Stage, prefix_bytes: int | None = None) -> StageRunner:
    return StageRunner(
        stage, context_size=CONTEXT, prefix_cache_bytes=prefix_bytes, prefix_salt="r"
    )


class TwoStages:
    """Two runners in a row in this process, with the host's index of what both keep."""

    def __init__(self, first: Stage, second: Stage, prefix_bytes: int | None = None) -> None:
        self.a, self.b = _runner(first, prefix_bytes), _runner(second, prefix_bytes)
        self.prefix, self.kv_blocks = host_pools(self.a, [self.b.prefix.block], "r")
        self._lock = trio.Lock()

    @property
    def context_size(self) -> int:
        return CONTEXT

    async def run(self, frame: StepFrame) -> StepResult:
        async with self._lock:
            hidden = self.a.activations(frame)
            result = self.b.result(dataclasses.replace(frame, hidden=hidden))
        note_pass(self.prefix, frame)
        return result

    async def release(self, request_id: RequestId) -> None:
        async with self._lock:
            self.a.release(request_id)
            self.b.release(request_id)
        note_release(self.prefix, request_id)


async def _drive(pipeline: Pipeline, run: GenerationRun, spec: Speculation | None = None) -> Output:
    out: Output = []
    async for delta in generate(pipeline, run, speculation=spec, chunk_tokens=40):
        out += [(lp.token, lp.logprob) for lp in delta.logprobs]
    return out


def _prompts() -> list[list[int]]:
    """Turns of a conversation and users of one system prompt."""
    turn1 = [*SYSTEM, 9, 8, 7]
    turn2 = [*turn1, 30, 31, 32, *range(100, 140)]
    return [turn1, turn2, [*SYSTEM, 40, 41], [*turn2, 5, 6, 7, 8]]


async def _compare(
    pipeline: Pipeline, plain: Pipeline, sampling: SamplingParams, spec: Speculation | None
) -> list[int]:
    """Each prompt without the cache, then with it (bit for bit the same), then on
    ``plain`` (no cache at all: the same tokens); the cached runs' ``cached_tokens``."""
    hits = []
    for i, prompt in enumerate(_prompts()):
        want = await _drive(pipeline, _run(f"a{i}", prompt, sampling, cache=False), spec)
        run = _run(f"b{i}", prompt, sampling)
        assert await _drive(pipeline, run, spec) == want
        hits.append(run.cached_tokens)
        uncached = await _drive(plain, _run(f"c{i}", prompt, sampling), spec)
        assert [t for t, _ in uncached] == [t for t, _ in want]
    return hits


def _boundary(prompt: Sequence[int]) -> int:
    return (len(prompt) - 1) // B * B


def _expected_hits() -> list[int]:
    """Each prompt resumes at its own last boundary (its uncached run just kept it), but
    the fourth: the second prompt's, the furthest boundary it shares."""
    p = _prompts()
    return [_boundary(p[0]), _boundary(p[1]), 3 * B, _boundary(p[3])]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
async def test_resumed_requests_equal_uncached_ones_bit_for_bit(
    whole: Stage, sampling: SamplingParams, speculate: bool
) -> None:
    pipeline = LocalPipeline(_runner(whole))
    plain = LocalPipeline(_runner(whole, 0))
    assert plain.prefix is None  # no snapshots kept: no block size announced, no index
    assert pipeline.prefix is not None
    assert pipeline.prefix.snapshots
    assert pipeline.kv_blocks is None  # admission stays by sequences on a hybrid stage
    hits = await _compare(pipeline, plain, sampling, NGRAM if speculate else None)
    assert hits == _expected_hits()
    usage = pipeline.runner.kv_usage()
    assert usage["prefix_hit_tokens"] == sum(hits)
    assert 0 < usage["prefix_snapshots"] <= usage["prefix_snapshots_max"]


async def test_the_mixture_of_experts_hybrid_resumes_with_the_same_bits() -> None:
    """The tiny Qwen3.5 MoE reference (routed experts in every layer): the same rule."""
    folder = HybridFolder(MOE_DIR / "qwen35-moe-tiny")
    config = ModelConfig.from_hf(folder.config)
    stage = Stage(config, folder, 0, config.num_layers, embed=True, head=True, mtp=False)
    pipeline, plain = LocalPipeline(_runner(stage)), LocalPipeline(_runner(stage, 0))
    assert await _compare(pipeline, plain, GREEDY, None) == _expected_hits()


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
async def test_two_stages_resume_from_the_snapshots_both_keep(
    halves: tuple[Stage, Stage], speculate: bool
) -> None:
    pipeline, plain = TwoStages(*halves), TwoStages(*halves, prefix_bytes=0)
    assert pipeline.prefix is not None
    assert plain.prefix is None
    hits = await _compare(pipeline, plain, SEEDED, NGRAM if speculate else None)
    assert hits == _expected_hits()
    for runner in (pipeline.a, pipeline.b):
        assert runner.kv_usage()["prefix_hit_tokens"] == sum(hits)


async def test_a_stage_that_lost_the_snapshot_makes_the_host_start_over(
    halves: tuple[Stage, Stage],
) -> None:
    pipeline = TwoStages(*halves)
    prompt = _prompts()[1]
    first = await _drive(pipeline, _run("m1", prompt, GREEDY))
    assert isinstance(pipeline.b.prefix, HybridPrefix)
    assert pipeline.b.prefix.snaps is not None
    pipeline.b.prefix.snaps.clear()  # evicted on the second stage only
    run = _run("m2", prompt, GREEDY)
    assert await _drive(pipeline, run) == first
    assert run.cached_tokens == 0
    assert pipeline.a.live_sequences == pipeline.b.live_sequences == 0
    third = _run("m3", prompt, GREEDY)  # kept again by the second run
    assert await _drive(pipeline, third) == first
    assert third.cached_tokens == _boundary(prompt)


async def test_batched_requests_resume_with_their_own_bits(whole: Stage) -> None:
    """Four at a time in one forward, twice: the second round resumes every prompt."""
    sampling = SEEDED
    pipeline = LocalPipeline(_runner(whole))
    prompts = _prompts()
    want = [
        await _drive(pipeline, _run(f"r{i}", p, sampling, cache=False), NGRAM)
        for i, p in enumerate(prompts)
    ]
    pipeline = LocalPipeline(_runner(whole))
    for rnd in range(2):
        runs = [_run(f"{rnd}-{i}", p, sampling) for i, p in enumerate(prompts)]
        got: list[Output] = [[] for _ in runs]

        async def one(i: int, runs: list[GenerationRun] = runs, got: list[Output] = got) -> None:
            got[i] = await _drive(pipeline, runs[i], NGRAM)

        async with trio.open_nursery() as nursery:
            for i in range(len(runs)):
                nursery.start_soon(one, i)
        assert got == want
    assert all(run.cached_tokens == _boundary(p) for run, p in zip(runs, prompts, strict=True))


async def test_snapshots_hold_committed_prompts_only(whole: Stage) -> None:
    """Speculating (drafts rolled back) leaves snapshots whose states are those of a fresh
    prefill of their tokens, and every snapshot's tokens begin some prompt."""
    pipeline = LocalPipeline(_runner(whole))
    for i, prompt in enumerate(_prompts()):
        await _drive(pipeline, _run(f"s{i}", prompt, GREEDY, n=40), NGRAM)
    prefix = pipeline.runner.prefix
    assert isinstance(prefix, HybridPrefix)
    snaps = prefix.snaps
    assert snaps is not None
    assert len(snaps) > 0
    for entry in snaps._entries.values():
        tokens = list(entry.tokens)
        assert any(p[: len(tokens)] == tokens for p in _prompts())
        cache = whole.new_cache(CONTEXT)
        assert isinstance(cache, HybridCache)
        for at, piece in prefill_pieces(tokens, 0, 40, B):
            whole.forward(np.asarray(piece), at, cache, out_rows=1)
        assert np.array_equal(cache.state, entry.snap.state)
        assert np.array_equal(cache.conv, entry.snap.conv)
        assert np.array_equal(cache.k[:, :, : len(tokens)], entry.snap.k)


@pytest.mark.parametrize(
    ("length", "start", "size", "want"),
    [
        (104, 0, 40, [0, 32, 64, 96, 104]),  # chunks of a block, the last boundary
        (104, 64, 256, [64, 96, 104]),  # resumed: from the snapshot to the boundary
        (96, 0, 256, [0, 64, 96]),  # a prompt ending on a boundary: its last row after
        (20, 0, 256, [0, 20]),  # shorter than a block: one piece
        (300, 32, 100, [32, 96, 192, 288, 300]),  # cuts at multiples of 96
    ],
)
def test_hybrid_prefill_pieces(length: int, start: int, size: int, want: list[int]) -> None:
    prompt = list(range(length))
    pieces = prefill_pieces(prompt, start, size, B)
    assert [at for at, _ in pieces] + [length] == want
    assert [t for _, piece in pieces for t in piece] == prompt[start:]
    assert prefill_pieces(prompt, start, size) == [
        (at, prompt[at : at + size]) for at in range(start, length, size)
    ]


def _frame(kind: FrameKind, start: int, tokens: Sequence[int], final: bool = True) -> StepFrame:
    return StepFrame(RequestId("x"), kind, start, tuple(tokens), GREEDY, final=final)


def _point(point: ResumePoint) -> tuple[int, bytes | None]:
    return point.start, point.key


def test_the_host_believes_the_boundaries_prefill_passes_ended_at() -> None:
    index = PrefixIndex("r", block=B, snapshots=True)
    prompt = list(range(3, 3 + 3 * B + 7))
    assert _point(index.resume_point(RequestId("x"), prompt)) == (0, None)
    index.passed(_frame(FrameKind.PREFILL, 0, prompt[: 2 * B], final=False))
    index.passed(_frame(FrameKind.PREFILL, 2 * B, prompt[2 * B : 3 * B], final=False))
    index.passed(_frame(FrameKind.PREFILL, 3 * B, prompt[3 * B :]))
    index.passed(_frame(FrameKind.DECODE, len(prompt), [5]))
    keys = chain_keys("r", [*prompt, 5], B)
    assert keys[0] not in index._keys  # inside a pass: no snapshot there
    assert keys[1] in index._keys
    assert keys[2] in index._keys
    assert _point(index.resume_point(RequestId("y"), [*prompt, 5, 6])) == (3 * B, keys[2])
    other = [*prompt[: 2 * B + 1], 99, 98]  # shares two blocks and a bit
    assert _point(index.resume_point(RequestId("z"), other)) == (2 * B, keys[1])
    index.missed(prompt)
    assert _point(index.resume_point(RequestId("w"), prompt)) == (0, None)


@pytest.mark.parametrize(
    ("kind", "start", "rows", "kept"),
    [
        (FrameKind.PREFILL, 0, 2 * B, True),
        (FrameKind.PREFILL, 2 * B, B, True),
        (FrameKind.PREFILL, 0, 2 * B - 1, False),  # not at a boundary
        (FrameKind.PREFILL, 2 * B - 8, 8, False),  # a replay's short last piece
        (FrameKind.VERIFY, B, B, False),  # drafts: never a snapshot
        (FrameKind.DECODE, 2 * B - 1, 1, False),
    ],
)
def test_where_snapshots_are_kept(kind: FrameKind, start: int, rows: int, kept: bool) -> None:
    frame = _frame(kind, start, [3] * rows)
    assert snapshot_at(frame, B) is kept


def test_snapshot_pool_bounds_and_misses(whole: Stage) -> None:
    cache = whole.new_cache(CONTEXT)
    assert isinstance(cache, HybridCache)
    whole.forward(np.asarray(SYSTEM[:B]), 0, cache, out_rows=1)
    size = cache.snapshot().nbytes()
    assert size == snapshot_bytes(whole, B)
    default = HybridPrefix.for_stage(whole, CONTEXT, budget_bytes=None, salt="r").snaps
    assert default is not None
    assert default.budget == SNAPSHOT_CONTEXTS * snapshot_bytes(whole, CONTEXT)
    pool = SnapshotPool(budget=3 * size, limit=2)
    keys = [bytes([i]) * 16 for i in range(4)]
    assert pool.store(keys[0], SYSTEM[:B], cache)
    assert pool.store(keys[1], SYSTEM[:B], cache)
    assert pool.store(keys[0], SYSTEM[:B], cache)  # kept: now the most recently used
    assert not pool.store(keys[0], SYSTEM[1 : B + 1], cache)  # a collision keeps the first
    assert pool.store(keys[2], SYSTEM[:B], cache)
    assert len(pool) == 2
    assert not pool.holds(keys[1])
    assert pool.stats.evicted == 1
    assert not SnapshotPool(budget=size - 1).store(keys[3], SYSTEM[:B], cache)
    fresh = whole.new_cache(CONTEXT)
    assert isinstance(fresh, HybridCache)
    with pytest.raises(PrefixMissError):
        pool.restore(keys[1], fresh)
    assert pool.restore(keys[2], fresh) == SYSTEM[:B]
    assert fresh.length == B
    assert np.array_equal(fresh.state, cache.state)
    with pytest.raises(RollbackError, match="replay the sequence from position 0"):
        fresh.rollback(B - 1)  # the ring holds nothing before the snapshot
    with pytest.raises(ValueError, match="empty cache"):
        fresh.restore(cache.snapshot())


HYBRID_KV = {
    "sequences": 1,
    "max_sequences": 8,
    "used_tokens": 40,
    "capacity_tokens": 2048,
    "prefix_snapshots": 3,
    "prefix_snapshots_max": 16,
    "prefix_snapshot_bytes": 5000,
    "prefix_snapshot_budget_bytes": 90000,
    "prefix_block_tokens": 32,
    "prefix_hit_tokens": 96,
    "prefix_miss_tokens": 150,
    "prefix_evicted_snapshots": 1,
}


def test_metrics_and_status_show_a_hybrid_stages_snapshots() -> None:
    lines = list(status_metrics({"run": {"kv": HYBRID_KV}}))
    assert 'meshnode_prefix_cache_snapshots{role="worker"} 3' in lines
    assert 'meshnode_prefix_cache_snapshot_bytes{role="worker"} 5000' in lines
    assert 'meshnode_prefix_cache_hit_tokens_total{role="worker"} 96' in lines
    assert 'meshnode_prefix_cache_evicted_snapshots_total{role="worker"} 1' in lines
    assert not any("prefix_cache_blocks" in line for line in lines)
    body = host_body("ready")
    body["host"]["kv"] = HYBRID_KV
    text = format_status(body).splitlines()
    want = "3 snapshots of at most 16 (5000 bytes); 96 prompt tokens reused, 150 computed"
    assert f"prefix   stage 0: {want}" in text
