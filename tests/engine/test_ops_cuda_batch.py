"""The CUDA stage's batched forward, run without a GPU (as ``test_ops_cuda_stage.py``).

Several sequences' new rows go through one forward: the weight products over all rows,
RoPE, the K/V writes and attention per row from the step table. The kernels' NumPy
references compute row by row as the kernels do, so a batch must give each sequence
exactly what it gets alone: outputs and caches, bit for bit. Graph capture is stood in
for by a recorder that keeps the launches of a capture and runs them again on replay,
so a replayed batch reads only what the stage copies in before it (inputs, step table).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import CudaBackend
from meshnode.engine.cuda import graphs as cuda_graphs
from meshnode.engine.cuda import kernels
from meshnode.engine.cuda import ops as cuda_ops
from meshnode.engine.model import BatchRow
from tests.conftest import smollm2_gguf_path
from tests.engine.test_ops_cuda_stage import (
    FAKE_CP,
    IDS,
    ReferenceKernels,
    Stream,
    _reference_kernels,  # noqa: F401 (the autouse fixture: kernels replaced by references)
    _stages,
)

# (tokens cached before, start position, new tokens, out_rows) of each sequence.
Seq = tuple[list[int], int, list[int], int | None]
MIXED: list[Seq] = [
    (IDS[:5], 5, [77], 1),  # a decode row
    (IDS[:12], 12, [78], 1),  # a decode row over a longer cache
    (IDS[:10], 7, [5, 6, 7], 3),  # a verify window from 7: rolls back 3 positions
    ([], 0, IDS[:9], 1),  # a short prompt
]


def run_sequences(stage: Stage, seqs: list[Seq], *, batched: bool, context: int = 32) -> list[Any]:
    """(output, cache) of each sequence: its prefix cached first, then its new rows
    through one ``forward_batch`` of all of them, or each through ``forward`` alone."""
    caches = [stage.new_cache(context) for _ in seqs]
    for (prefix, _, _, _), cache in zip(seqs, caches, strict=True):
        if prefix:
            stage.forward(np.array(prefix), 0, cache)
    items = [
        BatchRow(np.array(new), start, cache, out)
        for (_, start, new, out), cache in zip(seqs, caches, strict=True)
    ]
    if batched:
        outs = stage.forward_batch(items)
    else:
        outs = [stage.forward(i.inputs, i.start_pos, i.cache, out_rows=i.out_rows) for i in items]
    return list(zip(outs, caches, strict=True))


def batched_greedy(stage: Stage, golden: dict[str, Any]) -> list[list[int]]:
    """Greedy tokens of every golden prompt (end of text dropped): the prompts prefilled
    in one ``forward_batch``, then all decoded together, one batched forward per step,
    each sequence leaving at its end of text."""
    eos, steps = golden["generation"]["eos_token_id"], golden["generation"]["max_new_tokens"]
    prompts = [p["prompt_ids"] for p in golden["prompts"]]
    caches = [stage.new_cache(len(p) + steps + 1) for p in prompts]
    firsts = stage.forward_batch(
        [BatchRow(np.array(p), 0, cache, 1) for p, cache in zip(prompts, caches, strict=True)]
    )
    host = stage.backend.to_numpy
    tokens = [[int(host(o)[-1].argmax())] for o in firsts]
    while live := [i for i, t in enumerate(tokens) if t[-1] != eos and len(t) < steps]:
        rows = [BatchRow(np.array(tokens[i][-1:]), caches[i].length, caches[i], 1) for i in live]
        for i, out in zip(live, stage.forward_batch(rows), strict=True):
            tokens[i].append(int(host(out)[-1].argmax()))
    return [[t for t in got if t != eos] for got in tokens]


def _assert_same(got: list[Any], want: list[Any]) -> None:
    for (out, cache), (want_out, want_cache) in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
        assert cache.length == want_cache.length
        np.testing.assert_array_equal(cache.k, want_cache.k)
        np.testing.assert_array_equal(cache.v, want_cache.v)


@pytest.mark.parametrize(("qtype", "dtype"), [("Q8_0", "float32"), ("Q4_K", "float16")])
def test_a_mixed_batch_equals_each_sequence_alone(
    tiny_gguf: Callable[[str], Path], qtype: str, dtype: str
) -> None:
    """Decode rows over caches of different lengths, a verify window that rolls back and
    a short prompt, in one forward: each output and each cache (float32, and float16 K/V)
    is exactly the sequence's own; output rows as ``out_rows`` asks."""
    cpu, (gpu,) = _stages(tiny_gguf, qtype, dtype)
    batch = run_sequences(gpu, MIXED, batched=True)
    assert [out.shape[0] for out, _ in batch] == [1, 1, 3, 1]
    assert [c.length for _, c in batch] == [6, 13, 10, 9]
    _assert_same(batch, run_sequences(gpu, MIXED, batched=False))
    if dtype == "float32":  # and the NumPy stage's batch agrees within float32 rounding
        want = run_sequences(cpu, MIXED, batched=True)
        for (out, _), (ref, _) in zip(batch, want, strict=True):
            np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)


