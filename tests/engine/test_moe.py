"""Mixture-of-experts models against their tiny references (transformers 5.24, float32).

Greedy continuations equal ``golden.json`` exactly for Qwen3-MoE, Mixtral, gpt-oss and
Qwen3.5-MoE: on one node through ``meshnode generate --prompt-ids``'s code path, and
split across two and three stages (cuts inside the run of MoE layers) with all four
prompts in one batch. The GGUF twins (llama.cpp's names and 3-D expert tensors) give the
checkpoints' logits. In the exact mode a row's logits are the same bits alone and
batched; a step reads each chosen expert once and no other expert.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from meshnode_packaging.refs import open_ref
from meshnode_packaging.sources import RawTensor, open_source
from meshnode_packaging.writer import write_package
from typer.testing import CliRunner

from meshnode.cli import app
from meshnode.cli import commands as _commands  # registers the commands on app
from meshnode.cli.generate import GenerateConfig, complete
from meshnode.engine import ModelConfig, Stage, ops
from meshnode.engine.attention import reference_heads
from meshnode.engine.backend import CpuBackend, CudaBackend, WeightsDtype, cpu_backend
from meshnode.engine.config import ModelConfigError
from meshnode.engine.cpu import MAX_KERNEL_ROWS, BlockMatrix
from meshnode.engine.generate import prefill
from meshnode.engine.loader import load_model
from meshnode.engine.model import BatchRow
from meshnode.engine.moe import moe_mlp, route
from meshnode.engine.moe_weights import expert_slice, load_moe, matrix
from meshnode.engine.sampling import SamplingParams
from meshnode.node.footprint import model_footprint
from tests.engine.hybrid_model import HYBRID_DIR, hybrid_golden
from tests.engine.moe_models import GGUF_ARCH, MODELS, MOE_DIR, golden, write_gguf_twin

runner = CliRunner()
assert _commands


def _stages(path: Path, cuts: tuple[int, ...], backend: Any = None) -> list[Stage]:
    source = open_ref(str(path))
    config = ModelConfig.from_hf(source.config)
    bounds = [0, *cuts, config.num_layers]
    return [
        Stage(config, source, a, b, embed=a == 0, head=b == config.num_layers, backend=backend)
        for a, b in itertools.pairwise(bounds)
    ]


def _greedy(stages: list[Stage], prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy decoding of every prompt at once: each stage runs one batched forward of
    all sequences' rows (prefill, then one row each per step)."""
    caches = [[s.new_cache(len(p) + steps + 1) for s in stages] for p in prompts]
    inputs: list[Any] = [np.asarray(p) for p in prompts]
    pos = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        xs = inputs
        for j, stage in enumerate(stages):
            rows = [BatchRow(x, pos[i], caches[i][j], 1) for i, x in enumerate(xs)]
            xs = stage.forward_batch(rows)
        for i, logits in enumerate(xs):
            token = int(np.argmax(logits[-1]))
            out[i].append(token)
            pos[i] += len(inputs[i])
            inputs[i] = np.asarray([token])
    return out


@pytest.mark.parametrize("model", MODELS)
def test_one_node_greedy_equals_the_reference(model: str) -> None:
    """What ``meshnode generate --prompt-ids`` runs; and the last prompt row's top 5."""
    loaded = load_model(str(MOE_DIR / model), cpu_backend())
    for prompt in golden(model)["prompts"]:
        config = GenerateConfig(
            prompt_ids=tuple(prompt["prompt_ids"]),
            max_tokens=len(prompt["gen_ids"]),
            sampling=SamplingParams(temperature=0.0),
        )
        assert complete(loaded, config, None).token_ids == prompt["gen_ids"], prompt["id"]
        ids = prompt["prompt_ids"]
        logits = prefill(loaded.stage, loaded.stage.new_cache(len(ids) + 1), ids)
        top_ids, top_logits = prompt["last_prompt_logits_top5"]
        assert [int(i) for i in np.argsort(-logits)[:5]] == top_ids, prompt["id"]
        np.testing.assert_allclose(logits[top_ids], top_logits, atol=1e-4)


