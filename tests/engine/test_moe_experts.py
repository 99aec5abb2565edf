"""A MoE layer's chosen experts in one compiled call (``engine/cpu/experts.py``).

GGUF's 3-D expert stacks go through :class:`~meshnode.engine.cpu.experts.ExpertLayer`:
the same product kernels as the expert-at-a-time path, so the same bits, in the exact and
the 8-bit modes, for one row, a batch and a prefill, on any number of threads; each
chosen expert computed once, no other; the exact mode gives them the rows of short
segments (decode, verify) however many chose an expert, and leaves a prefill's rows to
the expert-at-a-time path (BLAS, which sums in another order).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import pytest
from meshnode_packaging.refs import open_ref
from meshnode_packaging.sources import RawTensor, open_source

from meshnode.engine import ModelConfig, moe, weights
from meshnode.engine.backend import WeightsDtype, cpu_backend
from meshnode.engine.cpu import MAX_KERNEL_ROWS, experts, experts_kernels, matrix
from meshnode.engine.cpu import pool as pool_module
from meshnode.engine.cpu.pool import KernelPool
from meshnode.engine.loader import load_model
from meshnode.engine.moe_config import MoeConfig
from meshnode.engine.moe_weights import MoeWeights, load_moe
from tests.engine.moe_models import MOE_DIR, golden, write_gguf_twin
from tests.engine.test_kernel_pool import idle_gauge

N, E, INTER, K = 6, 128, 64, 3  # experts, hidden, expert size, experts per row


class _Source:
    """A model source of one layer's router and 3-D expert tensors (what load_moe reads)."""

    def __init__(self, tensors: dict[str, RawTensor]) -> None:
        self.tensors = tensors

    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def tensor(self, name: str) -> RawTensor:
        return self.tensors[name]


def _raw(name: str, values: np.ndarray, qtype: str) -> RawTensor:
    kind = gguf.GGMLQuantizationType[qtype]
    data = values if qtype == "F32" else gguf.quants.quantize(values, kind)
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return RawTensor(name, qtype, values.shape, flat)


def _layer(qtype: str) -> tuple[MoeConfig, MoeWeights]:
    rng = np.random.default_rng(7)
    p = "layers.0.mlp."

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {
        f"{p}gate.weight": _raw(f"{p}gate.weight", w(N, E), "F32"),
        f"{p}experts.gate_proj.weight": _raw("gate", w(N, INTER, E), qtype),
        f"{p}experts.up_proj.weight": _raw("up", w(N, INTER, E), qtype),
        f"{p}experts.down_proj.weight": _raw("down", w(N, E, INTER), qtype),
    }
    config = MoeConfig(N, K, INTER, (True,), norm_topk_prob=True)
    source: Any = _Source(tensors)
    return config, load_moe(source, config, "layers.0.", blocks=True)


@pytest.fixture(params=["Q8_0", "Q4_0"])
def layer(request: pytest.FixtureRequest) -> tuple[MoeConfig, MoeWeights]:
    return _layer(request.param)


@pytest.fixture(scope="module")
def free_pool() -> KernelPool:
    """Kernel threads on four free cores, whatever this machine runs (the real pool
    leaves a product serial when other processes use the cores)."""
    return KernelPool(idle_gauge(4))


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch, free_pool: KernelPool) -> list[int]:
    """The threads the experts are shared between (the machine's free cores otherwise),
    on :func:`free_pool`'s threads."""
    chosen = [1]
    monkeypatch.setattr(matrix, "shared_threads", lambda: chosen[0])
    monkeypatch.setattr(matrix, "_pool", lambda: free_pool)
    return chosen


def _expert_at_a_time(
    backend: Any, config: MoeConfig, w: MoeWeights, x: Any, sizes: list[int] | None = None
) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "_compiled_experts", lambda *a: False)
        return moe.moe_mlp(backend, config, w, x, sizes)


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, E)).astype(np.float32)


@pytest.mark.parametrize("mode", ["native", "q8"])
@pytest.mark.parametrize("n", [1, 5, 12])
def test_compiled_experts_give_the_expert_at_a_time_bits(
    layer: tuple[MoeConfig, MoeWeights], mode: WeightsDtype, n: int, threads: list[int]
) -> None:
    config, w = layer
    assert w.stacked is not None
    backend = cpu_backend(mode)
    x = _rows(n)
    want = _expert_at_a_time(backend, config, w, x)
    for count in (1, 2, 3):
        threads[0] = count
        got = moe.moe_mlp(backend, config, w, x)
        assert np.array_equal(got, want), (mode, n, count)