def test_long_prompts_run_alone_and_big_batches_split(tiny_gguf: Callable[[str], Path]) -> None:
    """A prompt of more than MAX_ROWS rows (the prefill path) beside short ones, and more
    short rows than one forward takes (MAX_BATCH_ROWS): still each sequence's own."""
    _, (gpu,) = _stages(tiny_gguf, "Q8_0", "float32")
    long_prompt = (IDS * 2)[: kernels.MAX_ROWS + 4]
    short: list[Seq] = [([], 0, (IDS * 2)[i : i + 14], None) for i in range(5)]  # 70 rows
    seqs: list[Seq] = [short[0], ([], 0, long_prompt, 2), *short[1:]]
    assert sum(len(new) for _, _, new, _ in short) > kernels.MAX_BATCH_ROWS
    batch = run_sequences(gpu, seqs, batched=True)
    assert [out.shape[0] for out, _ in batch] == [14, 2, 14, 14, 14, 14]
    _assert_same(batch, run_sequences(gpu, seqs, batched=False))
    # the prompt alone, then short rows up to MAX_BATCH_ROWS per forward
    assert cuda_graphs.batch_groups([14, 20, 14, 14, 14, 14]) == [[1], [0, 2, 3, 4], [5]]


def test_split_stages_batch_hidden_rows(tiny_gguf: Callable[[str], Path]) -> None:
    """A first stage (no head: every row out), then a last stage fed host hidden states."""
    _, (first, second) = _stages(tiny_gguf, "Q8_0", "float32", split=1)
    hidden = run_sequences(first, MIXED, batched=True)
    _assert_same(hidden, run_sequences(first, MIXED, batched=False))
    assert [out.shape[0] for out, _ in hidden] == [1, 1, 3, 9]

    def last_stage(batched: bool) -> list[Any]:
        items = []
        for (prefix, start, _, out), (h, _) in zip(MIXED, hidden, strict=True):
            cache = second.new_cache(32)
            if prefix:
                before = first.forward(np.array(prefix), 0, first.new_cache(32))
                second.forward(first.backend.to_numpy(before), 0, cache)
            items.append(BatchRow(first.backend.to_numpy(h), start, cache, out))
        if batched:
            return list(zip(second.forward_batch(items), [i.cache for i in items], strict=True))
        return [(second.forward(i.inputs, i.start_pos, i.cache, out_rows=i.out_rows), i.cache)
                for i in items]  # fmt: skip

    _assert_same(last_stage(True), last_stage(False))


def test_a_batch_refuses_a_shared_cache_or_an_overflow(tiny_gguf: Callable[[str], Path]) -> None:
    _, (gpu,) = _stages(tiny_gguf, "Q8_0", "float32")
    a, b = gpu.new_cache(16), gpu.new_cache(16)
    gpu.forward(np.array(IDS[:6]), 0, a)
    gpu.forward(np.array(IDS[:6]), 0, b)
    with pytest.raises(ValueError, match="names each sequence's cache once"):
        gpu.forward_batch([BatchRow(np.array([1]), 6, a), BatchRow(np.array([2]), 3, a)])
    with pytest.raises(ValueError, match="KV cache full: 17 > 16 tokens"):
        gpu.forward_batch([BatchRow(np.array([1]), 2, a), BatchRow(np.arange(11), 6, b)])
    assert (a.length, b.length) == (6, 6)  # refused before any cache was rolled back