@pytest.mark.parametrize("cuts", [(2,), (1, 3)], ids=["2-stages", "3-stages"])
@pytest.mark.parametrize("model", MODELS)
def test_split_and_batched_greedy_equals_the_reference(model: str, cuts: tuple[int, ...]) -> None:
    prompts = golden(model)["prompts"]
    got = _greedy(_stages(MOE_DIR / model, cuts), [p["prompt_ids"] for p in prompts], 32)
    assert got == [p["gen_ids"] for p in prompts]


# -- exactness and expert reads --------------------------------------------------------


SEGMENTS = [1, 3, 40, 1, 16, 17, 2, 5, 1, 24]  # rows of each sequence in a batch


@pytest.mark.parametrize("dtype", ["native", "float32"])
@pytest.mark.parametrize("model", MODELS)
def test_a_rows_experts_give_the_same_bits_in_any_batch(model: str, dtype: WeightsDtype) -> None:
    """Routing, grouping by expert and the weighted sum depend on the row alone, and each
    product takes the path of the row's segment (``sizes``): each segment of a batch
    equals that segment run alone, bit for bit, however many rows of the batch chose the
    same experts (110 rows of short and long segments, among 4 or 8 experts)."""
    backend = CpuBackend(dtype)
    source = open_ref(str(MOE_DIR / model))
    config = ModelConfig.from_hf(source.config)
    moe = config.moe or (config.hybrid.moe if config.hybrid else None)
    assert moe is not None
    weights = load_moe(source, moe, "layers.1.", blocks=backend.cpu_blocks)
    rows = sum(SEGMENTS)
    x = np.random.default_rng(0).standard_normal((rows, config.hidden_size)).astype(np.float32)
    batch = moe_mlp(backend, moe, weights, x, SEGMENTS)
    counts = np.bincount(route(np, x @ _dense(weights.router), moe)[0].reshape(-1))
    assert counts.max() > MAX_KERNEL_ROWS  # an expert chosen by more rows than a kernel takes
    lo = 0
    for size in SEGMENTS:
        alone = moe_mlp(backend, moe, weights, x[lo : lo + size])
        differ = int(np.count_nonzero(alone != batch[lo : lo + size]))
        assert differ == 0, f"{model} ({dtype}): a segment of {size} rows differs in {differ}"
        lo += size
    with pytest.raises(ValueError, match="segments of 2 rows for x of 1"):
        moe_mlp(backend, moe, weights, x[:1], [1, 1])


def _dense(w: Any) -> np.ndarray:
    return w.dense().T if isinstance(w, BlockMatrix) else np.asarray(w)


class _Recorder(CpuBackend):
    """The CPU backend, noting each weight matrix a product reads and its rows."""

    reads: list[tuple[int, int]]

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "reads", [])

    def linear(self, x: Any, w: Any, sizes: Sequence[int] | None = None) -> Any:
        self.reads.append((id(w), x.shape[0]))
        return super().linear(x, w, sizes)


def test_a_step_reads_each_chosen_expert_once_and_no_other() -> None:
    recorder = _Recorder()
    (stage,) = _stages(MOE_DIR / "qwen3-moe-tiny", (), recorder)
    caches = [stage.new_cache(16) for _ in range(3)]
    rows = [BatchRow(np.asarray([3 + i, 40 + i, 90 + i]), 0, c) for i, c in enumerate(caches)]
    top_k = 2

    def expert_reads(layer: Any) -> list[tuple[int, int]]:
        experts = {id(e.gate_up): n for n, e in enumerate(layer.moe.experts)}
        return [(experts[w], r) for w, r in recorder.reads if w in experts]

    recorder.reads.clear()
    stage.forward_batch(rows)  # nine rows
    for layer in stage.weights.layers:
        read = expert_reads(layer)
        assert len(read) == len({e for e, _ in read})  # one product per chosen expert
        assert sum(r for _, r in read) == 9 * top_k  # every row went to k of them
    recorder.reads.clear()
    stage.forward(np.asarray([11]), 3, caches[0])  # one decode row
    for layer in stage.weights.layers:
        assert [r for _, r in expert_reads(layer)] == [1] * top_k  # k experts, no other


