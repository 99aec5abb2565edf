"""Speculation fixtures: tiny random targets and drafts, and the real model once per session."""

from __future__ import annotations

import pytest

from meshnode.engine.backend import cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.loader import LoadedModel, load_model
from meshnode.engine.model import Stage
from tests.conftest import smollm2_gguf_path
from tests.speculative.tinymodel import TinySource, tiny_config

VOCAB = 48
TARGET_LAYERS = 4


def tiny_stage(source: TinySource, end: int | None = None, head: bool = True) -> Stage:
    config = ModelConfig.from_hf(source.config)
    stop = config.num_layers if end is None else end
    return Stage(config, source, 0, stop, embed=True, head=head)


@pytest.fixture(scope="session")
def target_source() -> TinySource:
    """A 4-layer target whose greedy output mixes repeats and fresh tokens."""
    return TinySource(tiny_config(VOCAB, TARGET_LAYERS), seed=0, logit_scale=8.0)


@pytest.fixture(scope="session")
def target(target_source: TinySource) -> Stage:
    return tiny_stage(target_source)


@pytest.fixture(scope="session")
def draft() -> Stage:
    """An independent 2-layer model over the same vocabulary."""
    return tiny_stage(TinySource(tiny_config(VOCAB, 2), seed=5, logit_scale=8.0))


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct on the CPU backend, loaded once."""
    return load_model(str(smollm2_gguf_path()), cpu_backend())
