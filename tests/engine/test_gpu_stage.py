"""The CUDA stage against the NumPy stage, on a device (skipped without one).

- float32 mode reproduces the golden greedy tokens of SmolLM2 exactly;
- float16/bfloat16 weights give logits within 3 % of the logits' spread (max abs
  difference / std of the NumPy logits; 8 % where float16 weights are rounded to
  bfloat16's 8 significant bits) and the same greedy token on the tiny model;
- graph replay equals eager launches exactly (same kernels, same order);
- verify windows, out_rows and truncate-then-redo behave as on the CPU;
- a batch of sequences (decode rows, a verify window, a short prompt) gives each exactly
  what it gets alone, captured and replayed; batched greedy decoding of the golden
  prompts reproduces their tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from meshnode_packaging.sources import ModelSource, open_source

from meshnode.cli.generate import GenerateConfig, complete
from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import cpu_backend
from meshnode.engine.loader import load_model
from meshnode.engine.sampling import SamplingParams
from tests.conftest import smollm2_gguf_path
from tests.engine.test_gpu_kernels import cuda_backend
from tests.engine.test_ops_cuda_batch import MIXED, Seq, batched_greedy, run_sequences

pytestmark = pytest.mark.gpu

IDS = [1, 60, 61, 62, 259, 70, 19, 20, 223, 89, 90, 91, 92, 260]


def _stages(source: ModelSource, dtype: str, *, graphs: bool = True) -> tuple[Stage, Stage]:
    """(NumPy stage, CUDA stage) over the whole model."""
    c = ModelConfig.from_hf(source.config)
    gpu = cuda_backend(dtype, cuda_graphs=graphs)
    cpu = Stage(c, source, 0, c.num_layers, embed=True, head=True)
    return cpu, Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=gpu)


def _host(stage: Stage, a: Any) -> np.ndarray:
    return stage.backend.to_numpy(a)


def _spread_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / want.std())


@pytest.mark.real_model
def test_float32_mode_reproduces_the_golden_greedy_tokens(golden: dict[str, Any]) -> None:
    model = load_model(str(smollm2_gguf_path()), cuda_backend("float32"))
    for prompt in golden["prompts"]:
        config = GenerateConfig(
            prompt=prompt["prompt_text"],
            raw=True,
            max_tokens=golden["generation"]["max_new_tokens"],
            sampling=SamplingParams(temperature=0.0),
        )
        result = complete(model, config, None)
        expected = [t for t in prompt["gen_ids"] if t != golden["generation"]["eos_token_id"]]
        assert result.token_ids == expected, prompt["id"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "F16"])
def test_logits_match_numpy(tiny_gguf: Callable[[str], Path], dtype: str, qtype: str) -> None:
    cpu, gpu = _stages(open_source(tiny_gguf(qtype)), dtype)
    limit = 1e-4 if dtype == "float32" else 8e-2 if (dtype, qtype) == ("bfloat16", "F16") else 3e-2
    want = cpu.forward(np.array(IDS), 0, cpu.new_cache(64))
    cache = gpu.new_cache(64)
    got = _host(gpu, gpu.forward(np.array(IDS), 0, cache))  # 14 rows: the matvec path
    assert _spread_error(got, want) < limit
    steps = []
    for i, t in enumerate([77, 78, 79]):  # decode steps: the graph path from the 2nd on
        steps.append(_host(gpu, gpu.forward(np.array([t]), len(IDS) + i, cache))[0])
    cpu_cache = cpu.new_cache(64)
    ref = cpu.forward(np.array([*IDS, 77, 78, 79]), 0, cpu_cache)[-3:]
    assert _spread_error(np.stack(steps), ref) < limit
    if limit < 8e-2:  # bfloat16-rounded float16 weights may swap near-tied top tokens
        assert [int(s.argmax()) for s in steps] == [int(r.argmax()) for r in ref]


def test_quantized_weights_stay_quantized(tiny_gguf: Callable[[str], Path]) -> None:
    source = open_source(tiny_gguf("Q4_K"))
    _, gpu = _stages(source, "float16")
    layer = gpu.weights.layers[0]
    assert {layer.wqkv.fmt, layer.w_gate_up.fmt, layer.w_down.fmt} == {"q4_k"}
    _, dense = _stages(source, "float32")
    assert layer.nbytes() * 3 < dense.weights.layers[0].nbytes()


def test_prefill_matmul_path_matches_numpy(tiny_gguf: Callable[[str], Path]) -> None:
    cpu, gpu = _stages(open_source(tiny_gguf("Q8_0")), "float16")
    ids = np.array((IDS * 4)[:40])  # more rows than the matvec takes
    want = cpu.forward(ids, 0, cpu.new_cache(64))
    got = _host(gpu, gpu.forward(ids, 0, gpu.new_cache(64)))
    assert _spread_error(got, want) < 3e-2


def test_graph_replay_equals_eager(tiny_gguf: Callable[[str], Path]) -> None:
    source = open_source(tiny_gguf("Q8_0"))
    _, graphs = _stages(source, "float16", graphs=True)
    _, eager = _stages(source, "float16", graphs=False)
    outs = []
    for stage in (graphs, eager):
        cache = stage.new_cache(64)
        stage.forward(np.array(IDS), 0, cache)
        outs.append(
            [
                _host(stage, stage.forward(np.array([t]), 14 + i, cache))
                for i, t in enumerate(range(5))
            ]
        )
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_verify_window_out_rows_and_redo(tiny_gguf: Callable[[str], Path]) -> None:
    _, gpu = _stages(open_source(tiny_gguf("Q8_0")), "float32")
    cache = gpu.new_cache(64)
    full = _host(gpu, gpu.forward(np.array(IDS), 0, cache))
    window = _host(gpu, gpu.forward(np.array(IDS[8:]), 8, cache, out_rows=2))
    np.testing.assert_allclose(window, full[-2:], rtol=1e-4, atol=1e-4)
    gpu.forward(np.array([5, 6, 7]), len(IDS), cache)  # a draft that gets rejected
    redo = _host(gpu, gpu.forward(np.array(IDS[10:]), 10, cache))
    np.testing.assert_allclose(redo, full[10:], rtol=1e-4, atol=1e-4)
    assert cache.length == len(IDS)
    with pytest.raises(ValueError, match="KV cache full"):
        gpu.forward(np.arange(60), 10, cache)


def test_split_stages_chain_on_the_device(tiny_gguf: Callable[[str], Path]) -> None:
    source = open_source(tiny_gguf("Q8_0"))
    c = ModelConfig.from_hf(source.config)
    gpu = cuda_backend("float32")
    whole = Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=gpu)
    first = Stage(c, source, 0, 1, embed=True, head=False, backend=gpu)
    second = Stage(c, source, 1, c.num_layers, embed=False, head=True, backend=gpu)
    want = _host(whole, whole.forward(np.array(IDS), 0, whole.new_cache(32)))
    hidden = gpu.to_numpy(first.forward(np.array(IDS), 0, first.new_cache(32)))
    got = _host(second, second.forward(hidden, 0, second.new_cache(32)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_forward_waits_for_work_queued_on_the_default_stream(
    tiny_gguf: Callable[[str], Path],
) -> None:
    """Rows written on the legacy default stream behind a backlog, as a load's uploads and
    zeroed buffers are, are what the stage's forward reads: it waits for that stream first
    (the first H200 run's first forward read a step table still being zeroed)."""
    source = open_source(tiny_gguf("Q8_0"))
    c = ModelConfig.from_hf(source.config)
    gpu = cuda_backend("float32")
    cp = gpu.xp
    second = Stage(c, source, 1, c.num_layers, embed=False, head=True, backend=gpu)
    hidden = np.random.default_rng(5).standard_normal((4, c.hidden_size)).astype(np.float32)
    want = _host(second, second.forward(hidden, 0, second.new_cache(32)))
    ready = cp.asarray(hidden)
    rows = cp.zeros_like(ready)
    busy = cp.empty(1 << 28, cp.uint8)
    cp.cuda.Device().synchronize()
    with cp.cuda.Stream.null:
        for _ in range(100):  # milliseconds of memsets queued ahead of the rows' copy
            busy.fill(1)
        cp.copyto(rows, ready)
    got = _host(second, second.forward(rows, 0, second.new_cache(32)))
    np.testing.assert_array_equal(got, want)


def test_backend_reports_device_and_memory() -> None:
    gpu = cuda_backend("float16")
    assert gpu.describe().startswith("cuda:")
    free = gpu.free_memory()
    assert free is not None
    assert free > 0
    assert cpu_backend().free_memory() is None


def test_cuda_node_offers_device_memory_and_kv_is_allocated_up_front(
    tiny_gguf: Callable[[str], Path],
) -> None:
    from meshnode.node.config import NodeConfig
    from meshnode.node.daemon import usable_memory

    free = cuda_backend().free_memory()
    assert free is not None
    assert abs(usable_memory(NodeConfig(device="cuda")) - free) < free // 10
    _, gpu = _stages(open_source(tiny_gguf("Q8_0")), "float16")
    c = gpu.config
    cache = gpu.new_cache(4096)
    # float16 K and V for every position of every layer, before any token is written.
    assert cache.nbytes() == 2 * c.num_layers * c.num_kv_heads * 4096 * c.head_dim * 2
    assert cache.k.dtype == gpu.backend.xp.uint16


OTHERS: list[Seq] = [  # the same shape (14 rows, 6 out) over other sequences
    (IDS[:2], 2, [40], 1),
    (IDS[:7], 7, [41], 1),
    (IDS[:4], 4, [42, 43, 44], 3),
    ([], 0, IDS[3:12], 1),
]


def _batch(stage: Stage, seqs: list[Seq], *, batched: bool) -> list[tuple[np.ndarray, Any]]:
    """(host output, cache) of each sequence, run as ``test_ops_cuda_batch`` runs them."""
    return [(_host(stage, o), c) for o, c in run_sequences(stage, seqs, batched=batched)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_batch_equals_each_sequence_alone(tiny_gguf: Callable[[str], Path], dtype: str) -> None:
    """Decode rows, a verify window that rolls back and a short prompt in one forward,
    captured then replayed for other sequences: outputs and caches (float32 and float16
    K/V) are bit for bit each sequence's own, run alone without graphs."""
    source = open_source(tiny_gguf("Q8_0"))
    _, graphs = _stages(source, dtype, graphs=True)
    _, eager = _stages(source, dtype, graphs=False)
    for seqs in (MIXED, OTHERS, MIXED):  # eager + capture, then replays
        got, want = _batch(graphs, seqs, batched=True), _batch(eager, seqs, batched=False)
        assert [o.shape[0] for o, _ in got] == [1, 1, 3, 1]
        for (out, cache), (want_out, want_cache) in zip(got, want, strict=True):
            np.testing.assert_array_equal(out, want_out)
            assert cache.length == want_cache.length
            np.testing.assert_array_equal(cache.k.get(), want_cache.k.get())
            np.testing.assert_array_equal(cache.v.get(), want_cache.v.get())
    assert graphs.replay_seconds(1, 1) is None  # no one-row decode shape here
    assert (14, 6, 6) in graphs._runner._graphs  # type: ignore[attr-defined]


@pytest.mark.real_model
def test_batched_greedy_decoding_reproduces_the_golden_tokens(golden: dict[str, Any]) -> None:
    """float32 mode: the reference prompts decoded together, one batched forward a step."""
    source = open_source(str(smollm2_gguf_path()))
    c = ModelConfig.from_hf(source.config)
    stage = Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=cuda_backend())
    eos = golden["generation"]["eos_token_id"]
    for prompt, got in zip(golden["prompts"], batched_greedy(stage, golden), strict=True):
        assert got == [t for t in prompt["gen_ids"] if t != eos], prompt["id"]