KERNELS = ["rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "qk_norm", "gather_rows"]
KERNELS += ["rope_store", "attention", "gemv", "embed"]


class _Graph:
    """The launches recorded during one capture, run again by ``launch``."""

    def __init__(self, calls: list[Callable[[], Any]]) -> None:
        self.calls, self.launches = calls, 0

    def launch(self, stream: Any = None) -> None:
        self.launches += 1
        for call in self.calls:
            call()


class _Capture:
    """Graph capture on the host: between ``begin_capture`` and ``end_capture`` the
    stage's kernel launches (and CuPy's ``add``, ``multiply``, ``copyto``) are recorded
    instead of run."""

    def __init__(self) -> None:
        self.calls: list[Callable[[], Any]] | None = None
        self.graphs: list[_Graph] = []
        capture = self

        class CapturingStream(Stream):
            def begin_capture(self) -> None:
                capture.calls = []

            def end_capture(self) -> _Graph:
                assert capture.calls is not None
                graph = _Graph(capture.calls)
                capture.calls = None
                capture.graphs.append(graph)
                return graph

        cuda = SimpleNamespace(**{**vars(FAKE_CP.cuda), "Stream": CapturingStream})
        launched = {name: self._launch(getattr(np, name)) for name in ("add", "multiply", "copyto")}
        self.cp = SimpleNamespace(**{**vars(FAKE_CP), **launched, "cuda": cuda})
        reference = ReferenceKernels()
        self.kernels = SimpleNamespace(
            warm_up=reference.warm_up,
            dequantize=reference.dequantize,  # prefill only: never captured
            **{name: self._launch(getattr(reference, name)) for name in KERNELS},
        )

    def _launch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            if self.calls is None:
                return fn(*args, **kwargs)
            self.calls.append(functools.partial(fn, *args, **kwargs))
            return None

        return launch


def test_captured_batch_shapes_replay_for_other_sequences(
    tiny_gguf: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch shape is captured at its first forward and replayed for other sequences at
    other positions, between forwards of other shapes; past MAX_GRAPHS shapes a new one
    stays eager. Every output and cache equals the eager stage's."""
    capture = _Capture()
    monkeypatch.setattr(cuda_ops, "kernels_for", lambda cp: capture.kernels)
    source = open_source(tiny_gguf("Q8_0"))
    c = ModelConfig.from_hf(source.config)
    backend = CudaBackend(capture.cp, "float32", cuda_graphs=True)  # type: ignore[arg-type]
    graphs = Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=backend)
    monkeypatch.setattr(cuda_ops, "kernels_for", lambda cp: ReferenceKernels())
    _, (eager,) = _stages(tiny_gguf, "Q8_0", "float32")
    runner = graphs._runner
    assert isinstance(runner, cuda_graphs.GraphRunner)
    shapes = runner._graphs  # (rows, kept rows, output rows) -> (graph, output buffer)

    def check(seqs: list[Seq]) -> None:
        _assert_same(
            run_sequences(graphs, seqs, batched=True), run_sequences(eager, seqs, batched=True)
        )

    check([(IDS[:2], 2, [40], 1), ([], 0, [41, 42, 43], 1)])  # 4 rows, 2 out: captured
    first = shapes[(4, 2, 2)][0]
    assert first.launches == 0
    check([(IDS[:3], 3, [44, 45], 1), (IDS[:1], 1, [46, 47], 1)])  # other caches: replayed
    assert first.launches == 1
    check(MIXED)  # other shapes (their prefixes cached first) between the replays
    check([([], 0, [52, 53, 54], 1), (IDS[:3], 3, [55], 1)])
    assert shapes[(4, 2, 2)][0] is first
    assert first.launches == 2
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", len(shapes))  # full: new shapes stay eager
    check([(IDS[:2], 2, [56, 57], 1), ([], 0, [58, 59, 60], 1)])  # (5 rows, 2 out)
    assert (5, 2, 2) not in shapes


@pytest.mark.real_model
def test_batched_greedy_decoding_reproduces_the_golden_tokens(golden: dict[str, Any]) -> None:
    """float32 mode, SmolLM2: the reference prompts decoded together through the stage's
    batched forward (reference kernels) give the golden greedy tokens."""
    source = open_source(smollm2_gguf_path())
    c = ModelConfig.from_hf(source.config)
    backend = CudaBackend(FAKE_CP, "float32", cuda_graphs=True)  # type: ignore[arg-type]
    stage = Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=backend)
    eos = golden["generation"]["eos_token_id"]
    for prompt, got in zip(golden["prompts"], batched_greedy(stage, golden), strict=True):
        assert got == [t for t in prompt["gen_ids"] if t != eos], prompt["id"]
