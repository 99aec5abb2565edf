"""The CUDA backend's forward, run without a GPU.

``model.Stage`` on a ``CudaBackend`` is driven with host arrays standing in for CuPy
arrays and with each kernel replaced by its NumPy reference (the kernels themselves are
checked against the same references in ``test_ops_emulated.py``). This checks what lies
between the kernels: weight formats chosen at load, the operations of the one block on
the device (``cuda.ops``: the residual add fused into the next norm, QK-norm, sandwich
norms, GeGLU, scaled embeddings, sliding windows), ``out_rows``, the step array
(positions and the cache read through its addresses and block table), the float16 KV
cache, the prefill
matmul path and the fallback when graph capture fails; and that every family of the
architecture table runs there. What it cannot check is CuPy itself: streams, graphs,
pinned memory (``tests/engine/test_gpu_stage.py`` does, on a device).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage, ops
from meshnode.engine.backend import CudaBackend
from meshnode.engine.cuda import formats, graphs
from meshnode.engine.cuda import ops as cuda_ops
from meshnode.engine.cuda.device import DeviceMatrix
from meshnode.engine.kv_cache import KV_BLOCK
from tests.engine.tiny import write_tiny_model

IDS = [1, 60, 61, 62, 259, 70, 19, 20, 223, 89, 90, 91, 92, 260]


class HostArray(np.ndarray):
    """A NumPy array with the three CuPy array methods the stage uses."""

    def set(self, host: np.ndarray, stream: Any = None) -> None:
        """As CuPy's: a whole contiguous array from a host array of its shape and dtype."""
        assert isinstance(host, np.ndarray)
        assert (self.shape, self.dtype) == (host.shape, host.dtype), (self.shape, host.shape)
        assert self.flags.c_contiguous
        self[...] = host

    def get(self) -> np.ndarray:
        return np.array(self)

    @property
    def data(self) -> Any:
        return SimpleNamespace(ptr=self.ctypes.data)


def _host(fn: Callable[..., np.ndarray]) -> Callable[..., HostArray]:
    def make(*args: Any, **kwargs: Any) -> HostArray:
        return np.asarray(fn(*args, **kwargs)).view(HostArray)

    return make


class Stream:
    """Runs everything at once; refuses capture (so the stage must fall back). ``null``:
    the legacy default stream."""

    null: ClassVar[Stream]

    def __init__(self, non_blocking: bool = False) -> None:
        pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def begin_capture(self) -> None:
        raise RuntimeError("no graph capture on the host")


Stream.null = Stream()


class MemoryPool:
    def malloc(self, size: int) -> None:
        raise AssertionError("the host arrays allocate themselves")


FAKE_CP = SimpleNamespace(
    asarray=_host(np.asarray),
    ascontiguousarray=_host(np.ascontiguousarray),
    concatenate=_host(np.concatenate),
    zeros=_host(np.zeros),
    empty=_host(np.empty),
    empty_like=_host(np.empty_like),
    add=np.add,
    multiply=np.multiply,
    copyto=np.copyto,
    matmul=np.matmul,
    float32=np.float32,
    float16=np.float16,
    int32=np.int32,
    int64=np.int64,
    uint16=np.uint16,
    get_default_memory_pool=MemoryPool,
    cuda=SimpleNamespace(
        Stream=Stream,
        MemoryPool=MemoryPool,
        get_current_stream=Stream,
        using_allocator=lambda allocator: contextlib.nullcontext(),
    ),
)


def _decoded(w: DeviceMatrix) -> np.ndarray:
    raw = np.asarray(w.data).view(np.uint8).reshape(w.out_features, -1)
    return formats.decode_units(raw, w.fmt, w.in_features)