@pytest.mark.parametrize("mode", ["native", "q8"])
def test_the_kernel_threads_take_the_experts_one_a_chunk(
    layer: tuple[MoeConfig, MoeWeights], mode: WeightsDtype, threads: list[int]
) -> None:
    """On two threads the chosen experts are posted to the kernel threads, one expert a
    chunk (the pool's chunks of a job are experts_kernels.TASK_ROWS "rows" of its dummy
    part), and give the one-thread bits; one thread posts nothing."""
    config, w = layer
    backend = cpu_backend(mode)
    x = _rows(5, seed=4)
    pool = matrix._pool()
    assert experts_kernels.TASK_ROWS == pool_module.CHUNK_ROWS
    for t in (1, 2, 3, 8):
        rows = pool_module.chunk_rows(1, experts_kernels.BLOCK_WORDS, 1, t)
        assert rows == experts_kernels.TASK_ROWS, t  # else a chunk is not one expert
    want = moe.moe_mlp(backend, config, w, x)
    before = pool.posted
    threads[0] = 2
    assert pool.settle(5.0)  # no helper still holds a chunk of an earlier job
    got = moe.moe_mlp(backend, config, w, x)
    assert pool.posted == before + 1
    assert pool.job_word(pool_module.CA) == np.unique(moe.route(np, x @ w.router, config)[0]).size
    assert np.array_equal(got, want)


@pytest.mark.parametrize("copies", [2, 4, 5])  # 5: over ONE_ROW_EXPERTS, one product
def test_q8_few_rows_an_expert_give_the_multi_row_bits(
    layer: tuple[MoeConfig, MoeWeights], copies: int, threads: list[int]
) -> None:
    """An expert that few rows chose multiplies them one at a time in q8 (the 8-row lanes
    would cost it more); the bits are the multi-row product's, as the expert-at-a-time
    path computes it. Copies of one row choose the same experts: each gets them all."""
    config, w = layer
    backend = cpu_backend("q8")
    x = np.repeat(_rows(1, seed=3), copies, axis=0)
    want = _expert_at_a_time(backend, config, w, x)
    got = moe.moe_mlp(backend, config, w, x)
    assert np.array_equal(got, want)
    assert np.array_equal(got[0], got[-1])


def test_q8_mode_takes_a_prefill_in_one_call(layer: tuple[MoeConfig, MoeWeights]) -> None:
    """The 8-bit products take any rows the same way: a prefill's experts too."""
    config, w = layer
    backend = cpu_backend("q8")
    x = _rows(40, seed=1)
    picks = moe.route(np, x @ w.router, config)[0]
    assert picks.shape == (40, K)
    assert moe._compiled_experts(backend, w)
    assert np.array_equal(
        moe.moe_mlp(backend, config, w, x), _expert_at_a_time(backend, config, w, x)
    )


def test_exact_mode_gives_short_segments_rows_to_the_compiled_experts() -> None:
    """Decode rows take the kernels (the compiled experts) however many rows of the batch
    chose their experts; a prefill's rows (a segment of more than MAX_KERNEL_ROWS) go an
    expert at a time through BLAS; each segment the same bits as alone."""
    config, w = _layer("Q8_0")
    assert w.stacked is not None
    stacked, seen = w.stacked, []

    def spy(x: np.ndarray, *rest: Any) -> Any:
        seen.append(len(x))
        return stacked(x, *rest)

    spied = dataclasses.replace(w, stacked=cast(Any, spy))
    backend = cpu_backend("native")
    decode = MAX_KERNEL_ROWS + 4
    x = _rows(decode + 20, seed=2)
    x[:decode] = x[0] + 1e-3 * x[:decode]  # the decode rows all choose the same experts
    assert np.all(moe.route(np, x[:decode] @ w.router.dense().T, config)[0] == moe.route(
        np, x[:1] @ w.router.dense().T, config)[0])  # fmt: skip
    got = moe.moe_mlp(backend, config, spied, x, [1] * decode + [20])
    assert seen == [decode]  # the prefill's rows went an expert at a time
    for i in range(decode):
        assert np.array_equal(moe.moe_mlp(backend, config, w, x[i : i + 1])[0], got[i])
    assert np.array_equal(moe.moe_mlp(backend, config, w, x[decode:]), got[decode:])
    assert not moe._compiled_experts(cpu_backend("float32"), w)


