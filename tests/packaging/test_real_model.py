"""The real default model through a package: write, validate, and run split across 3 stages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from meshnode_packaging.manifest import Manifest
from meshnode_packaging.package import open_package
from meshnode_packaging.validate import validate_package
from meshnode_packaging.writer import write_package

from meshnode.engine import ModelConfig, Stage

pytestmark = pytest.mark.real_model

SPLIT = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module")
def real_package(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("real") / "smollm2"
    write_package(smollm2_gguf, out, model_id="smollm2-135m")
    return out


def test_real_package_is_valid_and_no_larger_than_its_source(
    real_package: Path, smollm2_gguf: Path
) -> None:
    assert validate_package(real_package) == []
    m = Manifest.load(real_package)
    total = sum(e["size"] for e in m.files.values())
    manifest_size = (real_package / "model-package.json").stat().st_size
    tokenizer_size = m.files["tokenizer.json"]["size"]
    assert total + manifest_size <= smollm2_gguf.stat().st_size + tokenizer_size + manifest_size
    assert m.num_layers == 30
    assert {m.data["layers"][0]["weight_bytes"]} == set(m.layer_weight_bytes()[:1])


def _greedy(stages: list[tuple[Stage, Any]], prompt: list[int], n: int, eos: int) -> list[int]:
    tokens, out, pos = list(prompt), list[int](), 0
    while len(out) < n:
        x: Any = np.asarray(tokens[pos:], dtype=np.int64)
        for stage, cache in stages:
            x = stage.forward(x, pos, cache, out_rows=1)
        pos = len(tokens)
        nxt = int(np.argmax(np.asarray(x)[-1]))
        out.append(nxt)
        tokens.append(nxt)
        if nxt == eos:
            break
    return out


def test_three_stages_from_the_package_reproduce_golden(
    real_package: Path, golden: dict[str, Any]
) -> None:
    config = ModelConfig.from_hf(open_package(real_package).config)
    stages = []
    for start, end in SPLIT:
        # A fresh source per stage, as separate machines would have: each reads its own files.
        src = open_package(real_package)
        stage = Stage(config, src, start, end, embed=start == 0, head=end == config.num_layers)
        stages.append((stage, stage.new_cache(256)))
    # Two prompts, one raw and one chat: the engine's own tests cover every golden prompt;
    # this one proves that a package split three ways computes the same thing.
    cases = [next(c for c in golden["prompts"] if c["kind"] == k) for k in ("chat", "raw")]
    for case in cases:
        want = case["gen_ids"][:16]  # a greedy prefix is itself a golden reference
        assert _greedy(stages, case["prompt_ids"], len(want), eos=2) == want, case["id"]
