"""Stage forward: split parity, verify parity, out_rows, truncate-then-redo, cache limits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import cpu_backend
from meshnode.engine.cpu import BlockMatrix
from meshnode.engine.generate import prefill
from meshnode.engine.loader import LoadedModel
from meshnode.node.footprint import model_footprint

IDS = [1, 60, 61, 62, 259, 70, 19, 20, 223, 89, 90, 91, 92, 260]


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Callable[[str], Path]) -> tuple[ModelConfig, Stage]:
    source = open_source(tiny_gguf("Q8_0"))
    config = ModelConfig.from_hf(source.config)
    return config, Stage(config, source, 0, config.num_layers, embed=True, head=True)


def test_split_parity(tiny_gguf: Callable[[str], Path], tiny: tuple[ModelConfig, Stage]) -> None:
    config, whole = tiny
    source = open_source(tiny_gguf("Q8_0"))
    full = whole.forward(np.array(IDS), 0, whole.new_cache(32))
    for k in range(config.num_layers + 1):
        first = Stage(config, source, 0, k, embed=True, head=False)
        second = Stage(config, source, k, config.num_layers, embed=False, head=True)
        hidden = first.forward(np.array(IDS), 0, first.new_cache(32))
        assert hidden.shape == (len(IDS), config.hidden_size)
        logits = second.forward(hidden, 0, second.new_cache(32))
        np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [2, 3, 4, 8])  # row-by-row sgemv up to 3 rows, sgemm above
def test_verify_parity_k_tokens_equal_k_steps(tiny: tuple[ModelConfig, Stage], k: int) -> None:
    _, stage = tiny
    prefix, window = IDS[:6], IDS[6 : 6 + k]
    batched_cache = stage.new_cache(32)
    stage.forward(np.array(prefix), 0, batched_cache)
    batched = stage.forward(np.array(window), len(prefix), batched_cache)
    step_cache = stage.new_cache(32)
    stage.forward(np.array(prefix), 0, step_cache)
    steps = [
        stage.forward(np.array([t]), len(prefix) + i, step_cache)[0] for i, t in enumerate(window)
    ]
    np.testing.assert_allclose(batched, np.stack(steps), rtol=1e-4, atol=1e-4)
    assert list(batched.argmax(-1)) == [int(s.argmax()) for s in steps]


def test_out_rows_returns_the_last_rows_unchanged(tiny: tuple[ModelConfig, Stage]) -> None:
    _, stage = tiny
    full = stage.forward(np.array(IDS), 0, stage.new_cache(32))
    cache = stage.new_cache(32)
    last3 = stage.forward(np.array(IDS), 0, cache, out_rows=3)
    assert last3.shape == (3, full.shape[1])
    np.testing.assert_allclose(last3, full[-3:], rtol=1e-5, atol=1e-5)
    # The skipped rows still wrote their K/V: continuing from the cache matches.
    assert cache.length == len(IDS)
    cont = stage.forward(np.array([77]), len(IDS), cache)
    ref = stage.forward(np.array([*IDS, 77]), 0, stage.new_cache(32))[-1]
    np.testing.assert_allclose(cont[0], ref, rtol=1e-4, atol=1e-4)


def test_truncate_then_redo_reproduces(tiny: tuple[ModelConfig, Stage]) -> None:
    _, stage = tiny
    cache = stage.new_cache(32)
    first = stage.forward(np.array(IDS), 0, cache)
    stage.forward(np.array([5, 6, 7]), len(IDS), cache)  # a draft that gets rejected
    assert cache.length == len(IDS) + 3
    redo = stage.forward(np.array(IDS[8:]), 8, cache)  # forward truncates to start_pos
    np.testing.assert_allclose(redo, first[8:], rtol=1e-5, atol=1e-5)
    assert cache.length == len(IDS)


def test_chunked_prefill_matches_one_forward(tiny: tuple[ModelConfig, Stage]) -> None:
    _, stage = tiny
    whole = prefill(stage, stage.new_cache(32), IDS)
    cache = stage.new_cache(32)
    chunked = prefill(stage, cache, IDS, chunk=5)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
    assert cache.length == len(IDS)


def test_cache_limits(tiny: tuple[ModelConfig, Stage]) -> None:
    _, stage = tiny
    cache = stage.new_cache(4)
    with pytest.raises(ValueError, match="KV cache full"):
        stage.forward(np.array(IDS[:5]), 0, cache)
    with pytest.raises(ValueError, match="cannot truncate"):
        stage.forward(np.array(IDS[:1]), 3, stage.new_cache(8))


@pytest.mark.real_model
def test_real_model_verify_parity_and_split(smollm2: LoadedModel) -> None:
    stage = smollm2.stage
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. It")
    cache = stage.new_cache(64)
    stage.forward(np.array(ids[:-8]), 0, cache, out_rows=1)
    window = stage.forward(np.array(ids[-8:]), len(ids) - 8, cache)
    steps = []
    for i, t in enumerate(ids[-8:]):
        steps.append(stage.forward(np.array([t]), len(ids) - 8 + i, cache)[0])
    np.testing.assert_allclose(window, np.stack(steps), rtol=1e-4, atol=2e-4)
    assert list(window.argmax(-1)) == [int(s.argmax()) for s in steps]


def test_stages_load_from_a_layer_package(
    tiny_gguf: Callable[[str], Path], tiny: tuple[ModelConfig, Stage], tmp_path: Path
) -> None:
    from meshnode_packaging.package import open_package
    from meshnode_packaging.writer import write_package

    config, whole = tiny
    write_package(tiny_gguf("Q8_0"), tmp_path / "pkg")
    package = open_package(tmp_path / "pkg")
    k = config.num_layers // 2
    first = Stage(config, package, 0, k, embed=True, head=False)
    second = Stage(config, package, k, config.num_layers, embed=False, head=True)
    hidden = first.forward(np.array(IDS), 0, first.new_cache(32))
    logits = second.forward(hidden, 0, second.new_cache(32))
    full = whole.forward(np.array(IDS), 0, whole.new_cache(32))
    np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q4_1", "F16"])
def test_block_weights_compute_what_float32_weights_do(
    tiny_gguf: Callable[[str], Path], qtype: str
) -> None:
    """A stage holding GGUF blocks (``--dtype native``) against the same stage with the
    weights dequantized to float32: same logits up to summation order, for prefill (the
    decode-then-BLAS path), decode and verify rows (the kernels), and far fewer bytes."""
    source = open_source(tiny_gguf(qtype))
    c = ModelConfig.from_hf(source.config)
    stages = [
        Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=cpu_backend(dtype))
        for dtype in ("native", "float32")
    ]
    blocks, dense = stages
    assert isinstance(blocks.weights.layers[0].wqkv, BlockMatrix)
    assert blocks.weights.nbytes() < dense.weights.nbytes() / 2
    ids = np.array([1, 60, 61, 62, 259, *range(70, 89)])  # 24 tokens
    caches = [s.new_cache(64) for s in stages]
    for start, stop in ((0, 19), (19, 20), (20, 24)):  # prefill 19 rows, decode, verify 4
        got = blocks.forward(ids[start:stop], start, caches[0])
        want = dense.forward(ids[start:stop], start, caches[1])
        assert got.shape == (stop - start, c.vocab_size)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("dtype", ["native", "float32"])
def test_held_bytes_are_what_a_stage_holds(tiny_gguf: Callable[[str], Path], dtype: str) -> None:
    """The planner's per-layer bytes (``held_bytes``) against the loaded stage's arrays."""
    source = open_source(tiny_gguf("Q4_K"))
    c = ModelConfig.from_hf(source.config)
    backend = cpu_backend(dtype)  # type: ignore[arg-type]
    stage = Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=backend)
    held = backend.held_bytes(source, c)
    assert held is not None
    assert list(held.layers) == [layer.nbytes() for layer in stage.weights.layers]
    assert stage.weights.embed_t is not None
    assert held.embed == stage.weights.embed_t.nbytes
    footprint = model_footprint(c, held=held)
    assert footprint.layer_bytes == held.layers