class ReferenceKernels:
    """``device.Kernels`` with each kernel computed by its NumPy reference."""

    def __init__(self) -> None:
        # each weight decoded once (a real model's forwards would decode it per product)
        self._decoded: dict[int, tuple[DeviceMatrix, np.ndarray]] = {}

    def _value(self, w: DeviceMatrix) -> np.ndarray:
        held = self._decoded.get(id(w))
        if held is None:
            held = self._decoded[id(w)] = (w, _decoded(w))  # w kept: its id stays its own
        return held[1]

    def warm_up(self) -> None:
        return None

    def rms_norm(self, x: Any, w: Any, y: Any, eps: float) -> None:
        y[...] = ops.rms_norm(np, x, w, eps)

    def add_rms_norm(self, x: Any, h: Any, w: Any, y: Any, eps: float) -> None:
        x[...], y[...] = ops.add_rms_norm(np, x, h, w, eps)

    def silu_mul(self, gate_up: Any, out: Any) -> None:
        out[...] = ops.silu_mul(np, gate_up)

    def gelu_tanh_mul(self, gate_up: Any, out: Any) -> None:
        out[...] = ops.gelu_tanh_mul(np, gate_up)

    def qk_norm(self, qkv: Any, q_w: Any, k_w: Any, heads: int, kv_heads: int, eps: float) -> None:
        """Each query head with ``q_w``, each key head with ``k_w``, in place."""
        dim = qkv.shape[1] // (heads + 2 * kv_heads)
        for h in range(heads + kv_heads):
            part = qkv[:, h * dim : (h + 1) * dim]
            part[...] = ops.rms_norm(np, part, q_w if h < heads else k_w, eps)

    @staticmethod
    def _cache(address: int, layer: int, shape: tuple[int, int, int], kv: str) -> np.ndarray:
        """Layer ``layer`` of the cache at ``address``, as the kernels address it."""
        dtype = np.dtype(np.float32 if kv == "float" else np.float16)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buf = (ctypes.c_uint8 * nbytes).from_address(address + layer * nbytes)
        return np.ctypeslib.as_array(buf).view(dtype).reshape(shape)

    def _caches(self, row: Any, layer: int, shape: tuple[int, int], kv: str) -> Any:
        """(position, K cache, V cache, the cache row of each position up to it) of one
        row of the step table: positions through its block table, as ``kernels.kv_row``."""
        pos, cap, k_at, v_at, _, table_at = (int(v) for v in row[:6])
        full = (shape[0], cap, shape[1])
        blocks = pos // KV_BLOCK + 1
        table = np.ctypeslib.as_array((ctypes.c_int64 * blocks).from_address(table_at))
        upto = np.arange(pos + 1)
        rows = table[upto // KV_BLOCK] * KV_BLOCK + upto % KV_BLOCK
        k_cache, v_cache = self._cache(k_at, layer, full, kv), self._cache(v_at, layer, full, kv)
        return pos, k_cache, v_cache, rows

    def gather_rows(self, x: Any, step: Any, out: Any) -> None:
        out[...] = x[np.asarray(step)[: out.shape[0], 4]]

    def rope_store(
        self, qkv: Any, inv: Any, step: Any, layer: int, heads: int, kv_heads: int, kv: str
    ) -> None:
        """Row by row, each at its position into its own cache (as the kernel does)."""
        dim = qkv.shape[1] // (heads + 2 * kv_heads)
        for r in range(qkv.shape[0]):
            pos, k_cache, v_cache, at = self._caches(step[r], layer, (kv_heads, dim), kv)
            cos, sin = ops.rope_cos_sin(np, inv, pos, 1)
            q = qkv[r, : heads * dim].reshape(heads, 1, dim)
            qkv[r, : heads * dim] = ops.rotate_half(np, q, cos, sin).reshape(-1)
            k = qkv[r, heads * dim : (heads + kv_heads) * dim].reshape(kv_heads, 1, dim)
            k_cache[:, at[pos]] = ops.rotate_half(np, k, cos, sin)[:, 0]
            v_cache[:, at[pos]] = qkv[r, (heads + kv_heads) * dim :].reshape(kv_heads, dim)

    def attention(
        self,
        qkv: Any,
        out: Any,
        step: Any,
        layer: int,
        heads: int,
        kv_heads: int,
        scale: float,
        kv: str,
        window: int = 0,
    ) -> None:
        """Output row by output row (one query each, as the kernel's blocks)."""
        n, rows = qkv.shape[0], out.shape[0]
        dim = qkv.shape[1] // (heads + 2 * kv_heads)
        for i in range(rows):
            q_row = i if rows == n else int(step[i, 4])
            _, k_cache, v_cache, at = self._caches(step[q_row], layer, (kv_heads, dim), kv)
            keys = k_cache[:, at].astype(np.float32)  # [Hkv, T, D], in position order
            values = v_cache[:, at].astype(np.float32)
            q = np.ascontiguousarray(qkv[q_row, : heads * dim].reshape(heads, 1, dim))
            attended = ops.attention(np, q, keys, values, scale, window or None)
            out[i] = attended.reshape(-1)

    def gemv(self, w: DeviceMatrix, x: Any, y: Any) -> None:
        """Row by row: the kernel's sum for a row does not depend on the other rows."""
        value = self._value(w)
        for r in range(x.shape[0]):
            y[r] = value @ np.asarray(x[r])

    def embed(self, table: DeviceMatrix, ids: Any, x: Any) -> None:
        x[...] = self._value(table)[np.asarray(ids)]

    def dequantize(self, w: DeviceMatrix, dtype: Any) -> Any:
        return _decoded(w).astype(dtype).view(HostArray)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_ops, "kernels_for", lambda cp: ReferenceKernels())
    monkeypatch.setitem(sys.modules, "cupyx", SimpleNamespace(empty_pinned=_host(np.empty)))


