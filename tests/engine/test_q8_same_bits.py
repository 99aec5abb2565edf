"""The fast mode (``--dtype q8``, the CPU's default) keeps the exact mode's parity rule: a
sequence's logits are the same bits on one node, split over two stages, batched with other
sequences, in a verify window and after a rollback, so a mesh answers as one node does.

It holds because a row's q8 product never depends on the rows that share it
(:mod:`meshnode.engine.cpu.q8`: the one-row kernel, the few-row groups and the tiles add
the same integers and fold the same floats in the same order), nor does anything else of
the forward. The tiny model has every matrix in Q4_K (the embedding Q8_0), its K/V in
float16 (``--kv-dtype auto`` with q8); the stages pass float32 hidden states (what
``--wire-dtype f32`` sends). The 66-token prompt takes the tiles (``TILE_MIN_ROWS``) alone
and drags the short prompts' rows into them when batched.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import CpuBackend
from meshnode.engine.model import BatchRow

LONG = [(7 * i + 3) % 250 + 3 for i in range(66)]
PROMPTS = [[1, 60, 61, 62, 259], [70, 19], LONG]
# After each prompt, in turn (start position, tokens): two decode steps, a verify window
# of three, then a window that starts two positions back (a rejected draft's rollback).
STEPS = [(0, [5]), (1, [9]), (2, [7, 8, 11]), (3, [12, 13])]
CONTEXT = 80

Logits = list[np.ndarray]  # one sequence's logits of every step: [rows, V] each


def _steps(prompt: list[int]) -> list[tuple[int, list[int]]]:
    """(start position, tokens) of each forward of a sequence: its prompt, then STEPS."""
    n = len(prompt)
    return [(0, prompt), *((n + at, ids) for at, ids in STEPS)]


@pytest.fixture(scope="module")
def stages(tiny_gguf: Callable[[str], Path]) -> tuple[Stage, Stage, Stage]:
    """The whole model, its first layer and the rest, in q8 with the default KV dtype."""
    source = open_source(tiny_gguf("Q4_K"))
    config = ModelConfig.from_hf(source.config)
    n, backend = config.num_layers, CpuBackend(weights_dtype="q8")
    whole = Stage(config, source, 0, n, embed=True, head=True, backend=backend)
    first = Stage(config, source, 0, 1, embed=True, head=False, backend=backend)
    rest = Stage(config, source, 1, n, embed=False, head=True, backend=backend)
    assert whole.kv_dtype == first.kv_dtype == rest.kv_dtype == "f16"
    return whole, first, rest


def _alone(stages: list[Stage], prompt: list[int]) -> Logits:
    """One sequence through ``stages`` in turn, one forward per step."""
    caches = [s.new_cache(CONTEXT) for s in stages]
    got = []
    for pos, ids in _steps(prompt):
        x = np.array(ids)
        for s, c in zip(stages, caches, strict=True):
            x = s.forward(x, pos, c, out_rows=len(ids) if s.head else None)
        got.append(x)
    return got


def _batched(stages: list[Stage], prompts: list[list[int]]) -> list[Logits]:
    """Every sequence in one batched forward per step, through ``stages`` in turn."""
    caches = [[s.new_cache(CONTEXT) for s in stages] for _ in prompts]
    got: list[Logits] = [[] for _ in prompts]
    plans = [_steps(p) for p in prompts]
    for step in range(len(plans[0])):
        xs = [np.array(plan[step][1]) for plan in plans]
        for i, s in enumerate(stages):
            rows = [
                BatchRow(x, plan[step][0], c[i], len(plan[step][1]) if s.head else None)
                for x, plan, c in zip(xs, plans, caches, strict=True)
            ]
            xs = s.forward_batch(rows)
        for g, x in zip(got, xs, strict=True):
            g.append(x)
    return got


def test_q8_logits_are_the_same_bits_split_batched_and_verified(
    stages: tuple[Stage, Stage, Stage],
) -> None:
    whole, first, rest = stages
    want = [_alone([whole], p) for p in PROMPTS]
    exact = Stage(
        whole.config, whole.weights, 0, whole.end, embed=True, head=True,
        backend=CpuBackend(weights_dtype="native"), kv_dtype="f16",
    )  # fmt: skip
    assert not np.array_equal(_alone([exact], PROMPTS[0])[0], want[0][0])  # q8 ran
    runs = {
        "split over two stages": [_alone([first, rest], p) for p in PROMPTS],
        "batched on one node": _batched([whole], PROMPTS),
        "batched over two stages": _batched([first, rest], PROMPTS),
    }
    for name, got in runs.items():
        for p, (w_seq, g_seq) in enumerate(zip(want, got, strict=True)):
            for step, (w, g) in enumerate(zip(w_seq, g_seq, strict=True)):
                assert w.shape == g.shape, (name, p, step)
                differ = int(np.count_nonzero(w != g))
                assert differ == 0, f"{name}: prompt {p}, step {step}: {differ} logits differ"
