"""A row's logits do not depend on how its prompt was cut into pieces (issue 30): SmolLM2
over its GGUF blocks, a prompt prefilled in 128-token pieces (the last 144) against the same prompt
resumed at a block boundary (as the prefix cache resumes it), cut elsewhere, finished by a
short piece, or finished a token at a time. In the 8-bit mode (the default) every product
is the same bits for a row whatever rows share it, and the attention kernel takes every
piece, so all of these are the same bits. In the exact mode a product of at most 16 rows
takes the compiled kernel and a longer one BLAS (their sums round differently), so the
bits agree where every piece has more rows than that."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import CpuBackend
from tests.conftest import smollm2_gguf_path

PROMPT = np.random.default_rng(0).integers(100, 40000, 400)
CONTEXT = 512


@pytest.fixture(scope="module", params=["q8", "native"])
def stage(request: pytest.FixtureRequest) -> Stage:
    source = open_source(smollm2_gguf_path())
    config = ModelConfig.from_hf(source.config)
    backend = CpuBackend(weights_dtype=request.param)
    return Stage(config, source, 0, config.num_layers, embed=True, head=True, backend=backend)


def _logits(stage: Stage, cuts: list[int], steps: int = 0) -> np.ndarray:
    """The last row's logits of ``PROMPT`` prefilled in pieces ending at ``cuts``, its
    last ``steps`` tokens then one at a time."""
    cache = stage.new_cache(CONTEXT)
    end = len(PROMPT) - steps
    bounds = [0, *cuts, end]
    out = None
    for a, b in itertools.pairwise(bounds):
        out = stage.forward(PROMPT[a:b], a, cache, out_rows=1)
    for p in range(end, len(PROMPT)):
        out = stage.forward(PROMPT[p : p + 1], p, cache, out_rows=1)
    return np.asarray(out)


def test_a_prompt_is_the_same_bits_however_it_is_cut(stage: Stage) -> None:
    want = _logits(stage, [128, 256])
    long_pieces = {"resumed at 288": [288], "cut at 96 and 288": [96, 288]}
    for name, cuts in long_pieces.items():
        np.testing.assert_array_equal(_logits(stage, cuts), want, err_msg=name)
    if stage.backend.weights_dtype == "q8":
        short = {"a last piece of 10 rows": ([256, 390], 0), "8 decode steps": ([256], 8)}
        for name, (cuts, steps) in short.items():
            np.testing.assert_array_equal(_logits(stage, cuts, steps), want, err_msg=name)