# -- GGUF twins --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("moe-gguf")
    return {m: write_gguf_twin(m, folder / f"{m}.gguf") for m in MODELS}


@pytest.mark.parametrize("model", list(MODELS[:3]))
def test_gguf_twin_gives_the_checkpoint_logits_and_the_reference_tokens(
    twins: dict[str, Path], model: str
) -> None:
    (from_gguf,), (from_hf,) = _stages(twins[model], ()), _stages(MOE_DIR / model, ())
    assert from_gguf.config.moe == from_hf.config.moe
    assert from_gguf.config.layer_types == from_hf.config.layer_types
    assert from_gguf.config.rope_inv_freq(0) == from_hf.config.rope_inv_freq(0)
    prompt = golden(model)["prompts"][1]
    ids = np.asarray(prompt["prompt_ids"])
    a = from_gguf.forward(ids, 0, from_gguf.new_cache(64))
    b = from_hf.forward(ids, 0, from_hf.new_cache(64))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert _greedy([from_gguf], [prompt["prompt_ids"]], 32) == [prompt["gen_ids"]]


def test_gguf_twin_config_names_the_family(twins: dict[str, Path]) -> None:
    types = {m: open_source(p).config["model_type"] for m, p in twins.items()}
    assert types == {
        "qwen3-moe-tiny": "qwen3_moe",
        "mixtral-tiny": "mixtral",
        "gpt-oss-tiny": "gpt_oss",
        "qwen35-moe-tiny": "qwen3_5_moe_text",
    }
    assert set(GGUF_ARCH) == set(types.values())


@pytest.mark.parametrize("cuts", [(), (2,), (1, 3)], ids=["1-stage", "2-stages", "3-stages"])
def test_qwen35_moe_twin_gives_the_checkpoint_bits_and_the_reference_tokens(
    twins: dict[str, Path], cuts: tuple[int, ...]
) -> None:
    """llama.cpp's ``qwen35moe``: DeltaNet tensors under their GGUF names, value heads in
    its tiled order, norms plus one, ``ssm_a = -exp(A_log)``: the checkpoint's exact
    logits, and the reference's tokens on one node and split (cuts between DeltaNet
    layers and before the attention layer), all prompts batched."""
    model = "qwen35-moe-tiny"
    _assert_qwen35_twin(twins[model], MOE_DIR / model, golden(model)["prompts"], 32, cuts)


@pytest.mark.parametrize("cuts", [(), (3,)], ids=["1-stage", "2-stages"])
def test_qwen35_dense_twin_gives_the_checkpoint_bits_and_the_reference_tokens(
    tmp_path: Path, cuts: tuple[int, ...]
) -> None:
    """llama.cpp's dense ``qwen35`` (read as ``qwen35moe`` is, with a SwiGLU MLP): the
    tiny Qwen3.5 reference's exact logits and its tokens, on one node and split before
    the first attention layer."""
    twin = write_gguf_twin(HYBRID_DIR.name, tmp_path / "qwen35.gguf")
    prompts = hybrid_golden()["prompts"][:3]  # 5, 17 and 40 tokens
    hybrid = _assert_qwen35_twin(twin, HYBRID_DIR, prompts, 16, cuts)
    assert hybrid.moe is None


