"""The tiny Qwen3.5 hybrid over a two-stage pipeline (boundary inside a run of DeltaNet
layers): real :class:`StageRunner` objects chained in this process, driven by the real
generation loop, give the reference's greedy tokens with and without speculation."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import trio

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.batcher import BatchLimits
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import Pipeline, RequestId, StepFrame, StepResult
from meshnode.node.stage import StageRunner
from meshnode.speculative.mtp import MtpProposer
from meshnode.speculative.ngram import NgramParams, NgramProposer
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.window import WindowPolicy
from tests.engine.hybrid_model import HybridFolder, hybrid_golden
from tests.speculative.test_hybrid import PartlyRightProposer

CONTEXT = 400
RANGES = ((0, 2), (2, 8))  # layers 0-2 are DeltaNet: the boundary splits that run
PROMPTS = hybrid_golden()["prompts"]


class SilentDetokenizer:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class Chain:
    """Every stage in this process, hidden states handed from one runner to the next."""

    def __init__(self, runners: list[StageRunner]) -> None:
        self.runners = runners

    @property
    def context_size(self) -> int:
        return CONTEXT

    async def run(self, frame: StepFrame) -> StepResult:
        current = frame
        for runner in self.runners[:-1]:
            current = replace(frame, hidden=runner.activations(current))
        out = self.runners[-1].result(current)
        assert isinstance(out, StepResult)
        return out

    async def release(self, request_id: RequestId) -> None:
        for runner in self.runners:
            runner.release(request_id)


@pytest.fixture(scope="module")
def chain() -> Chain:
    source = HybridFolder()
    config = ModelConfig.from_hf(source.config)
    runners = [
        StageRunner(
            Stage(config, source, a, b, embed=a == 0, head=b == 8),
            context_size=CONTEXT,
            max_sequences=1,
        )
        for a, b in RANGES
    ]
    return Chain(runners)


async def _generate(
    chain: Chain | Pipeline, prompt: dict[str, Any], spec: Speculation | None
) -> list[int]:
    params = GenerationParams(max_new_tokens=32, sampling=SamplingParams(temperature=0.0))
    state = GenerationState(params, SilentDetokenizer())
    run = GenerationRun(RequestId(prompt["id"]), list(prompt["prompt_ids"]), params, state)
    async for _ in generate(chain, run, speculation=spec, chunk_tokens=128):
        pass
    return run.state.tokens


async def test_two_stages_match_the_reference(chain: Chain) -> None:
    for prompt in PROMPTS:
        assert await _generate(chain, prompt, None) == prompt["gen_ids"], prompt["id"]


@pytest.mark.parametrize("window", [1, 4, 16])
async def test_two_stages_with_partly_rejected_windows(chain: Chain, window: int) -> None:
    for prompt in PROMPTS[1:]:
        proposer = PartlyRightProposer(prompt["prompt_ids"], prompt["gen_ids"])

        def make(params: SamplingParams, capacity: int, p: Proposer = proposer) -> Proposer:
            return p

        spec = Speculation(make, WindowPolicy("fixed", window, 1, window), strategy="test")
        restores = [_restores(r) for r in chain.runners]
        assert await _generate(chain, prompt, spec) == prompt["gen_ids"], prompt["id"]
        assert all(_restores(r) > before for r, before in zip(chain.runners, restores, strict=True))


async def test_two_stages_with_ngram(chain: Chain) -> None:
    def make(params: SamplingParams, capacity: int) -> Proposer:
        return NgramProposer(NgramParams(1, 3))

    spec = Speculation(make, WindowPolicy("fixed", 4, 1, 4), strategy="ngram")
    for prompt in PROMPTS[1:3]:
        assert await _generate(chain, prompt, spec) == prompt["gen_ids"], prompt["id"]


def _restores(runner: StageRunner) -> int:
    """Rollbacks served by the snapshot ring on this stage so far (its status figure)."""
    return runner.memory()["ring_restores"]


def test_stage_memory_reports_the_ring(chain: Chain) -> None:
    for runner in chain.runners:
        memory = runner.memory()
        assert memory["snapshot_ring_slots"] == 17
        assert memory["snapshot_ring_bytes"] > memory["recurrent_state_bytes"] > 0
        assert memory["cache_bytes"] >= memory["snapshot_ring_bytes"]


@pytest.mark.parametrize("window", [1, 4, 16])
async def test_two_stages_with_mtp_drafts(chain: Chain, window: int) -> None:
    """The last stage's MTP module drafts; its (random) drafts never change the output."""

    def make(params: SamplingParams, capacity: int) -> Proposer:
        return MtpProposer()

    spec = Speculation(make, WindowPolicy("fixed", window, 1, window), strategy="mtp")
    last = chain.runners[-1].stage
    assert last.mtp is not None
    for prompt in PROMPTS:
        params = GenerationParams(max_new_tokens=32, sampling=SamplingParams(temperature=0.0))
        state = GenerationState(params, SilentDetokenizer())
        run = GenerationRun(RequestId(prompt["id"]), list(prompt["prompt_ids"]), params, state)
        async for _ in generate(chain, run, speculation=spec, chunk_tokens=128):
            pass
        assert run.state.tokens == prompt["gen_ids"], prompt["id"]
        assert run.spec.windows > 0  # every pass after the first verified MTP drafts
        assert run.spec.proposed >= run.spec.windows


