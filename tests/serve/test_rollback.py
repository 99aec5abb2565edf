"""Rollback across stages: after a rejected draft every stage's KV is the committed prefix.

Three real :class:`StageRunner` objects over a tiny 4-layer model are chained in this
process (the hidden states pass from one to the next exactly as ``ActivationFrame``
payloads do), and the real generation driver runs over them with a layer-skip drafter,
which gets some drafts accepted and some rejected. Each stage's engine ``Stage`` is wrapped
to record its cache length before and after every forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from meshnode.engine.config import ModelConfig
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.model import BatchRow, Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame, StepResult
from meshnode.node.stage import StageRunner
from meshnode.speculative.draft import StageProposer, layer_skip_stage
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.window import WindowPolicy
from tests.speculative.tinymodel import TinySource, tiny_config

CONTEXT = 128
RANGES = ((0, 2), (2, 3), (3, 4))  # three stages of a 4-layer model
PROMPT = [5, 9, 11, 5, 9, 11, 5, 9, 3, 7]
GREEDY = SamplingParams(temperature=0.0)


class SilentDetokenizer:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class ForwardRecord:
    start_pos: int
    tokens: int
    before: int
    after: int


class RecordingStage:
    """An engine stage that records its cache lengths around each forward."""

    def __init__(self, stage: Stage) -> None:
        self.inner = stage
        self.records: list[ForwardRecord] = []
        self.cache: KVCache | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, inputs: Any, start_pos: int, cache: KVCache, **kw: Any) -> Any:
        before = cache.length
        out = self.inner.forward(inputs, start_pos, cache, **kw)
        self.records.append(ForwardRecord(start_pos, len(inputs), before, cache.length))
        self.cache = cache
        return out

    def forward_batch(self, items: list[BatchRow]) -> list[Any]:
        return [self.forward(i.inputs, i.start_pos, i.cache, out_rows=i.out_rows) for i in items]


@dataclass
class ChainPipeline:
    """Every stage in this process, hidden states handed from one runner to the next."""

    runners: list[StageRunner]
    results: list[tuple[StepFrame, StepResult]] = field(default_factory=list)

    @property
    def context_size(self) -> int:
        return CONTEXT

    async def run(self, frame: StepFrame) -> StepResult:
        current = frame
        for runner in self.runners[:-1]:
            current = replace(frame, hidden=runner.activations(current))
        out = self.runners[-1].result(current)
        assert isinstance(out, StepResult)
        self.results.append((frame, out))
        return out

    async def release(self, request_id: RequestId) -> None:
        """Kept: the test inspects the caches after the run."""


def recording_chain(source: TinySource) -> tuple[ChainPipeline, list[RecordingStage]]:
    config = ModelConfig.from_hf(source.config)
    stages = []
    runners = []
    for start, end in RANGES:
        stage = Stage(config, source, start, end, embed=start == 0, head=end == config.num_layers)
        recording = RecordingStage(stage)
        runner = StageRunner(stage, context_size=CONTEXT, max_sequences=1)
        runner.stage = recording  # type: ignore[assignment]
        stages.append(recording)
        runners.append(runner)
    return ChainPipeline(runners), stages


async def drive(pipeline: ChainPipeline, speculation: Speculation | None) -> list[int]:
    params = GenerationParams(max_new_tokens=40, sampling=GREEDY)
    run = GenerationRun(
        RequestId("r1"), list(PROMPT), params, GenerationState(params, SilentDetokenizer())
    )
    async for _ in generate(pipeline, run, speculation=speculation):
        pass
    return run.state.tokens


@pytest.fixture(scope="module")
def source() -> TinySource:
    return TinySource(tiny_config(48, 4), seed=0, logit_scale=8.0)


def layer_skip(stage0: Stage, source: TinySource) -> Speculation:
    drafter = layer_skip_stage(stage0, 2, source)

    def make(params: SamplingParams, capacity: int) -> Proposer:
        return StageProposer(drafter, params, capacity)

    return Speculation(make, WindowPolicy("fixed", 4, 1, 4), strategy="layer-skip")


async def test_every_stage_rolls_back_to_the_committed_length(source: TinySource) -> None:
    plain_chain, plain_stages = recording_chain(source)
    plain = await drive(plain_chain, None)
    chain, stages = recording_chain(source)
    stage0 = stages[0].inner
    spec = await drive(chain, layer_skip(stage0, source))
    assert spec == plain  # greedy: identical tokens

    # Walk the passes, tracking the committed length as the host does.
    committed = len(PROMPT)
    rejected_before = False
    rollbacks = 0
    for index, (frame, result) in enumerate(chain.results):
        if frame.kind is not FrameKind.PREFILL:
            assert frame.start_pos == committed - 1  # the last committed token is re-fed
            for stage in stages:
                record = stage.records[index]
                assert record.start_pos == frame.start_pos
                if rejected_before:
                    # Stale drafts were cached; the pass began by cutting them off.
                    assert record.before > committed - 1
                    rollbacks += 1
                assert record.after == frame.end_pos
        committed += len(result.tokens)
        rejected_before = frame.kind is FrameKind.VERIFY and result.accepted < len(frame.drafts)
    assert rollbacks >= 3 * len(stages)  # several rejections, seen on every stage
    assert any(r.accepted > 0 for _, r in chain.results)  # and accepted drafts too

    # What every stage holds for the committed prefix equals the plain run's K/V.
    valid = len(PROMPT) + len(plain) - 1
    for stage, reference in zip(stages, plain_stages, strict=True):
        assert stage.cache is not None
        assert reference.cache is not None
        np.testing.assert_allclose(
            stage.cache.k[:, :, :valid], reference.cache.k[:, :, :valid], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            stage.cache.v[:, :, :valid], reference.cache.v[:, :, :valid], rtol=1e-5, atol=1e-5
        )