def _assert_qwen35_twin(
    twin: Path, folder: Path, prompts: list[dict[str, Any]], steps: int, cuts: tuple[int, ...]
) -> Any:
    """The GGUF ``twin`` of the Qwen3.5 reference ``folder``: its hybrid config (returned),
    its exact logits on one stage, the reference's first ``steps`` tokens of ``prompts``
    all batched on the stages ``cuts`` make."""
    from_gguf, from_hf = _stages(twin, cuts), _stages(folder, cuts)
    hybrid, want = from_gguf[0].config.hybrid, from_hf[0].config.hybrid
    assert hybrid is not None
    assert want is not None
    assert np.float32(hybrid.rms_norm_eps) == np.float32(want.rms_norm_eps)  # GGUF: float32
    assert dataclasses.replace(hybrid, rms_norm_eps=want.rms_norm_eps) == want
    ids = [p["prompt_ids"] for p in prompts]
    if not cuts:
        (a,), (b,) = from_gguf, from_hf
        x = np.asarray(ids[1])
        got, ref = a.forward(x, 0, a.new_cache(64)), b.forward(x, 0, b.new_cache(64))
        np.testing.assert_array_equal(got, ref)
    assert _greedy(from_gguf, ids, steps) == [p["gen_ids"][:steps] for p in prompts]
    return hybrid


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_cuda_stage_refuses_moe_in_one_line(model: str) -> None:
    source = open_ref(str(MOE_DIR / model))
    config = ModelConfig.from_hf(source.config)
    with pytest.raises(ModelConfigError, match=f"^the CUDA stage does not run {config.model_type}"):
        Stage(config, source, 0, 1, embed=True, head=False, backend=CudaBackend(np))


# -- configuration and the layer's pieces --------------------------------------------------

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 160,
    "moe_intermediate_size": 48,
    "vocab_size": 512,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}


