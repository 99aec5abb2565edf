"""Float16 KV caches on the CPU (``--kv-dtype f16``, the default with ``--dtype q8``).

Keys and values are rounded to float16 as they are written (to nearest, ties to even:
NumPy's conversion and the kernels' give the same bits) and widened to float32 as the
attention kernels read them; the scores, softmax and weighted sums stay float32. So f16
attention is float32 attention over rounded keys and values: within ``F16_ATOL`` of the
float32 caches' (outputs of order 1 here), while everything that is exact within one KV
dtype stays exact (a window's rows, batched rows, threads, split stages:
``test_cpu_attention`` runs its exactness tests over both dtypes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.sources import open_source
from numba import njit

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.attention import KERNEL_MAX_ROWS, KernelAttention, Segment
from meshnode.engine.backend import CpuBackend
from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.attention import kv_kind
from meshnode.engine.cpu.pool import CoreGauge, KernelPool
from meshnode.engine.cpu.simd import wload, wstore
from meshnode.engine.cpu.simd_kv import wload_kv, wstore_kv
from meshnode.engine.kv_cache import KVCache, kv_bytes, kv_numpy_dtype, resolve_kv_dtype
from meshnode.engine.model import BatchRow
from tests.engine.test_cpu_attention import LAYERS, SHAPES, Shape, Twin, _config, _norms, _qkv

# Float16 keeps 11 significant bits: a key or value moves by up to 2**-12 of itself, a
# score by about that times |q||k|; measured on these shapes (outputs up to ~3.4): at
# most 1.3e-3 from the float32 caches' outputs.
F16_ATOL = 4e-3
CONTEXT = 48


@njit(cache=False)
def _through_kernel(x, cache, out):  # type: ignore[no-untyped-def]
    for i in range(0, x.shape[0], 16):
        wstore_kv(cache, i, wload(x, i))
    for i in range(0, x.shape[0], 16):
        wstore(out, i, wload_kv(cache, i))


def test_the_kernels_round_keys_and_values_as_numpy_does() -> None:
    """The kernels' float32 -> float16 stores give NumPy's bits (round to nearest, ties to
    even; subnormals; inf past 65504; NaN stays NaN) and their loads widen them exactly."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(8192) * np.exp(rng.uniform(-20, 12, 8192))).astype(np.float32)
    halfway = float(np.float32(1 + 2**-11))  # a tie between two float16 neighbours: rounds to 1
    edges: list[float] = [
        65504,
        65520,
        65519,
        -70000,
        6e-8,
        3e-8,
        1e-9,
        -0.0,
        halfway,
        np.inf,
        np.nan,
    ]
    x[: len(edges)] = edges
    bits = np.zeros(x.shape, np.uint16)
    out = np.zeros_like(x)
    _through_kernel(x, bits, out)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(bits[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(bits.view(np.float16)[nan]).all()
    assert np.isnan(out[nan]).all()
    np.testing.assert_array_equal(out[~nan], want.astype(np.float32)[~nan])
    assert bits.view(np.float16)[len(edges) - 3] == 1.0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_f16_attention_is_within_tolerance_of_f32(
    shape: Shape, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefills (through the kernel and through BLAS), then one batch of a decode row, a
    verify window, a window longer than a pass of rows and a decode row at ~200 positions
    (grouped queries, QK-norm, sliding windows; one thread or shared with the pool's):
    float16 caches give the float32 caches' outputs within F16_ATOL, and not the same
    bits (the caches do hold float16)."""
    if threads > 1:
        pool = KernelPool(CoreGauge(Path("/nonexistent/stat"), cpus=set(range(4))))
        monkeypatch.setattr(matrix, "_pool", lambda: pool)
    monkeypatch.setattr(matrix, "_threads", threads)
    c = _config(shape)
    rng = np.random.default_rng(31)
    norms = _norms(c, shape.qk_norm, rng)
    lengths = [12, KERNEL_MAX_ROWS + 9, 3, 200]
    prompts = [_qkv(c, n, rng) for n in lengths]
    steps = [_qkv(c, n, rng) for n in (1, 5, KERNEL_MAX_ROWS, 1)]
    outs = []
    for dtype in (np.float32, np.float16):
        twin = Twin(c, len(lengths), dtype)
        twin.run([(i, 0, n) for i, n in enumerate(lengths)], prompts, norms)
        parts = [(i, n, len(s)) for i, (n, s) in enumerate(zip(lengths, steps, strict=True))]
        outs.append(twin.run(parts, steps, norms, last=True)[0])
        assert twin.caches[0][0].k.dtype == dtype
    np.testing.assert_allclose(outs[1], outs[0], atol=F16_ATOL)
    assert not np.array_equal(outs[1], outs[0])


def test_a_batch_mixing_kv_dtypes_is_refused() -> None:
    c = _config(SHAPES[0])
    attn = KernelAttention(np, c, 0, LAYERS)
    caches = [KVCache(np, LAYERS, c.num_kv_heads, c.head_dim, 8, dtype=d) for d in KV_BOTH]
    with pytest.raises(ValueError, match="mixes KV caches"):
        attn.prepare([Segment(0, 1, 1, cache) for cache in caches])
    with pytest.raises(ValueError, match="float32 or float16"):
        kv_kind(np.float64)


KV_BOTH = (np.float32, np.float16)


def test_kv_dtype_names() -> None:
    """``auto`` is f16 for q8 only (the exact modes keep float32 for golden parity);
    f32/f16 are taken as given; anything else is refused."""
    assert [resolve_kv_dtype("auto", w) for w in ("q8", "native", "float32", "auto")] == [
        "f16",
        "f32",
        "f32",
        "f32",
    ]
    assert resolve_kv_dtype("f16", "native") == "f16"
    assert resolve_kv_dtype("f32", "q8") == "f32"
    with pytest.raises(ValueError, match="auto, f32, f16"):
        resolve_kv_dtype("bf16", "q8")
    with pytest.raises(ValueError, match="f32 or f16"):
        kv_numpy_dtype("auto")
    assert (kv_bytes("f32"), kv_bytes("f16")) == (4, 2)


def _stage(source: object, config: ModelConfig, start: int, end: int, kv: str) -> Stage:
    return Stage(
        config, source, start, end,  # type: ignore[arg-type]
        embed=start == 0, head=end == config.num_layers,
        backend=CpuBackend(weights_dtype="q8"), kv_dtype=kv,
    )  # fmt: skip


def _greedy(stages: list[Stage], prompt: list[int], steps: int) -> list[np.ndarray]:
    """Last-row logits of a greedy run through ``stages`` in turn (one cache each)."""
    caches = [s.new_cache(CONTEXT) for s in stages]

    def forward(x: np.ndarray, pos: int) -> np.ndarray:
        for s, cache in zip(stages, caches, strict=True):
            x = s.forward(x, pos, cache, out_rows=1)
        return np.asarray(x[-1])

    logits = [forward(np.array(prompt), 0)]
    for i in range(steps - 1):
        logits.append(forward(np.array([int(np.argmax(logits[-1]))]), len(prompt) + i))
    return logits


def test_a_q8_model_keeps_f16_caches_and_its_batched_streams_are_each_alone(
    tiny_gguf: Callable[[str], Path],
) -> None:
    """A q8 stage's caches are float16 by default (``auto``), half a float32 cache's bytes;
    prefills and greedy decodes of four sequences batched give each the logits it gets
    alone, bit for bit; its caches hold float16 and its tokens are not the f32 caches'
    logits (it is a different mode) but close to them."""
    source = open_source(tiny_gguf("Q4_K"))
    config = ModelConfig.from_hf(source.config)
    stage = _stage(source, config, 0, config.num_layers, "auto")
    exact_kv = _stage(source, config, 0, config.num_layers, "f32")
    assert (stage.kv_dtype, exact_kv.kv_dtype) == ("f16", "f32")
    assert stage.new_cache(CONTEXT).k.dtype == np.float16
    assert stage.new_cache(CONTEXT).nbytes() * 2 == exact_kv.new_cache(CONTEXT).nbytes()
    prompts = [[1, 60, 61, 62, 259], [70, 19], [20, 223, 89, 90, 91, 92, 260, 5, 6], [33]]
    solo = [_greedy([stage], p, 4) for p in prompts]
    caches = [stage.new_cache(CONTEXT) for _ in prompts]
    rows = [BatchRow(np.array(p), 0, c, 1) for p, c in zip(prompts, caches, strict=True)]
    batched = [[o[-1]] for o in stage.forward_batch(rows)]
    for _ in range(3):
        rows = [
            BatchRow(np.array([int(np.argmax(b[-1]))]), c.length, c, 1)
            for b, c in zip(batched, caches, strict=True)
        ]
        for b, o in zip(batched, stage.forward_batch(rows), strict=True):
            b.append(o[-1])
    for want, got in zip(solo, batched, strict=True):
        np.testing.assert_array_equal(np.array(got), np.array(want))
    f32 = _greedy([exact_kv], prompts[2], 4)
    assert not np.array_equal(np.array(f32), np.array(solo[2]))
    np.testing.assert_allclose(np.array(f32), np.array(solo[2]), atol=0.05)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_two_stages_are_one_stage_bit_for_bit(tiny_gguf: Callable[[str], Path], kv: str) -> None:
    """A model split into two stages (each with its own caches of the run's KV dtype)
    gives the logits of one stage holding every layer, bit for bit, through a prefill,
    decode steps and a verify window that rolls back."""
    source = open_source(tiny_gguf("Q4_K"))
    config = ModelConfig.from_hf(source.config)
    whole = [_stage(source, config, 0, config.num_layers, kv)]
    split = [_stage(source, config, 0, 1, kv), _stage(source, config, 1, config.num_layers, kv)]
    assert all(s.new_cache(4).k.dtype == kv_numpy_dtype(kv) for s in whole + split)
    prompt = [20, 223, 89, 90, 91, 92, 260, 5, 6]
    np.testing.assert_array_equal(np.array(_greedy(split, prompt, 5)), _greedy(whole, prompt, 5))
    outs = []
    for stages in (whole, split):
        caches = [s.new_cache(CONTEXT) for s in stages]
        x: np.ndarray = np.array(prompt)
        for s, cache in zip(stages, caches, strict=True):
            x = s.forward(x, 0, cache)
        x = np.array([7, 8, 9, 10])
        for s, cache in zip(stages, caches, strict=True):
            x = s.forward(x, 4, cache)  # rolls back past the prompt's last five rows
        outs.append(x)
    np.testing.assert_array_equal(outs[1], outs[0])


def _resident_kib(arrays: list[np.ndarray]) -> int:
    """Resident KiB of the distinct mappings holding ``arrays`` (the kernel may merge
    neighbouring anonymous mappings: each is counted once)."""
    spans, total, counting = [a.ctypes.data for a in arrays], 0, False
    seen: set[str] = set()
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            counting = head not in seen and any(lo <= at < hi for at in spans)
            seen.add(head)
        elif counting and head == "Rss:":
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_a_float16_cache_holds_half_the_memory_of_a_float32_one() -> None:
    """SmolLM2's cache at 2048 positions, 512 positions written in every layer: a float16
    cache allocates and holds (its resident pages grow by) half of what a float32 one
    does, and hands them back when released."""
    grew = {}
    for dtype in (np.float32, np.float16):
        cache = KVCache(np, 30, 3, 64, 2048, dtype=dtype)
        before = _resident_kib([cache.k, cache.v])
        kv = np.ones((3, 512, 64), np.float32)
        for layer in range(30):
            keys, _ = cache.write(layer, 0, kv, kv)
            assert keys.dtype == np.float32  # handed back widened
        grew[dtype] = _resident_kib([cache.k, cache.v]) - before
        assert cache.nbytes() == 2 * 30 * 3 * 2048 * 64 * np.dtype(dtype).itemsize
        cache.release_pages()
        assert _resident_kib([cache.k, cache.v]) - before < 1 << 10
    assert grew[np.float32] >= 22 << 10  # 2 x 30 x 3 x 512 x 64 x 4 bytes = 22.5 MiB
    assert abs(2 * grew[np.float16] - grew[np.float32]) <= 512, grew
