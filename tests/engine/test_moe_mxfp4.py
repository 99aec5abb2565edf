"""gpt-oss with MXFP4 experts, as its real checkpoints and GGUFs store them.

The twins (:mod:`tests.engine.moe_mxfp4`) are one model three ways: float32 experts
holding the decoded MXFP4 values, gpt-oss's ``*_blocks``/``*_scales`` folder and a GGUF
whose ``ffn_*_exps`` are MXFP4. Both MXFP4 layouts load as MXFP4 block matrices (the
GGUF's views of its mapped file) and give the same bits in every mode. Against the float
twin: in the float32 mode the same bits (every MXFP4 value is a float32, decoded exactly,
then the same products); in the exact mode the same bits for products of several rows and
float32 summation noise for one-row products, where the kernels sum F32 rows in eight-lane
groups and MXFP4 ones in sixteen-lane groups (``engine/cpu/blocks.py``, ``fp4.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from meshnode_packaging.hf_mxfp4 import Derived, derive, mxfp4_plan
from meshnode_packaging.refs import open_ref
from meshnode_packaging.sources import RawTensor, SourceError, open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import WeightsDtype, cpu_backend
from meshnode.engine.cpu import BlockMatrix, set_kernel_threads
from meshnode.engine.moe_weights import expert_slice
from tests.engine.moe_models import golden
from tests.engine.moe_mxfp4 import MODEL, write_mxfp4_twins

MODES: tuple[WeightsDtype, ...] = ("float32", "native", "q8")


@pytest.fixture(autouse=True)
def one_kernel_thread() -> Iterator[None]:
    """Bit-for-bit comparisons at a fixed kernel thread count: with the default, the
    pool's split of a prefill's rows follows the machine's load, and a one-row chunk
    sums in another order than a many-row one (see the module docstring)."""
    set_kernel_threads(1)
    yield
    set_kernel_threads(None)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_mxfp4_twins(tmp_path_factory.mktemp("mxfp4"))


def _stage(path: Path, mode: WeightsDtype, source: Any = None) -> Stage:
    source = source or open_ref(str(path))
    config = ModelConfig.from_hf(source.config)
    layers = config.num_layers
    return Stage(config, source, 0, layers, embed=True, head=True, backend=cpu_backend(mode))


def _logits(stage: Stage, prompt: int = 2) -> Any:
    ids = np.asarray(golden(MODEL)["prompts"][prompt]["prompt_ids"])
    return stage.forward(ids, 0, stage.new_cache(len(ids) + 1))


def _greedy(stage: Stage, steps: int = 16) -> list[int]:
    ids = golden(MODEL)["prompts"][1]["prompt_ids"]
    cache = stage.new_cache(len(ids) + steps + 1)
    x, pos, out = np.asarray(ids), 0, []
    for _ in range(steps):
        token = int(np.argmax(stage.forward(x, pos, cache)[-1]))
        pos, x = pos + len(x), np.asarray([token])
        out.append(token)
    return out


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_both_layouts_load_experts_as_mxfp4_blocks(twins: dict[str, Path], kind: str) -> None:
    source = open_source(twins[kind])
    stage = _stage(twins[kind], "native", source)
    moe = stage.weights.layers[0].moe
    assert moe is not None
    for expert in moe.experts:
        for m in (expert.gate_up, expert.down):
            assert isinstance(m, BlockMatrix)
            assert {p.fmt.name for p in m.parts} == {"MXFP4"}
    if kind == "gguf":  # no dequantize, no copy: views of the mapped file
        stacked = source.tensor("layers.0.mlp.experts.down_proj.weight")
        assert np.shares_memory(moe.experts[3].down.parts[0].raw, expert_slice(stacked, 3).data)


def test_the_folder_hands_out_the_ggufs_expert_tensors(twins: dict[str, Path]) -> None:
    """gate/up de-interleaved, blocks repacked: byte for byte the converter's tensors."""
    hf, gguf_file = open_source(twins["hf"]), open_source(twins["gguf"])
    assert sorted(hf.tensor_names()) == sorted(gguf_file.tensor_names())
    for name in gguf_file.tensor_names():
        if ".mlp.experts." in name:
            a, b = hf.tensor(name), gguf_file.tensor(name)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            assert np.array_equal(a.data, b.data), name
    assert not any(n.endswith(("_blocks", "_scales")) for n in hf.tensor_names())


