"""Engine fixtures: the real model loaded once per session, tiny random models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from meshnode.engine.backend import cpu_backend
from meshnode.engine.cpu.pool import CoreGauge, KernelPool
from meshnode.engine.loader import LoadedModel, load_model
from tests.conftest import smollm2_gguf_path
from tests.engine.tiny import write_tiny_model


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct on the CPU backend as ``join`` runs it by default (weights in
    their GGUF blocks, ``--dtype native``), loaded once for the whole session."""
    return load_model(str(smollm2_gguf_path()), cpu_backend("native"))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: the tiny model's GGUF for a quant type (its HF twin is ``path.parent/'hf'``)."""
    made: dict[str, Path] = {}

    def make(qtype: str) -> Path:
        if qtype not in made:
            made[qtype] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{qtype}"), qtype)
        return made[qtype]

    return make


@pytest.fixture(scope="module")
def idle_threads(tmp_path_factory: pytest.TempPathFactory) -> KernelPool:
    """Kernel threads as on an idle machine of four cores, whatever this one runs."""
    return KernelPool(CoreGauge(tmp_path_factory.mktemp("idle") / "no-stat", cpus={0, 1, 2, 3}))
