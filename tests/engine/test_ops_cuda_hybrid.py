"""The hybrid model (Gated DeltaNet + gated attention) on the CUDA backend, run without a
GPU as ``test_ops_cuda_stage.py`` runs the others: the same block as on the CPU, its
norms and products through the device's operations (kernels replaced by their NumPy
references), its recurrence through the array module's own operators. Greedy
continuations equal the reference's (transformers, float32), in one stage and split."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from meshnode.engine.backend import CudaBackend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from tests.engine.hybrid_model import HybridFolder, hybrid_golden
from tests.engine.test_ops_cuda_stage import (
    FAKE_CP,
    _reference_kernels,  # noqa: F401 (the autouse fixture: kernels replaced by references)
)


class FakeCupy:
    """``FAKE_CP``, with NumPy's functions for everything else (the recurrence's ``exp``,
    ``einsum``, ...): NumPy keeps the host array type through them."""

    def __getattr__(self, name: str) -> Any:
        return getattr(FAKE_CP, name) if hasattr(FAKE_CP, name) else getattr(np, name)


def _stages(split: int | None) -> list[Stage]:
    folder = HybridFolder()
    config = ModelConfig.from_hf(folder.config)
    backend = CudaBackend(FakeCupy(), "float32")  # type: ignore[arg-type]
    bounds = [0, config.num_layers] if split is None else [0, split, config.num_layers]
    return [
        Stage(config, folder, a, b, embed=a == 0, head=b == config.num_layers, backend=backend)
        for a, b in itertools.pairwise(bounds)
    ]


@pytest.mark.parametrize("split", [None, 5])
def test_hybrid_greedy_continuations_on_the_cuda_backend(split: int | None) -> None:
    stages = _stages(split)
    golden = hybrid_golden()
    prompt = golden["prompts"][0]
    ids, want = prompt["prompt_ids"], prompt["gen_ids"]
    caches = [s.new_cache(len(ids) + len(want) + 1) for s in stages]

    def forward(tokens: list[int], start: int) -> np.ndarray:
        x: Any = np.asarray(tokens)
        for stage, cache in zip(stages, caches, strict=True):
            x = stage.forward(x, start, cache, out_rows=1)
        return np.asarray(x)

    logits, got = forward(ids, 0), []
    for _ in range(len(want)):
        got.append(int(logits[-1].argmax()))
        logits = forward(got[-1:], len(ids) + len(got) - 1)
    assert got == want