@pytest.mark.parametrize("mode", MODES)
def test_both_layouts_give_the_same_bits(twins: dict[str, Path], mode: WeightsDtype) -> None:
    a, b = _logits(_stage(twins["hf"], mode)), _logits(_stage(twins["gguf"], mode))
    assert np.array_equal(a, b)


def test_float32_mode_gives_the_decoded_models_bits(twins: dict[str, Path]) -> None:
    want = _logits(_stage(twins["float"], "float32"))
    assert np.array_equal(_logits(_stage(twins["gguf"], "float32")), want)


def test_exact_mode_gives_the_decoded_models_logits(twins: dict[str, Path]) -> None:
    """Summation noise only (one-row products sum in another lane grouping); the same
    greedy tokens."""
    got = _stage(twins["gguf"], "native")
    for ref in (_stage(twins["float"], "native"), _stage(twins["float"], "float32")):
        np.testing.assert_allclose(_logits(got), _logits(ref), rtol=0, atol=1e-5)
        assert _greedy(got) == _greedy(ref)


def test_q8_mode_runs_mxfp4_experts(twins: dict[str, Path]) -> None:
    """8-bit activations against the MXFP4 codes: close to the decoded model's logits
    (on a short prompt: over a long one some row's near-tied experts swap, which the
    8-bit rounding may do)."""
    got = _logits(_stage(twins["gguf"], "q8"), prompt=0)
    want = _logits(_stage(twins["float"], "float32"), prompt=0)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert np.array_equal(np.argmax(got, axis=-1), np.argmax(want, axis=-1))


def test_q8_decode_rows_are_their_bits_alone_in_a_batch(twins: dict[str, Path]) -> None:
    """Five decode rows in one batched step, two of them twice (the same experts, so
    every expert meets two to five rows: MXFP4's products two rows a pass of the weights,
    .q8_fp4.two_mxfp4, or the few-row groups): each row's logits are the bits it gets
    decoded alone."""
    from meshnode.engine.model import BatchRow

    stage = _stage(twins["gguf"], "q8")
    prompts = [p["prompt_ids"][:5] for p in golden(MODEL)["prompts"]]
    prompts = [prompts[0], prompts[1], prompts[0], prompts[1], prompts[2]]
    caches = [stage.new_cache(8) for _ in prompts]
    for ids, cache in zip(prompts, caches, strict=True):
        stage.forward(np.asarray(ids), 0, cache, out_rows=1)
    tokens = [5, 9, 5, 9, 11]
    batched = stage.forward_batch(
        [BatchRow(np.array([t]), 5, c, 1) for t, c in zip(tokens, caches, strict=True)]
    )
    for ids, token, got in zip(prompts, tokens, batched, strict=True):
        cache = stage.new_cache(8)
        stage.forward(np.asarray(ids), 0, cache, out_rows=1)
        alone = stage.forward(np.array([token]), 5, cache)
        assert np.array_equal(got.view(np.uint32), alone.view(np.uint32))


def test_bad_mxfp4_tensors_are_refused() -> None:
    plan = mxfp4_plan(["l.mlp.experts.down_proj_blocks", "l.mlp.experts.down_proj_scales"])
    assert set(plan) == {"l.mlp.experts.down_proj.weight"}
    assert mxfp4_plan(["l.mlp.experts.down_proj_blocks"]) == {}  # no scales: left alone
    wrong = RawTensor("b", "F32", (2, 4, 1, 16), np.zeros(512, np.uint8))
    with pytest.raises(SourceError, match="MXFP4 blocks are uint8"):
        derive("w", Derived(("b", "s"), slice(None)), lambda _: wrong)
    with pytest.raises(SourceError, match="float \\[n, out\\] bias"):
        derive("w", Derived(("b",), slice(None)), lambda _: wrong)
