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

import itertools
from collections.abc import Sequence

import pytest
import trio

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.prefix_cache import PrefixMissError
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.prefix import prefill_pieces
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.hybrid_prefix import HybridPrefix
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import RequestId, StepFrame, StepResult
from meshnode.node.prefix import PrefixIndex, host_pools, note_pass, note_release
from meshnode.node.stage import StageRunner
from meshnode.speculative.ngram import NgramProposer
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.window import WindowPolicy
from tests.engine.hybrid_model import HybridFolder, hybrid_golden

CONTEXT = 320
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=1234)
_IDS = [t for p in hybrid_golden()["prompts"] for t in p["prompt_ids"]]
SYSTEM = (_IDS * 8)[: 3 * B + 5]  # a shared "system prompt" of the reference's tokens
Output = list[tuple[int, float]]


class SilentDetokenizer:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


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
    return StageRunner(stage, context_size=CONTEXT, prefix_cache_bytes=prefix_bytes, prefix_salt="r")


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
            result = self.b.result(StepFrame(**{**_fields(frame), "hidden": hidden}))
        note_pass(self.prefix, frame)
        return result

    async def release(self, request_id: RequestId) -> None:
        async with self._lock:
            self.a.release(request_id)
            self.b.release(request_id)
        note_release(self.prefix, request_id)


def _fields(frame: StepFrame) -> dict[str, object]:
    return {name: getattr(frame, name) for name in StepFrame.__dataclass_fields__}


def _run(
    name: str, prompt: Sequence[int], sampling: SamplingParams, *, cache: bool = True, n: int = 12
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


async def _drive(pipeline: object, run: GenerationRun, spec: Speculation | None = None) -> Output:
    out: Output = []
    async for delta in generate(pipeline, run, speculation=spec, chunk_tokens=40):  # type: ignore[arg-type]
        out += [(lp.token, lp.logprob) for lp in delta.logprobs]
    return out


def _prompts() -> list[list[int]]:
    """Turns of a conversation and users of one system prompt."""
    turn1 = [*SYSTEM, 9, 8, 7]
    turn2 = [*turn1, 30, 31, 32, *range(100, 140)]
    return [turn1, turn2, [*SYSTEM, 40, 41], [*turn2, 5, 6, 7, 8]]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
async def test_resumed_requests_equal_uncached_ones_bit_for_bit(
    whole: Stage, sampling: SamplingParams, speculate: bool
) -> None:
    spec = NGRAM if speculate else None
    pipeline = LocalPipeline(_runner(whole))
    plain = LocalPipeline(_runner(whole, 0))
    assert plain.prefix is None
    assert pipeline.prefix is not None and pipeline.prefix.snapshots
    hits = []
    for i, prompt in enumerate(_prompts()):
        want = await _drive(pipeline, _run(f"a{i}", prompt, sampling, cache=False), spec)
        run = _run(f"b{i}", prompt, sampling)
        assert await _drive(pipeline, run, spec) == want
        hits.append(run.cached_tokens)
        uncached = await _drive(plain, _run(f"c{i}", prompt, sampling), spec)
        assert [t for t, _ in uncached] == [t for t, _ in want]
    # each resumes at a block boundary some earlier prompt was cut at
    assert hits == [(len(_prompts()[0]) - 1) // B * B, (len(_prompts()[1]) - 1) // B * B, 3 * B, (len(_prompts()[1]) - 1) // B * B]