@pytest.mark.parametrize("window", [4, 8])
async def test_rollbacks_behind_a_short_ring_prefill_again(window: int) -> None:
    """Rings of 2 slots cannot restore most rejected windows of 4 or 8 drafts: each stage
    refuses the frame (``RollbackError``), the loop prefills the history again from 0 and
    resends it, and the output is still the reference's."""
    source = HybridFolder()
    config = ModelConfig.from_hf(source.config)
    short = Chain(
        [
            StageRunner(
                Stage(config, source, a, b, embed=a == 0, head=b == 8, ring_slots=2),
                context_size=CONTEXT,
                max_sequences=1,
            )
            for a, b in RANGES
        ]
    )
    prompt = PROMPTS[1]
    proposer = PartlyRightProposer(prompt["prompt_ids"], prompt["gen_ids"])

    def make(params: SamplingParams, capacity: int) -> Proposer:
        return proposer

    spec = Speculation(make, WindowPolicy("fixed", window, 1, window), strategy="test")
    params = GenerationParams(max_new_tokens=32, sampling=SamplingParams(temperature=0.0))
    run = GenerationRun(
        RequestId(prompt["id"]),
        list(prompt["prompt_ids"]),
        params,
        GenerationState(params, SilentDetokenizer()),
    )
    async for _ in generate(short, run, speculation=spec, chunk_tokens=16):
        pass
    assert run.state.tokens == prompt["gen_ids"]
    assert run.refolds > 0
    assert all(r.memory()["snapshot_ring_slots"] == 2 for r in short.runners)


@pytest.mark.parametrize("ring", [17, 2])
async def test_concurrent_streams_are_batched_and_equal_the_reference(ring: int) -> None:
    """Every reference prompt at once on one hybrid node: the batcher fuses their prefills,
    decodes and verify windows into shared forwards, and each stream gets its own tokens.
    With 2-slot rings, windows of 4 often roll back behind the ring inside a fused batch:
    only that sequence is refused (and prefills again), the others go on."""
    source = HybridFolder()
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, 0, 8, embed=True, head=True, ring_slots=ring)
    runner = StageRunner(stage, context_size=CONTEXT, max_sequences=len(PROMPTS))
    pipeline = LocalPipeline(runner, BatchLimits(max_frames=len(PROMPTS)))
    sizes: list[int] = []
    forward_batch = stage.forward_batch

    def counted(items: Any) -> list[Any]:
        sizes.append(len(items))
        return forward_batch(items)

    stage.forward_batch = counted  # type: ignore[method-assign]
    got: dict[str, list[int]] = {}
    refolds: list[int] = []

    async def one(prompt: dict[str, Any], window: int) -> None:
        proposer = PartlyRightProposer(prompt["prompt_ids"], prompt["gen_ids"])

        def make(params: SamplingParams, capacity: int, p: Proposer = proposer) -> Proposer:
            return p

        spec = Speculation(make, WindowPolicy("fixed", window, 1, window), strategy="test")
        params = GenerationParams(max_new_tokens=32, sampling=SamplingParams(temperature=0.0))
        state = GenerationState(params, SilentDetokenizer())
        run = GenerationRun(RequestId(prompt["id"]), list(prompt["prompt_ids"]), params, state)
        async for _ in generate(pipeline, run, speculation=spec if window > 1 else None):
            pass
        got[prompt["id"]] = run.state.tokens
        refolds.append(run.refolds)

    async with trio.open_nursery() as nursery:
        for i, prompt in enumerate(PROMPTS):
            nursery.start_soon(one, prompt, 1 + 3 * (i % 2))
    for prompt in PROMPTS:
        assert got[prompt["id"]] == prompt["gen_ids"], prompt["id"]
    assert max(sizes) > 1  # sequences really shared forwards
    assert (sum(refolds) > 0) == (ring == 2)
