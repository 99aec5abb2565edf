"""Qwen 3 and Gemma 3 blocks: GGUF and checkpoint agree, sliding windows, the Qwen 3 reference.

The tiny models (``tiny.py``) hold the same weights as a GGUF and as a Hugging Face
folder, so equal logits prove the GGUF side's name table, norm shift and config mapping.
``tests/golden/tiny/qwen3-tiny`` is an independent reference (transformers, float32).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from meshnode_packaging.refs import open_ref
from meshnode_packaging.writer import write_package

from meshnode.cli.generate import GenerateConfig, complete
from meshnode.engine import ModelConfig, Stage, ops
from meshnode.engine.backend import cpu_backend
from meshnode.engine.generate import prefill
from meshnode.engine.loader import load_model
from meshnode.engine.sampling import SamplingParams
from tests.conftest import GOLDEN_DIR
from tests.engine.tiny import GEMMA3_WINDOW, write_tiny_model

QWEN3_TINY = GOLDEN_DIR / "tiny" / "qwen3-tiny"
IDS = [1, 60, 61, 62, 259, 70, 19, 20, 223, 89, 90, 91, 92, 260, 7, 8, 9]


@pytest.fixture(scope="module")
def tiny_arch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: the tiny model's GGUF of a GGUF architecture (its HF twin: ``parent/'hf'``)."""
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_model(tmp_path_factory.mktemp(arch), "Q8_0", arch=arch)
        return made[arch]

    return make


def _stage(path: Path) -> Stage:
    source = open_ref(str(path))
    config = ModelConfig.from_hf(source.config)
    return Stage(config, source, 0, config.num_layers, embed=True, head=True)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_gguf_and_checkpoint_give_the_same_logits(
    tiny_arch: Callable[[str], Path], arch: str
) -> None:
    gguf_path = tiny_arch(arch)
    from_gguf, from_hf = _stage(gguf_path), _stage(gguf_path.parent / "hf")
    # GGUF stores the epsilon as float32
    assert replace(from_gguf.config, rms_norm_eps=1e-5) == from_hf.config
    a = from_gguf.forward(np.array(IDS), 0, from_gguf.new_cache(32))
    b = from_hf.forward(np.array(IDS), 0, from_hf.new_cache(32))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_gemma3_layer_package_gives_the_gguf_logits(
    tiny_arch: Callable[[str], Path], tmp_path: Path
) -> None:
    """``meshnode package write`` keeps the norms in the checkpoint's convention."""
    gguf_path = tiny_arch("gemma3")
    write_package(gguf_path, tmp_path / "pkg")
    packaged, direct = _stage(tmp_path / "pkg"), _stage(gguf_path)
    a = packaged.forward(np.array(IDS), 0, packaged.new_cache(32))
    b = direct.forward(np.array(IDS), 0, direct.new_cache(32))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_gemma3_config_from_gguf(tiny_arch: Callable[[str], Path]) -> None:
    config = _stage(tiny_arch("gemma3")).config
    assert [config.window(i) for i in range(3)] == [GEMMA3_WINDOW, None, GEMMA3_WINDOW]
    local, full = config.rope_inv_freq(0), config.rope_inv_freq(1)
    assert local[1] == pytest.approx(1e4 ** (-2 / 64))
    assert full[1] == pytest.approx(1e6 ** (-2 / 64))
    assert config.arch.norm_offset == 1.0
    assert config.tie_word_embeddings


def test_sliding_window_changes_the_answer(tiny_arch: Callable[[str], Path]) -> None:
    """The window is in force: the same weights with every layer global differ."""
    stage = _stage(tiny_arch("gemma3"))
    wide = Stage(
        ModelConfig.from_hf({**_hf_config(tiny_arch("gemma3")), "sliding_window": 64}),
        stage.weights,
        0,
        3,
        embed=True,
        head=True,
    )
    short = np.array(IDS[:GEMMA3_WINDOW])  # within the window both agree
    np.testing.assert_allclose(
        stage.forward(short, 0, stage.new_cache(32)), wide.forward(short, 0, wide.new_cache(32))
    )
    a = stage.forward(np.array(IDS), 0, stage.new_cache(32))
    b = wide.forward(np.array(IDS), 0, wide.new_cache(32))
    assert np.abs(a[-1] - b[-1]).max() > 1e-3


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_window_verify_and_chunked_prefill_equal_steps(
    tiny_arch: Callable[[str], Path], k: int
) -> None:
    """Prefill in chunks, then a k-row verify pass past the window, equal one token at a time."""
    stage = _stage(tiny_arch("gemma3"))
    prefix, window = IDS[:9], IDS[9 : 9 + k]  # the cache already holds more than the window
    cache = stage.new_cache(32)
    prefill(stage, cache, prefix, chunk=3)
    batched = stage.forward(np.array(window), len(prefix), cache)
    steps_cache = stage.new_cache(32)
    steps = [stage.forward(np.array([t]), i, steps_cache)[0] for i, t in enumerate(prefix + window)]
    np.testing.assert_allclose(batched, np.stack(steps[len(prefix) :]), rtol=1e-4, atol=1e-4)
    cache.truncate(len(prefix) + 1)  # rollback, then redo: the same rows again
    again = stage.forward(np.array(window[1:]), len(prefix) + 1, cache)
    np.testing.assert_allclose(again, batched[1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("rows", "window"), [(1, 3), (4, 3), (5, 1), (6, 16), (3, None)])
def test_windowed_attention_matches_a_loop(rows: int, window: int | None) -> None:
    rng = np.random.default_rng(0)
    t, heads, kv_heads, dim = 9, 4, 2, 8
    q = rng.standard_normal((heads, rows, dim)).astype(np.float32)
    keys = rng.standard_normal((kv_heads, t, dim)).astype(np.float32)
    values = rng.standard_normal((kv_heads, t, dim)).astype(np.float32)
    got = ops.attention(np, q, keys, values, 0.3, window)
    for h in range(heads):
        for r in range(rows):
            pos = t - rows + r
            lo = 0 if window is None else max(0, pos - window + 1)
            k, v = keys[h // 2, lo : pos + 1], values[h // 2, lo : pos + 1]
            w = np.exp((k @ q[h, r]) * 0.3 - ((k @ q[h, r]) * 0.3).max())
            np.testing.assert_allclose(got[h, r], (w / w.sum()) @ v, rtol=1e-5, atol=1e-6)


def _hf_config(gguf_path: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((gguf_path.parent / "hf" / "config.json").read_text())
    return config


# -- Qwen 3: the independent reference ------------------------------------------------------


def test_qwen3_tiny_greedy_parity_on_token_ids() -> None:
    golden = json.loads((QWEN3_TINY / "golden.json").read_text())
    model = load_model(str(QWEN3_TINY), cpu_backend())
    assert not model.tokenizer.has_text
    for prompt in golden["prompts"]:
        config = GenerateConfig(
            prompt_ids=tuple(prompt["prompt_ids"]),
            max_tokens=len(prompt["gen_ids"]),
            sampling=SamplingParams(temperature=0.0),
        )
        result = complete(model, config, None)
        assert result.token_ids == prompt["gen_ids"], prompt["id"]
        ids = prompt["prompt_ids"]
        logits = prefill(model.stage, model.stage.new_cache(len(ids) + 1), ids)
        top_ids, top_logits = prompt["last_prompt_logits_top5"]
        assert [int(i) for i in np.argsort(-logits)[:5]] == top_ids, prompt["id"]
        np.testing.assert_allclose(logits[top_ids], top_logits, atol=1e-4)