def test_grouping_computes_each_chosen_expert_once_and_no_other() -> None:
    picks = np.array([[4, 1, 2], [2, 4, 0], [1, 4, 5]])
    chosen, starts, order = experts.group(picks)
    assert chosen.tolist() == [0, 1, 2, 4, 5]  # expert 3: no row, never read
    groups = [order[a:b] for a, b in itertools.pairwise(starts)]
    for e, flat in zip(chosen, groups, strict=True):
        rows, slots = np.divmod(flat, K)
        assert (picks[rows, slots] == e).all()
        assert rows.tolist() == sorted(rows.tolist())
    assert sorted(order.tolist()) == list(range(picks.size))


@pytest.mark.parametrize(
    ("model", "stacks"),
    [
        ("mixtral-tiny", True),
        ("qwen3-moe-tiny", False),  # expert size 48: down's rows are not whole 32-value chunks
        ("gpt-oss-tiny", True),  # clamped SwiGLU, biases
    ],
)
def test_which_layers_are_stacked(model: str, stacks: bool, tmp_path: Path) -> None:
    """A GGUF's experts are stacks where the kernels take them, and so are a checkpoint's
    per-expert tensors and gpt-oss's interleaved layout (stacked at load)."""
    twin = open_source(str(write_gguf_twin(model, tmp_path / f"{model}.gguf")))
    config = ModelConfig.from_hf(twin.config)
    assert config.moe is not None
    folder = open_ref(str(MOE_DIR / model))
    for source in (twin, folder):
        stacked = load_moe(source, config.moe, "layers.1.", blocks=True).stacked
        assert (stacked is not None) == stacks
        assert load_moe(source, config.moe, "layers.1.", blocks=False).stacked is None


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoeConfig, list[MoeWeights]]:
    """gpt-oss-tiny's layer 1 from its GGUF twin (gate and up apart) and from its
    checkpoint (interleaved, stacked at load as GGUF's fused gate/up)."""
    path = write_gguf_twin("gpt-oss-tiny", tmp_path_factory.mktemp("gpt-oss") / "twin.gguf")
    twin, folder = open_source(str(path)), open_ref(str(MOE_DIR / "gpt-oss-tiny"))
    config = ModelConfig.from_hf(twin.config).moe
    assert config is not None
    assert config.glu == "clamped_swiglu"
    return config, [load_moe(s, config, "layers.1.", blocks=True) for s in (twin, folder)]


@pytest.mark.parametrize("n", [1, 5, 12, 40])
def test_gpt_oss_compiled_experts_give_the_expert_at_a_time_bits(
    gpt_oss: tuple[MoeConfig, list[MoeWeights]], n: int, threads: list[int]
) -> None:
    """Biases and the clamped SwiGLU inside the compiled call: the same bits as an expert
    at a time (the same activation, :meth:`CpuBackend.clamped_glu`), on 1 to 3 threads,
    from both layouts; 40 rows: more rows an expert than a kernel pass takes."""
    config, layers = gpt_oss
    backend = cpu_backend("native")
    x = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
    sizes = [1] * n  # decode rows: every row to the compiled experts
    want = _expert_at_a_time(backend, config, layers[0], x, sizes)
    for w in layers:
        assert w.stacked is not None
        assert w.stacked.kind == 1
        assert w.stacked.gate_up_bias.shape == (8, 128)
        for count in (1, 2, 3):
            threads[0] = count
            got = moe.moe_mlp(backend, config, w, x, sizes)
            assert np.array_equal(got, want), (n, count)


