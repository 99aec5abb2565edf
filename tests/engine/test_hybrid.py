"""The hybrid stage against the tiny Qwen3.5 reference (transformers, float32): greedy
continuations exactly, in one stage and split inside a run of DeltaNet layers; chunked
prefill and row-by-row decode agree; the snapshot ring rolls the recurrent state back."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from meshnode.engine.config import ModelConfig
from meshnode.engine.hybrid_config import HybridConfig, HybridConfigError
from meshnode.engine.model import BatchRow, Stage
from meshnode.engine.recurrent import (
    DEFAULT_RING_SLOTS,
    MAX_RING_SLOTS,
    HybridCache,
    RollbackError,
    ring_slots_for,
)
from tests.engine.hybrid_model import HybridFolder, hybrid_golden

GOLDEN = hybrid_golden()
PROMPTS = {p["id"]: p for p in GOLDEN["prompts"]}


@pytest.fixture(scope="module")
def folder() -> HybridFolder:
    return HybridFolder()


def _stage(folder: HybridFolder, start: int, end: int, ring: int = 17) -> Stage:
    config = ModelConfig.from_hf(folder.config)
    first, last = start == 0, end == config.num_layers
    return Stage(config, folder, start, end, embed=first, head=last, ring_slots=ring, mtp=False)


def _cache(stage: Stage, max_tokens: int) -> HybridCache:
    cache = stage.new_cache(max_tokens)
    assert isinstance(cache, HybridCache)
    return cache


class Pipeline:
    """Stages in a row, each with its own cache for one sequence (no network)."""

    def __init__(self, stages: list[Stage], capacity: int) -> None:
        self.stages = stages
        self.caches = [s.new_cache(capacity) for s in stages]

    def forward(self, ids: list[int], start: int, out_rows: int | None = None) -> Any:
        x: Any = np.asarray(ids, dtype=np.int64)
        for stage, cache in zip(self.stages, self.caches, strict=True):
            x = stage.forward(x, start, cache, out_rows=out_rows)
        return x


def _greedy(pipe: Pipeline, prompt: list[int], steps: int, chunk: int = 64) -> list[int]:
    for lo in range(0, len(prompt), chunk):
        logits = pipe.forward(prompt[lo : lo + chunk], lo, out_rows=1)
    out: list[int] = []
    pos = len(prompt)
    for _ in range(steps):
        out.append(int(np.argmax(logits[-1])))
        logits = pipe.forward([out[-1]], pos)
        pos += 1
    return out


@pytest.mark.parametrize("split", [None, 2, 5])
def test_greedy_continuations_match_the_reference(folder: HybridFolder, split: int | None) -> None:
    """One stage, and two stages whose boundary falls inside a run of DeltaNet layers."""
    bounds = [0, 8] if split is None else [0, split, 8]
    stages = [_stage(folder, a, b) for a, b in itertools.pairwise(bounds)]
    for prompt in GOLDEN["prompts"]:
        pipe = Pipeline(stages, len(prompt["prompt_ids"]) + 40)
        got = _greedy(pipe, prompt["prompt_ids"], len(prompt["gen_ids"]))
        assert got == prompt["gen_ids"], prompt["id"]


def test_last_prompt_logits_match_the_reference(folder: HybridFolder) -> None:
    stage = _stage(folder, 0, 8)
    for prompt in GOLDEN["prompts"]:
        ids = prompt["prompt_ids"]
        logits = stage.forward(np.asarray(ids), 0, _cache(stage, len(ids)), out_rows=1)[-1]
        want_ids, want_values = prompt["last_prompt_logits_top5"]
        assert np.argsort(-logits)[:5].tolist() == want_ids
        np.testing.assert_allclose(logits[want_ids], want_values, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_equals_one_pass_and_decode(folder: HybridFolder) -> None:
    stage = _stage(folder, 0, 8)
    ids = PROMPTS["p_long"]["prompt_ids"][:40]
    whole = stage.forward(np.asarray(ids), 0, _cache(stage, 64))
    cache = _cache(stage, 64)
    pieces = [stage.forward(np.asarray(ids[:16]), 0, cache)]
    pieces += [stage.forward(np.asarray([t]), 16 + i, cache) for i, t in enumerate(ids[16:])]
    np.testing.assert_allclose(np.concatenate(pieces), whole, rtol=1e-4, atol=1e-4)


def _state(cache: HybridCache) -> tuple[np.ndarray, np.ndarray]:
    return cache.conv.copy(), cache.state.copy()


@pytest.mark.parametrize("back", [0, 1, 3, 6])
def test_ring_rollback_restores_the_state_after_any_row_of_the_last_pass(
    folder: HybridFolder, back: int
) -> None:
    """Verify 7 rows, roll back to row j: the state is that of a run that stopped at j."""
    stage = _stage(folder, 0, 8)
    ids = PROMPTS["p_mixed"]["prompt_ids"]
    prefix, window = ids[:20], ids[20:27]
    reference = _cache(stage, 64)
    stage.forward(np.asarray(prefix + window[: 7 - back]), 0, reference)
    cache = _cache(stage, 64)
    stage.forward(np.asarray(prefix), 0, cache)
    stage.forward(np.asarray(window), 20, cache)
    cache.rollback(27 - back)
    # (the same math; only BLAS's blocking differs with the pass's row count)
    for got, want in zip(_state(cache), _state(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # and the next row computes what a run without the detour computes
    nxt = np.asarray([ids[27 - back]])
    np.testing.assert_allclose(
        stage.forward(nxt, 27 - back, cache),
        stage.forward(nxt, 27 - back, reference),
        rtol=1e-4,
        atol=1e-4,
    )
    assert cache.restores == (1 if back else 0)


def test_rollback_behind_the_ring_is_refused_with_a_clear_error(folder: HybridFolder) -> None:
    stage = _stage(folder, 0, 8, ring=4)
    cache = _cache(stage, 64)
    stage.forward(np.asarray(PROMPTS["p_mixed"]["prompt_ids"][:20]), 0, cache)
    with pytest.raises(RollbackError, match="replay"):
        cache.rollback(15)
    assert cache.length == 20  # nothing lost
    cache.rollback(17)  # inside the ring
    cache.rollback(0)  # from scratch is always possible
    assert cache.length == 0
    assert not cache.state.any()
    assert not cache.conv.any()


def test_ring_memory_is_fixed_per_sequence(folder: HybridFolder) -> None:
    config = HybridConfig.from_hf(folder.config)
    stage = _stage(folder, 0, 5, ring=9)  # layers 0-4: four DeltaNet, one attention
    small, large = _cache(stage, 10), _cache(stage, 1000)
    per_layer = config.recurrent_shape().nbytes()
    assert small.ring_nbytes() == large.ring_nbytes() == 4 * 9 * per_layer
    assert small.recurrent_nbytes() + small.ring_nbytes() == config.recurrent_bytes(0, 5, 9)


def test_incomplete_moe_and_unknown_layer_types_are_refused(folder: HybridFolder) -> None:
    """Experts without a top-k (Qwen3.5-MoE runs: ``tests/engine/test_moe.py``)."""
    with pytest.raises(HybridConfigError, match="lacks 'num_experts_per_tok'"):
        HybridConfig.from_hf({**folder.config, "num_experts": 8})
    types = ["mamba", *folder.config["layer_types"][1:]]
    with pytest.raises(HybridConfigError, match="layer type"):
        HybridConfig.from_hf({**folder.config, "layer_types": types})


def test_ring_slots_follow_the_largest_window() -> None:
    assert ring_slots_for(0) == 1  # no speculation: decode frames never roll back
    assert ring_slots_for(4) == 5
    assert ring_slots_for(16) == DEFAULT_RING_SLOTS
    assert ring_slots_for(10_000) == MAX_RING_SLOTS  # deeper rollbacks prefill again
    with pytest.raises(ValueError, match="max_window must be >= 0"):
        ring_slots_for(-1)


@pytest.mark.parametrize("split", [None, 3])
def test_batched_sequences_get_the_reference_continuations(
    folder: HybridFolder, split: int | None
) -> None:
    """Every reference prompt at once: prefills of different lengths in one pass, then each
    step's decode rows in one pass (two stages: hidden rows cross between them), with a
    rolled-back verify-sized pass in the middle. Each sequence's greedy tokens are the
    reference's, and the ring still restores each sequence's own state."""
    bounds = [0, 8] if split is None else [0, split, 8]
    stages = [_stage(folder, a, b) for a, b in itertools.pairwise(bounds)]
    prompts = GOLDEN["prompts"]
    caches = [[s.new_cache(len(p["prompt_ids"]) + 40) for s in stages] for p in prompts]

    def run(inputs: list[Any], starts: list[int], out_rows: int | None) -> list[Any]:
        xs: list[Any] = [np.asarray(i) for i in inputs]
        for j, stage in enumerate(stages):
            rows = [
                BatchRow(x, start, cache[j], out_rows)
                for x, start, cache in zip(xs, starts, caches, strict=True)
            ]
            xs = stage.forward_batch(rows)
        return xs

    outs = run([p["prompt_ids"] for p in prompts], [0] * len(prompts), 1)
    got: list[list[int]] = [[int(np.argmax(o[-1]))] for o in outs]
    positions = [len(p["prompt_ids"]) for p in prompts]
    for step in range(max(len(p["gen_ids"]) for p in prompts) - 1):
        if step == 3:  # a pass of 3 made-up rows, then a rollback to where it began
            run([[1, 2, 3]] * len(prompts), positions, None)
        outs = run([[t[-1]] for t in got], positions, 1)
        for tokens, out in zip(got, outs, strict=True):
            tokens.append(int(np.argmax(out[-1])))
        positions = [p + 1 for p in positions]
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens[: len(prompt["gen_ids"])] == prompt["gen_ids"], prompt["id"]
