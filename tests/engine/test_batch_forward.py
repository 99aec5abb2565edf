"""Batched forward: several sequences in one pass give each sequence its solo output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import CpuBackend
from meshnode.engine.model import BatchRow

PROMPTS = [[1, 60, 61, 62, 259], [70, 19], [20, 223, 89, 90, 91, 92, 260, 5, 6], [33]]
CONTEXT = 32


@pytest.fixture(scope="module", params=["float32", "native"])
def stage(request: pytest.FixtureRequest, tiny_gguf: Callable[[str], Path]) -> Stage:
    source = open_source(tiny_gguf("Q8_0"))
    config = ModelConfig.from_hf(source.config)
    backend = CpuBackend(weights_dtype=request.param)
    return Stage(config, source, 0, config.num_layers, embed=True, head=True, backend=backend)


def _solo(stage: Stage, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and last-row logits of one sequence run alone."""
    cache = stage.new_cache(CONTEXT)
    logits = [stage.forward(np.array(prompt), 0, cache, out_rows=1)[-1]]
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(steps - 1):
        logits.append(stage.forward(np.array(tokens[-1:]), cache.length, cache, out_rows=1)[-1])
        tokens.append(int(np.argmax(logits[-1])))
    return tokens, logits


def test_batch_matches_solo(stage: Stage) -> None:
    """Prefills of different lengths, then decodes, all batched: each sequence's greedy
    tokens are its solo tokens and its logits agree within float32 rounding."""
    steps = 5
    solo = [_solo(stage, p, steps) for p in PROMPTS]
    caches = [stage.new_cache(CONTEXT) for _ in PROMPTS]
    rows = [BatchRow(np.array(p), 0, c, 1) for p, c in zip(PROMPTS, caches, strict=True)]
    outs = stage.forward_batch(rows)
    tokens = [[int(np.argmax(o[-1]))] for o in outs]
    logits = [[o[-1]] for o in outs]
    for _ in range(steps - 1):
        rows = [
            BatchRow(np.array(t[-1:]), c.length, c, 1) for t, c in zip(tokens, caches, strict=True)
        ]
        for t, lg, o in zip(tokens, logits, stage.forward_batch(rows), strict=True):
            t.append(int(np.argmax(o[-1])))
            lg.append(o[-1])
    for (want, want_logits), got, got_logits in zip(solo, tokens, logits, strict=True):
        assert got == want
        np.testing.assert_allclose(
            np.array(got_logits), np.array(want_logits), atol=1e-4, rtol=1e-4
        )


def test_batch_mixes_prefill_decode_and_verify_rows(stage: Stage) -> None:
    """A verify window (k + 1 rows out), a decode row and a prefill chunk in one batch,
    with a rollback: each output has its own row count and matches the solo forward."""
    a, b, c = (stage.new_cache(CONTEXT) for _ in range(3))
    stage.forward(np.array(PROMPTS[0]), 0, a)
    stage.forward(np.array(PROMPTS[1]), 0, b)
    items = [
        BatchRow(np.array([5, 6, 7]), 3, a, 3),  # verify from position 3: rolls back 2
        BatchRow(np.array([9]), 2, b, 1),
        BatchRow(np.array(PROMPTS[2]), 0, c, 1),
    ]
    outs = stage.forward_batch(items)
    assert [o.shape[0] for o in outs] == [3, 1, 1]
    assert (a.length, b.length, c.length) == (6, 3, len(PROMPTS[2]))
    for item, out in zip(items, outs, strict=True):
        cache = stage.new_cache(CONTEXT)
        prefix = {id(a): PROMPTS[0][:3], id(b): PROMPTS[1]}.get(id(item.cache), [])
        if prefix:
            stage.forward(np.array(prefix), 0, cache)
        want = stage.forward(item.inputs, item.start_pos, cache, out_rows=item.out_rows)
        np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)


def test_split_stage_batches_hidden_rows(tiny_gguf: Callable[[str], Path]) -> None:
    """A stage that is neither first nor last batches hidden states ``[S, E]`` per item."""
    source = open_source(tiny_gguf("Q8_0"))
    config = ModelConfig.from_hf(source.config)
    first = Stage(config, source, 0, 1, embed=True, head=False)
    middle = Stage(config, source, 1, 2, embed=False, head=False)
    hidden = [first.forward(np.array(p), 0, first.new_cache(CONTEXT)) for p in PROMPTS]
    caches = [middle.new_cache(CONTEXT) for _ in PROMPTS]
    outs = middle.forward_batch([BatchRow(h, 0, c) for h, c in zip(hidden, caches, strict=True)])
    for h, out in zip(hidden, outs, strict=True):
        want = middle.forward(h, 0, middle.new_cache(CONTEXT))
        assert out.shape == want.shape
        np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)