def _stages(
    tiny_gguf: Callable[[str], Path], qtype: str, dtype: str, *, split: int | None = None
) -> tuple[Stage, list[Stage]]:
    """The NumPy stage and the host-run CUDA stage(s) (two when ``split``)."""
    source = open_source(tiny_gguf(qtype))
    c = ModelConfig.from_hf(source.config)
    backend = CudaBackend(FAKE_CP, dtype, cuda_graphs=True)  # type: ignore[arg-type]
    cpu = Stage(c, source, 0, c.num_layers, embed=True, head=True)
    if split is None:
        return cpu, [Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=backend)]
    first = Stage(c, source, 0, split, embed=True, head=False, backend=backend)
    return cpu, [
        first,
        Stage(c, source, split, c.num_layers, embed=False, head=True, backend=backend),
    ]


def test_a_forward_first_waits_for_the_default_stream(tiny_gguf: Callable[[str], Path]) -> None:
    """Each forward synchronizes the legacy default stream before it enters the stage's own
    (non-blocking) stream: the weights' uploads and the fixed buffers' zeroing queued there
    must be done (on an H200 the step table's memset landed in a first forward)."""
    order: list[str] = []

    class StageStream(Stream):
        def __enter__(self) -> Stream:
            order.append("stage stream")
            return self

    class DefaultStream(Stream):
        def synchronize(self) -> None:
            order.append("default stream synchronized")

    StageStream.null = DefaultStream()
    cuda = SimpleNamespace(**{**vars(FAKE_CP.cuda), "Stream": StageStream})
    cp = SimpleNamespace(**{**vars(FAKE_CP), "cuda": cuda})
    source = open_source(tiny_gguf("Q8_0"))
    c = ModelConfig.from_hf(source.config)
    backend = CudaBackend(cp, "float32")  # type: ignore[arg-type]
    stage = Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=backend)
    cache = stage.new_cache(32)
    for start, ids in ((0, IDS[:5]), (5, IDS[5:6])):  # a prompt, then a decode step
        order.clear()
        stage.forward(np.array(ids), start, cache)
        assert order[:2] == ["default stream synchronized", "stage stream"]


def _spread_error(got: Any, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got) - want).max() / want.std())


