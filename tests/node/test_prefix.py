"""Prefix sharing on one node (node.prefix, generation.prefix): a request that resumes from the
stage's cached prefix gets exactly the tokens it gets without one, greedy and seeded,
alone, batched and speculating; a rolled-back draft never lands in a cached block; and
many concurrent sequences through a small pool never corrupt each other.

Log-probabilities agree to float32 rounding, not bit for bit: the engine's products are
not invariant to the number of rows a forward carries (the uncached engine's logits move
in the last bits with the prefill chunk size too), and a resumed prompt computes fewer
rows. The wide logit spread keeps that rounding from ever deciding a token.

The model is the tiny random Llama of the batching tests (wide logit spread), run by the
real :class:`StageRunner` behind a :class:`LocalPipeline`.
"""

from __future__ import annotations

import random

import pytest
import trio

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import RequestId
from meshnode.node.prefix import pool_blocks
from meshnode.node.stage import StageRunner
from meshnode.speculative.ngram import NgramProposer
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.window import WindowPolicy
from tests.speculative.tinymodel import TinySource, tiny_config

CONTEXT = 256
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=1234)
SYSTEM = [(7 * i + 3) % 45 + 3 for i in range(3 * B + 5)]  # a shared "system prompt"
Output = list[tuple[int, float]]


def same(got: Output, want: Output) -> bool:
    """Equal tokens, log-probabilities equal to float32 rounding (module docstring)."""
    return [t for t, _ in got] == [t for t, _ in want] and [lp for _, lp in got] == (
        pytest.approx([lp for _, lp in want], rel=1e-5, abs=1e-5)
    )


class SilentDetokenizer:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@pytest.fixture(scope="module")
def stage() -> Stage:
    source = TinySource(tiny_config(48, 3), seed=0, logit_scale=8.0)
    config = ModelConfig.from_hf(source.config)
    return Stage(config, source, 0, config.num_layers, embed=True, head=True)


def _pipeline(stage: Stage, prefix_bytes: int | None = None) -> LocalPipeline:
    runner = StageRunner(stage, context_size=CONTEXT, prefix_cache_bytes=prefix_bytes)
    return LocalPipeline(runner)


def _run(
    name: str, prompt: list[int], sampling: SamplingParams, *, cache: bool = True, n: int = 12
) -> GenerationRun:
    params = GenerationParams(
        max_new_tokens=n, sampling=sampling, top_logprobs=2, cache_prompt=cache
    )
    return GenerationRun(
        RequestId(name), list(prompt), params, GenerationState(params, SilentDetokenizer())
    )


def _ngram(params: SamplingParams, capacity: int) -> Proposer:
    return NgramProposer()


NGRAM = Speculation(_ngram, WindowPolicy("fixed", 3, 1, 3), strategy="ngram")


async def _drive(
    pipeline: LocalPipeline, run: GenerationRun, speculation: Speculation | None = None
) -> Output:
    out: Output = []
    async for delta in generate(pipeline, run, speculation=speculation, chunk_tokens=40):
        out += [(lp.token, lp.logprob) for lp in delta.logprobs]
    return out


def _prompts() -> list[list[int]]:
    """Turns of a conversation and users of one system prompt: each shares whole blocks
    with an earlier one."""
    turn1 = [*SYSTEM, 9, 8, 7]
    turn2 = [*turn1, 30, 31, 32, *range(10, 40)]
    return [turn1, turn2, [*SYSTEM, 40, 41], [*SYSTEM, 42], [*turn2, 5, 6, 7, 8]]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
async def test_resumed_requests_equal_uncached_ones_bit_for_bit(
    stage: Stage, sampling: SamplingParams, speculate: bool
) -> None:
    spec = NGRAM if speculate else None
    reference = _pipeline(stage, 0)
    cached = _pipeline(stage)
    assert reference.prefix is None
    assert cached.prefix is not None
    hits = []
    for i, prompt in enumerate(_prompts()):
        want = await _drive(reference, _run(f"a{i}", prompt, sampling), spec)
        run = _run(f"b{i}", prompt, sampling)
        assert same(await _drive(cached, run, spec), want)
        hits.append(run.cached_tokens)
    assert hits[0] == 0
    assert all(h > 0 and h % B == 0 for h in hits[1:])
    assert hits[1] == len(SYSTEM) // B * B
    usage = cached.runner.kv_usage()
    assert usage["prefix_hit_tokens"] == sum(hits)
    assert usage["prefix_blocks_used"] == 0  # every sequence released its blocks


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
async def test_the_next_turn_resumes_after_the_reply(stage: Stage, speculate: bool) -> None:
    """A chat's next turn resends the reply: its blocks were stored as it was decoded."""
    spec = NGRAM if speculate else None
    pipeline = _pipeline(stage)
    turn = [*SYSTEM, 9, 8, 7]
    for n in range(3):
        run = _run(f"t{n}", turn, GREEDY, n=20)
        want = await _drive(_pipeline(stage, 0), _run(f"u{n}", turn, GREEDY, n=20), spec)
        assert same(await _drive(pipeline, run, spec), want)
        if n:  # all of the previous turn but its last token (never in the cache)
            assert run.cached_tokens == (len(turn) - 3 - 2) // B * B
        turn = [*run.history, 30, 31, 32]