def test_bad_stacks_are_refused() -> None:
    flat = np.zeros(4 * 8 * 30 * 4, np.uint8)
    assert experts.stack([RawTensor("odd", "F32", (4, 8, 30), flat)]) is None  # rows of 30
    assert experts.stack([RawTensor("flat", "F32", (8, 120), flat[: 8 * 120 * 4])]) is None
    gate = experts.stack([RawTensor("g", "F32", (2, 64, 32), np.zeros(2 * 64 * 32 * 4, np.uint8))])
    down = experts.stack([RawTensor("d", "F32", (2, 32, 64), np.zeros(2 * 32 * 64 * 4, np.uint8))])
    assert gate is not None
    assert down is not None
    with pytest.raises(ValueError, match="do not chain"):
        experts.ExpertLayer(gate, down)


def test_per_expert_gguf_names_give_the_stacked_twins_bits(tmp_path: Path) -> None:
    """llama.cpp's first Mixtral GGUFs, one tensor per expert (``blk.N.ffn_gate.E.weight``),
    load as the checkpoint's per-expert matrices: the same logits as the 3-D twin (the same
    kernels an expert at a time) and the reference's greedy tokens."""
    model = "mixtral-tiny"
    old = write_gguf_twin(model, tmp_path / "old.gguf", per_expert=True)
    new = write_gguf_twin(model, tmp_path / "new.gguf")
    names = open_source(str(old)).tensor_names()
    assert "layers.1.mlp.experts.3.down_proj.weight" in names
    prompt = golden(model)["prompts"][1]
    logits = []
    for path in (old, new):
        model_ = load_model(str(path), cpu_backend("native"))
        stage = model_.stage
        ids = np.asarray(prompt["prompt_ids"])
        cache = stage.new_cache(len(ids) + len(prompt["gen_ids"]) + 1)
        logits.append(stage.forward(ids, 0, cache))
        tokens = [int(np.argmax(logits[-1][-1]))]
        for i in range(len(prompt["gen_ids"]) - 1):
            out = stage.forward(np.asarray(tokens[-1:]), len(ids) + i, cache)
            tokens.append(int(np.argmax(out[-1])))
        assert tokens == prompt["gen_ids"], path.name
    assert np.array_equal(logits[0], logits[1])


def test_stacked_experts_count_their_stored_bytes() -> None:
    """The planner's per-layer bytes count a GGUF's 3-D expert tensors as the blocks a CPU
    stage keeps (their bytes in the file), not as float32 (7x more for Q4_K, so a 12-layer
    cut of Qwen3-30B-A3B, 4.7 GB, once asked three nodes for 28 GB)."""
    gate = _raw("gate", np.zeros((N, INTER, E), np.float32), "Q8_0")
    assert weights._held(gate, blocks=True) == gate.data.nbytes < 4 * N * INTER * E
    assert weights._held(gate, blocks=False) == 4 * N * INTER * E


@pytest.mark.parametrize(
    ("n", "k", "routing", "norm"),
    [
        (8, 2, "softmax_topk", True),
        (32, 4, "topk_softmax", False),
        (128, 8, "softmax_topk", False),
        (128, 8, "softmax_topk", True),
        (300, 8, "softmax_topk", True),
        (512, 10, "softmax_topk", True),
        (1100, 3, "topk_softmax", False),
    ],
)
def test_compiled_routing_gives_route_and_groups_bits(
    n: int, k: int, routing: str, norm: bool
) -> None:
    """``experts.route`` (softmax, top-k, weights and grouping in one compiled call) is
    ``moe.route`` then ``experts.group`` to the bit, for every rule and expert count
    (past NumPy's 128-value pairwise blocks), ties included (logits of a coarse grid:
    equal scores go in index order)."""
    rng = np.random.default_rng(n + k)
    config = MoeConfig(n, k, 64, (True,), routing=routing, norm_topk_prob=norm)  # type: ignore[arg-type]
    for rows in (1, 3, 9):
        logits = (rng.standard_normal((rows, n)) * 4).astype(np.float32)
        logits[1:] = np.round(logits[1:] * 2) / 2  # many equal logits
        chosen, weights = moe.route(np, logits, config)
        got = experts.route(logits, k, routing == "topk_softmax", norm)
        assert np.array_equal(got.picks, chosen)
        assert got.weights.dtype == np.float32
        assert np.array_equal(got.weights, weights), f"{rows} rows"
        grouped = (got.chosen, got.starts, got.order)
        for want, have in zip(experts.group(chosen), grouped, strict=True):
            assert np.array_equal(want, have)
