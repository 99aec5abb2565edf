"""Where the upstream cuts fall changes a stage's K/V only when the wire dtype rounds.

A stage's prefix seed (:func:`meshnode.node.prefix_keep.stage_seeds`) leaves the cuts
between upstream stages of one device out when the wire is float32 (``LOSSLESS_WIRE``),
so that after a re-plan that moved a cut upstream a stage keeps its cached blocks. That
holds only if the hidden state entering the stage is the same bits wherever the layers
before it were cut: the engine's activations are float32, so a float32 wire hands a
stage exactly what the unsplit model's next layer reads. f16 (the default wire) rounds
them at each cut, and the stage after computes other K/V. Here a tiny model's last layer,
behind layers 0-1 as one stage and as two, in both arithmetic modes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.activations import from_wire, to_wire
from meshnode.engine.backend import CpuBackend
from tests.speculative.tinymodel import TinySource, tiny_config

PROMPT = np.array([(7 * i + 3) % 45 + 3 for i in range(40)])  # within either vocabulary
CONTEXT = 48


def _last_stage(stages: list[Stage], wire: str) -> tuple[Any, Any, Any]:
    """The last of ``stages`` after ``PROMPT`` went through them all, the hidden state
    crossing each cut in the ``wire`` dtype: its logits and its K and V."""
    x: Any = PROMPT
    cache = None
    for stage in stages:
        if not stage.embed:
            x = from_wire(to_wire(x, wire).tobytes(), wire, x.shape)
        cache = stage.new_cache(CONTEXT)
        x = stage.forward(x, 0, cache, out_rows=1 if stage.head else None)
    assert cache is not None
    n = len(PROMPT)
    return x, np.asarray(cache.k)[:, :, :n], np.asarray(cache.v)[:, :, :n]


def _cuts(source: Any, backend: CpuBackend | None = None) -> tuple[list[Stage], list[Stage]]:
    """The model's 3 layers as 2 stages (cut at 2) and as 3 (cut at 1 and 2)."""
    config = ModelConfig.from_hf(source.config)
    assert config.num_layers == 3

    def stage(start: int, end: int) -> Stage:
        first, last = start == 0, end == 3
        return Stage(config, source, start, end, embed=first, head=last, backend=backend)

    return [stage(0, 2), stage(2, 3)], [stage(0, 1), stage(1, 2), stage(2, 3)]


@pytest.mark.parametrize("mode", ["q8", "native"])
def test_a_cut_upstream_changes_nothing_in_float32(
    tiny_gguf: Callable[[str], Path], mode: Literal["q8", "native"]
) -> None:
    one_cut, two_cuts = _cuts(open_source(tiny_gguf("Q4_K")), CpuBackend(weights_dtype=mode))
    for a, b in zip(_last_stage(one_cut, "f32"), _last_stage(two_cuts, "f32"), strict=True):
        assert a.tobytes() == b.tobytes()  # the same bits: the cut at 1 changed nothing


def test_a_cut_upstream_counts_in_float16() -> None:
    """Rounded at every cut, the hidden state entering the last stage differs with the cut
    at 1, and so do its K/V. (The float32 random Llama: the GGUF one's activations pass
    float16's range.)"""
    one_cut, two_cuts = _cuts(TinySource(tiny_config(48, 3), seed=3))
    for a, b in zip(_last_stage(one_cut, "f32"), _last_stage(two_cuts, "f32"), strict=True):
        assert a.tobytes() == b.tobytes()
    _, k1, v1 = _last_stage(one_cut, "f16")
    _, k2, v2 = _last_stage(two_cuts, "f16")
    assert not (np.array_equal(k1, k2) and np.array_equal(v1, v2))