@pytest.mark.parametrize(
    ("qtype", "dtype", "fmt", "limit"),
    [
        ("Q8_0", "float32", "f32", 1e-5),
        ("Q8_0", "float16", "q8_0", 2e-2),
        ("Q4_K", "bfloat16", "q4_k", 2e-2),
        # bfloat16 keeps 8 of float16's 11 significant bits: ~2^-9 per weight, not 2^-12.
        ("F16", "bfloat16", "bf16", 8e-2),
    ],
)
def test_prefill_decode_verify_and_long_prefill_match_numpy(
    tiny_gguf: Callable[[str], Path],
    caplog: pytest.LogCaptureFixture,
    qtype: str,
    dtype: str,
    fmt: str,
    limit: float,
) -> None:
    cpu, (gpu,) = _stages(tiny_gguf, qtype, dtype)
    assert gpu.weights.layers[0].wqkv.fmt == fmt
    ids = [*IDS, 77, 78, 79, 80, 81]
    want = cpu.forward(np.array(ids), 0, cpu.new_cache(64))
    cache = gpu.new_cache(64)
    assert cache.k.dtype == (np.float32 if dtype == "float32" else np.uint16)
    with caplog.at_level(logging.WARNING, logger=graphs.__name__):
        got = [gpu.forward(np.array(IDS), 0, cache, out_rows=2)]  # 14 rows, last 2 out
        got += [gpu.forward(np.array([t]), len(IDS) + i, cache) for i, t in enumerate(ids[14:17])]
        got.append(gpu.forward(np.array(ids[17:]), 17, cache))  # a verify window of 2
    assert [r.message for r in caplog.records] == [
        "CUDA graph capture failed, decoding without graphs: no graph capture on the host"
    ]
    assert _spread_error(np.concatenate(got), want[12:]) < limit
    assert cache.length == len(ids)
    long_ids = np.array((ids * 3)[:40])  # more rows than the matvec takes: the matmul path
    want_long = cpu.forward(long_ids, 0, cpu.new_cache(64))
    assert _spread_error(gpu.forward(long_ids, 0, cache), want_long) < limit


def test_rollback_and_full_cache(tiny_gguf: Callable[[str], Path]) -> None:
    _, (gpu,) = _stages(tiny_gguf, "Q8_0", "float32")
    cache = gpu.new_cache(20)
    full = np.asarray(gpu.forward(np.array(IDS), 0, cache))
    gpu.forward(np.array([5, 6, 7]), len(IDS), cache)  # a draft that gets rejected
    redo = gpu.forward(np.array(IDS[10:]), 10, cache)
    np.testing.assert_allclose(redo, full[10:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="KV cache full: 24 > 20 tokens"):
        gpu.forward(np.arange(10), 14, cache)


def test_split_stages_pass_hidden_states(tiny_gguf: Callable[[str], Path]) -> None:
    cpu, (first, second) = _stages(tiny_gguf, "Q8_0", "float16", split=1)
    want = cpu.forward(np.array(IDS), 0, cpu.new_cache(32))
    hidden = first.backend.to_numpy(first.forward(np.array(IDS), 0, first.new_cache(32)))
    assert hidden.shape == (len(IDS), cpu.config.hidden_size)
    got = second.forward(hidden, 0, second.new_cache(32))
    assert _spread_error(got, want) < 2e-2


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_every_family_runs_on_the_cuda_backend(
    tmp_path_factory: pytest.TempPathFactory, arch: str
) -> None:
    """Qwen 3 (QK-norm) and Gemma 3 (QK-norm, sandwich norms, GeGLU, scaled embeddings,
    sliding windows with their own RoPE base, Gemma's attention scale) through the same
    block on the device's operations: the NumPy stage's logits, in float32 mode, for a
    prompt longer than the window, a decode step and a verify window."""
    source = open_source(write_tiny_model(tmp_path_factory.mktemp(arch), "Q8_0", arch=arch))
    c = ModelConfig.from_hf(source.config)
    backend = CudaBackend(FAKE_CP, "float32")  # type: ignore[arg-type]
    cpu = Stage(c, source, 0, c.num_layers, embed=True, head=True)
    gpu = Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=backend)
    ids = (IDS * 2)[:24]
    want = cpu.forward(np.array(ids), 0, cpu.new_cache(32))
    cache = gpu.new_cache(32)
    got = [gpu.forward(np.array(ids[:20]), 0, cache)]  # a prompt, run alone
    got.append(gpu.forward(np.array(ids[20:21]), 20, cache))
    got.append(gpu.forward(np.array(ids[21:]), 21, cache))
    # float32 rounding of other summation orders (a missing feature is off by ~1)
    assert _spread_error(np.concatenate(got), want) < 5e-5