@pytest.mark.parametrize(
    ("change", "sparse"),
    [
        ({}, [True] * 6),
        ({"decoder_sparse_step": 2}, [False, True] * 3),
        ({"mlp_only_layers": [0, 5]}, [False, True, True, True, True, False]),
        ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, [False] * 5 + [True]),
    ],
)
def test_dense_layers_between_moe_ones(change: dict[str, Any], sparse: list[bool]) -> None:
    moe = ModelConfig.from_hf({**QWEN3_MOE, **change}).moe
    assert moe is not None
    assert [moe.is_sparse(i) for i in range(6)] == sparse
    assert (moe.expert_size, moe.top_k, moe.norm_topk_prob) == (48, 2, False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, "outside 1..8"),
        ({"num_experts_per_tok": None}, "invalid model config"),
        ({"moe_intermediate_size": -4}, "intermediate size must be positive"),
    ],
)
def test_bad_moe_configs(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf({**QWEN3_MOE, **change})


def test_routing_rules() -> None:
    logits = np.array([[0.5, 2.0, -1.0, 1.0], [3.0, 3.0, 0.0, 1.0]], np.float32)
    cfg = ModelConfig.from_hf(QWEN3_MOE).moe
    assert cfg is not None
    chosen, weights = route(np, logits, replace(cfg, top_k=2))
    assert chosen.tolist() == [[1, 3], [0, 1]]  # a tie goes to the lower expert
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(weights[0], p[[1, 3]], rtol=1e-6)  # not renormalised
    _, renormed = route(np, logits, replace(cfg, top_k=2, norm_topk_prob=True))
    np.testing.assert_allclose(renormed[0], p[[1, 3]] / p[[1, 3]].sum(), rtol=1e-6)
    _, gpt_oss = route(np, logits, replace(cfg, top_k=2, routing="topk_softmax"))
    np.testing.assert_allclose(gpt_oss, renormed, rtol=1e-6)  # the same numbers, other sums
    np.testing.assert_allclose(gpt_oss[1], [0.5, 0.5])


def test_clamped_swiglu_is_gpt_oss_gate() -> None:
    gate = np.array([[-3.0, 0.5, 9.0]], np.float32)
    up = np.array([[-8.0, 0.25, 2.0]], np.float32)
    got = ops.clamped_swiglu_mul(np, np.concatenate([gate, up], axis=1), 1.702, 7.0)
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    want = (u + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0, 2] == pytest.approx(3.0 * 7.0, rel=1e-4)  # both clamped at 7


def test_sinks_take_a_share_of_each_rows_attention() -> None:
    rng = np.random.default_rng(1)
    heads, kv_heads, rows, t, dim = 4, 2, 3, 6, 8
    q = rng.standard_normal((heads, rows, dim)).astype(np.float32)
    keys = rng.standard_normal((kv_heads, t, dim)).astype(np.float32)
    values = rng.standard_normal((kv_heads, t, dim)).astype(np.float32)
    sinks = np.array([0.0, 1.0, -2.0, 3.0], np.float32)
    got = ops.attention(np, q, keys, values, 0.35, 4, sinks)
    for h in range(heads):
        for r in range(rows):
            pos = t - rows + r
            lo = max(0, pos - 4 + 1)
            s = keys[h // 2, lo : pos + 1] @ q[h, r] * 0.35
            e = np.exp(np.append(s, sinks[h]) - max(s.max(), sinks[h]))
            want = (e[:-1] / e.sum()) @ values[h // 2, lo : pos + 1]
            np.testing.assert_allclose(got[h, r], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_windows_rows_by_rows_are_its_decode_steps_bits(window: int | None, sinks: bool) -> None:
    """Where the compiled kernel does not run (a head dimension not a multiple of 16,
    another backend), gpt-oss's sinks and Qwen3.5's gated attention run the reference's
    heads: a verify window's rows one at a time (``ops.attention_by_rows``) are the bits
    of decode steps at their positions (one-row calls over the cache's keys so far), and
    the attention."""
    rng = np.random.default_rng(3)
    heads, kv_heads, dim, t, rows = 16, 4, 64, 37, 7
    cache = rng.standard_normal((2, kv_heads, 64, dim)).astype(np.float32)  # [2, Hkv, T, D]
    keys, values = cache[0, :, :t], cache[1, :, :t]  # views, as KVCache.write returns them
    q = rng.standard_normal((heads, rows, dim)).astype(np.float32)
    sink = rng.standard_normal(heads).astype(np.float32) if sinks else None
    got = reference_heads(np, q, keys, values, 0.125, window, sink)
    for i in range(rows):
        end = t - rows + i + 1
        step = ops.attention(np, q[:, i : i + 1].copy(), keys[:, :end], values[:, :end], 0.125,
                             window, sink)  # fmt: skip
        assert np.array_equal(got[:, i : i + 1], step), f"row {i}"
    want = ops.attention(np, q, keys, values, 0.125, window, sink)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_yarn_scales_low_frequencies_and_the_attention() -> None:
    config = ModelConfig.from_hf(json.loads((MOE_DIR / "gpt-oss-tiny" / "config.json").read_text()))
    plain = ModelConfig.from_hf({**QWEN3_MOE, "head_dim": 16, "rope_theta": 150000.0})
    yarn, base = config.rope_inv_freq(0), plain.rope_inv_freq(0)
    assert yarn[0] == base[0]  # the fastest rotation is kept
    assert yarn[-1] == pytest.approx(base[-1] / 4)  # the slowest divided by the factor
    assert config.rope_attention_factor == pytest.approx(0.1 * np.log(4) + 1)


@pytest.mark.parametrize("model", MODELS[:3])
def test_planner_estimate_counts_every_expert(model: str) -> None:
    """Without the tensors at hand (a stage 0 fetching byte ranges) the planner's estimate
    of a layer is about what a float32 stage holds: every expert, not only k."""
    source = open_ref(str(MOE_DIR / model))
    config = ModelConfig.from_hf(source.config)
    held = cpu_backend().held_bytes(source, config)
    assert held is not None
    estimate = model_footprint(config).layer_bytes
    np.testing.assert_allclose(estimate, held.layers, rtol=0.01)


@pytest.mark.parametrize("model", MODELS)
def test_generate_prompt_ids_command_gives_the_reference_tokens(model: str) -> None:
    """``meshnode generate --prompt-ids`` in the exact mode (blocks kept, ``--dtype native``)."""
    prompt = golden(model)["prompts"][2]
    ids = ",".join(str(t) for t in prompt["prompt_ids"])
    args = ["--model", str(MOE_DIR / model), "--device", "cpu", "--dtype", "native"]
    args += ["--prompt-ids", ids]
    done = runner.invoke(app, ["generate", *args, "--json", "--max-tokens", "32"])
    assert done.exit_code == 0, done.output
    summary = json.loads(done.output.strip().splitlines()[-1])
    assert summary["token_ids"] == prompt["gen_ids"]


def test_gguf_experts_stay_views_of_the_mapped_file(twins: dict[str, Path]) -> None:
    """With blocks kept, expert e's matrices are its slice of the memory-mapped 3-D tensor
    (a token's product touches its experts' pages only), not copies."""
    source = open_source(twins["mixtral-tiny"])
    config = ModelConfig.from_hf(source.config)
    layers = config.num_layers
    stage = Stage(config, source, 0, layers, embed=True, head=True, backend=cpu_backend("native"))
    moe = stage.weights.layers[1].moe
    assert moe is not None
    stacked = source.tensor("layers.1.mlp.experts.gate_proj.weight")
    for e, expert in enumerate(moe.experts):
        gate = expert.gate_up.parts[0].raw
        assert np.shares_memory(gate, expert_slice(stacked, e).data)
        assert not np.shares_memory(gate, expert_slice(stacked, (e + 1) % 4).data)
    assert stage.weights.nbytes() == sum(
        source.tensor(n).data.nbytes for n in source.tensor_names()
    )


@pytest.mark.parametrize("model", MODELS)
def test_layer_package_of_a_moe_gguf_gives_its_logits(
    twins: dict[str, Path], model: str, tmp_path: Path
) -> None:
    """``meshnode package write`` carries the routers, 3-D expert tensors and sinks (and
    Qwen3.5-MoE's DeltaNet tensors, as its GGUF source hands them out)."""
    write_package(twins[model], tmp_path / "pkg")
    (packaged,), (direct,) = _stages(tmp_path / "pkg", ()), _stages(twins[model], ())
    assert packaged.config.moe == direct.config.moe
    ids = np.asarray(golden(model)["prompts"][0]["prompt_ids"])
    a = packaged.forward(ids, 0, packaged.new_cache(64))
    b = direct.forward(ids, 0, direct.new_cache(64))
    np.testing.assert_array_equal(a, b)


def test_quantized_expert_slices_multiply_as_their_decoded_rows() -> None:
    """One expert of a Q8_0 ``[n, out, in]`` stack, in blocks and decoded, with gate and
    up stacked: the same products as the decoded float32 rows."""
    rng = np.random.default_rng(2)
    n, out, inp = 4, 64, 96
    stack = rng.standard_normal((n * out, inp)).astype(np.float32)
    q8 = np.asarray(gguf.quants.quantize(stack, gguf.GGMLQuantizationType.Q8_0))
    t = RawTensor("w", "Q8_0", (n, out, inp), q8.reshape(-1))
    decoded = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).reshape(n, out, inp)
    x = rng.standard_normal((3, inp)).astype(np.float32)
    gate, up = expert_slice(t, 2), expert_slice(t, 3)
    want = x @ np.concatenate([decoded[2], decoded[3]]).T  # [3, 2 out]
    blocks, dense = matrix([gate, up], True), matrix([gate, up], False)
    assert isinstance(blocks, BlockMatrix)
    np.testing.assert_allclose(x @ blocks, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x @ dense, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError, match=r"expert 4 outside 0\.\.3"):
        expert_slice(t, 4)