async def test_a_rolled_back_draft_never_lands_in_a_cached_block(stage: Stage) -> None:
    pipeline = _pipeline(stage)
    pool = pipeline.runner.prefix.pool
    assert pool is not None
    histories = []
    for i, prompt in enumerate(_prompts()):
        run = _run(f"s{i}", prompt, GREEDY, n=40)
        await _drive(pipeline, run, NGRAM)
        histories.append(run.history)
    assert sum(r for r in (pool.stats.stored_blocks,)) > 0
    # Every cached block holds the tokens of some request's committed history at its place.
    for block in pool._blocks.values():
        chain = [block]
        while chain[-1].parent is not None:
            chain.append(pool._blocks[chain[-1].parent])
        tokens = [t for b in reversed(chain) for t in b.tokens]
        assert any(h[: len(tokens)] == tokens for h in histories), tokens


async def test_opting_out_computes_the_whole_prompt(stage: Stage) -> None:
    pipeline = _pipeline(stage)
    prompt = _prompts()[0]
    first = await _drive(pipeline, _run("o1", prompt, GREEDY))
    run = _run("o2", prompt, GREEDY, cache=False)
    assert same(await _drive(pipeline, run), first)
    assert run.cached_tokens == 0
    again = _run("o3", prompt, GREEDY)
    assert same(await _drive(pipeline, again), first)
    assert again.cached_tokens == 3 * B


async def test_a_miss_is_sent_again_from_the_start(stage: Stage) -> None:
    """The host believes a prefix the stage has since dropped: the stage refuses the
    resumed frame and the request is prefilled from 0, with the same output."""
    pipeline = _pipeline(stage)
    prompt = _prompts()[1]
    first = await _drive(pipeline, _run("m1", prompt, GREEDY))
    pool = pipeline.runner.prefix.pool
    assert pool is not None
    pool.clear()
    run = _run("m2", prompt, GREEDY)
    assert same(await _drive(pipeline, run), first)
    assert run.cached_tokens == 0
    assert pipeline.runner.live_sequences == 0
    third = _run("m3", prompt, GREEDY)  # stored again by the second run
    assert same(await _drive(pipeline, third), first)
    assert third.cached_tokens > 0


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_many_concurrent_sequences_through_a_small_pool(
    stage: Stage, sampling: SamplingParams
) -> None:
    """Random prompts over a few shared prefixes, eight at a time, through a pool of six
    cached blocks (blocks in use, evictions): each output equals its uncached run."""
    rng = random.Random(7)
    stems = [[rng.randrange(3, 48) for _ in range(2 * B + 3)] for _ in range(3)]
    prompts = []
    for _ in range(24):
        stem = rng.choice(stems)[: rng.randrange(1, 2 * B + 3)]
        prompts.append(stem + [rng.randrange(3, 48) for _ in range(rng.randrange(1, 50))])
    reference = _pipeline(stage, 0)
    want = [await _drive(reference, _run(f"r{i}", p, sampling)) for i, p in enumerate(prompts)]
    per_block = 2 * 3 * 2 * B * 8 * 4  # K and V, 3 layers, 2 KV heads x 8 dims, f32
    pipeline = _pipeline(stage, 6 * per_block)
    runs = [_run(f"c{i}", p, sampling) for i, p in enumerate(prompts)]
    got: list[Output] = [[] for _ in runs]
    limit = trio.Semaphore(8)

    async def one(i: int) -> None:
        async with limit:
            got[i] = await _drive(pipeline, runs[i])

    for _ in range(2):  # the second round finds the first's blocks (those that fit)
        async with trio.open_nursery() as nursery:
            for i in range(len(runs)):
                nursery.start_soon(one, i)
        assert all(same(g, w) for g, w in zip(got, want, strict=True))
        runs = [_run(f"d{i}", p, sampling) for i, p in enumerate(prompts)]
    usage = pipeline.runner.kv_usage()
    runner = pipeline.runner
    # a few whole contexts and a block for a copy-on-write; cached prefixes take free ones
    assert usage["prefix_blocks_total"] == pool_blocks(runner.context_size, runner.max_sequences)
    assert usage["prefix_blocks_cached"] <= 6
    assert usage["prefix_hit_tokens"] > 0
    assert usage["prefix_evicted_blocks"] > 0
    assert usage["prefix_blocks_used"] == 0
