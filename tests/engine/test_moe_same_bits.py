"""Mixture-of-experts models: a row's logits are the same bits alone, in a batch of eight,
in a verify window and on 1, 2 or 3 threads (issue 35's rule, for every MoE family).

A row's expert products used to take their path from the number of rows of the whole
batch that chose the same expert (more than :data:`MAX_KERNEL_ROWS`: BLAS, whose sums
round otherwise), and the router's from the batch's row count: a decode row's logits then
changed with what the other sequences were doing. Now each product takes the path of
the row's own segment (:func:`meshnode.engine.moe.moe_mlp`'s ``sizes``).

The prompts are the references' four (5, 17, 40 and 300 tokens) and four cut from the
longest (3, 16, 24, 90): segments on both sides of the row limit, so that in a batch
every expert gets rows of long and short segments, and more than the limit of short
ones in the batch of verify windows (8 x 4 rows). Each family in the layout that takes
its own path: Qwen3-MoE as its GGUF twin (3-D stacks: the compiled experts), Mixtral and
gpt-oss as checkpoints (an expert at a time; gpt-oss's clamped, biased experts),
Qwen3.5-MoE's hybrid stage with its shared expert.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.refs import open_ref

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import CpuBackend
from meshnode.engine.cpu import MAX_KERNEL_ROWS, matrix
from meshnode.engine.cpu.pool import KernelPool
from meshnode.engine.model import BatchRow
from tests.engine.moe_models import MOE_DIR, golden, write_gguf_twin
from tests.engine.test_kernel_pool import idle_gauge
from tests.engine.test_same_bits import DECODE_STEPS, solo

STEPS = DECODE_STEPS  # decode steps after the prompt; the verify window is their tokens
Logits = list[np.ndarray]  # per prompt: [1 + STEPS, V]


def _prompts(model: str) -> list[list[int]]:
    given = [p["prompt_ids"] for p in golden(model)["prompts"]]
    longest = max(given, key=len)
    return [*given, longest[:3], longest[:MAX_KERNEL_ROWS], longest[:24], longest[:90]]


@pytest.fixture(scope="module", params=["qwen3-moe-gguf", "mixtral-tiny", "gpt-oss-tiny",
                                        "qwen35-moe-tiny"])  # fmt: skip
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Stage, list[list[int]]]:
    """A whole stage of the model in its exact mode (``native``) and its prompts."""
    name: str = request.param
    path: Path = MOE_DIR / name
    if name == "qwen3-moe-gguf":
        name = "qwen3-moe-tiny"
        path = write_gguf_twin(name, tmp_path_factory.mktemp("twin") / "qwen3-moe.gguf")
    source = open_ref(str(path))
    config = ModelConfig.from_hf(source.config)
    n = config.num_layers
    stage = Stage(config, source, 0, n, embed=True, head=True, backend=CpuBackend("native"))
    return stage, _prompts(name)


def _batched(stage: Stage, prompts: list[list[int]], tokens: list[list[int]]) -> list[Logits]:
    """Every prompt in one batch, then ``tokens`` (each prompt's greedy continuation, from
    the runs alone) two ways: a decode row per sequence per step, and one verify window
    of all of them per sequence (its rows' logits the steps'). Returns both runs."""
    runs: list[Logits] = []
    for window in (False, True):
        caches = [stage.new_cache(len(p) + STEPS + 1) for p in prompts]
        items = [BatchRow(np.asarray(p), 0, c, 1) for p, c in zip(prompts, caches, strict=True)]
        rows = [[out[-1]] for out in stage.forward_batch(items)]
        steps = [tokens] if window else [[t[i : i + 1] for t in tokens] for i in range(STEPS)]
        for step in steps:
            items = [
                BatchRow(np.asarray(t), c.length, c, len(t))
                for t, c in zip(step, caches, strict=True)
            ]
            for r, out in zip(rows, stage.forward_batch(items), strict=True):
                r.extend(out)
        runs.append([np.stack(r) for r in rows])
    return runs


@pytest.fixture(scope="module")
def runs(case: tuple[Stage, list[list[int]]]) -> dict[str, Logits]:
    """Each prompt's logits alone, in a batch of 8 and in a batch of 8 verify windows, on
    1, 2 and 3 threads (the pool sure of four free cores: the threads take chunks and
    tiles whatever the load)."""
    stage, prompts = case
    got: dict[str, Logits] = {}
    tokens: list[list[int]] = []
    for threads in (1, 2, 3):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(matrix, "_threads", threads)
            pool = KernelPool(idle_gauge(4))
            mp.setattr(matrix, "_pool", lambda pool=pool: pool)
            got[f"alone, {threads} thread(s)"] = alone = [solo(stage, p) for p in prompts]
            tokens = tokens or [[int(np.argmax(r)) for r in a[:STEPS]] for a in alone]
            decode, window = _batched(stage, prompts, tokens)
            got[f"batch of 8, {threads} thread(s)"] = decode
            got[f"verify windows, {threads} thread(s)"] = window
    return got


def _assert_same(case: tuple[Stage, list[list[int]]], runs: dict[str, Logits], kind: str) -> None:
    stage, prompts = case
    want = runs["alone, 1 thread(s)"]
    names = [n for n in runs if n.startswith(kind)]
    assert len(names) == 3
    for name in names:
        for i, (a, b) in enumerate(zip(want, runs[name], strict=True)):
            assert a.shape == b.shape == (1 + STEPS, stage.config.vocab_size)
            differ = int(np.count_nonzero(a != b))
            assert differ == 0, f"prompt {i} ({len(prompts[i])} tokens): {name}: {differ} differ"


@pytest.mark.parametrize("kind", ["alone", "batch of 8"])
def test_a_rows_logits_are_the_same_bits_alone_and_batched_on_any_threads(
    case: tuple[Stage, list[list[int]]], runs: dict[str, Logits], kind: str
) -> None:
    _assert_same(case, runs, kind)


def test_a_verify_windows_logits_are_the_decode_steps_bits(
    case: tuple[Stage, list[list[int]]], runs: dict[str, Logits]
) -> None:
    """gpt-oss's attention with sinks and Qwen3.5's gated attention run a window's rows
    in the compiled kernel (issue 31; before, NumPy a row at a time), each row summed in
    its decode step's order (NumPy's batched products had summed otherwise for another
    row count: strict xfails until a row at a time)."""
    _assert_same(case, runs, "verify windows")
