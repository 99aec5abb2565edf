"""The CUDA kernels, checked without a GPU.

1. The source compiles for the device with ``nvcc`` (when it is installed).
2. The same source, compiled with the host C++ compiler under a small emulation of the
   CUDA execution model (each thread block runs its threads as OS threads sharing
   ``__shared__`` arrays, ``__syncthreads`` is a barrier), matches the NumPy references.
   This checks the kernels' index math, reductions and block decoding; it cannot check
   timing, memory coalescing or the PTX half conversions (the emulation's twins use
   ``_Float16``). ``tests/engine/test_gpu_kernels.py`` repeats the comparisons on a device.

Launch geometry here is the one ``meshnode.engine.cuda.device`` uses (``kernels.BLOCK``,
``GEMV_BLOCK``, ``flat_grid``).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnode.engine import ops
from meshnode.engine.cuda import formats, kernels
from tests.engine.tiny import random_blocks

RNG = np.random.default_rng(11)

PRELUDE = r"""
#include <barrier>
#include <cstring>
#include <math.h>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx;
dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* mn_barrier = nullptr;
inline void __syncthreads() { mn_barrier->arrive_and_wait(); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

inline float f16_to_f32(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline unsigned short f32_to_f16(float f) {
    _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h;
}
inline float bits_to_f32(unsigned b) { float f; std::memcpy(&f, &b, 4); return f; }
"""

LAUNCHER = r"""
// Blocks run one after another; the threads of a block run concurrently.
template <typename... A, typename... B>
void launch(void (*k)(A...), unsigned gx, unsigned gy, unsigned bx, B... args) {
    gridDim = {gx, gy, 1};
    blockDim = {bx, 1, 1};
    for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, 0};
        std::barrier<> bar(bx);
        mn_barrier = &bar;
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < bx; ++t)
            threads.emplace_back([=] { threadIdx = {t, 0, 0}; k(args...); });
        for (auto& th : threads) th.join();
    }
}
#define G unsigned gx, unsigned gy, unsigned bx
extern "C" {
void emu_rms_norm(G, const float* x, const float* w, float* y, int n, float eps) {
    launch(rms_norm, gx, gy, bx, x, w, y, n, eps);
}
void emu_add_rms_norm(G, float* x, const float* h, const float* w, float* y, int n, float eps) {
    launch(add_rms_norm, gx, gy, bx, x, h, w, y, n, eps);
}
void emu_softmax(G, float* x, int n) { launch(softmax, gx, gy, bx, x, n); }
void emu_silu_mul(G, const float* gu, float* out, int rows, int inter) {
    launch(silu_mul, gx, gy, bx, gu, out, rows, inter);
}
void emu_gelu_tanh_mul(G, const float* gu, float* out, int rows, int inter) {
    launch(gelu_tanh_mul, gx, gy, bx, gu, out, rows, inter);
}
void emu_qk_norm(G, float* qkv, const float* qw, const float* kw, int heads, int kv_heads,
                 int dim, float eps) {
    launch(qk_norm, gx, gy, bx, qkv, qw, kw, heads, kv_heads, dim, eps);
}
void emu_gather_rows(G, const float* x, const i64* step, float* out, int n) {
    launch(gather_rows, gx, gy, bx, x, step, out, n);
}
"""

TEMPLATED = r"""
void emu_rope_store_{kv}(G, float* qkv, const float* inv, const i64* step, int layer, int n,
                         int heads, int kv_heads, int dim) {{
    launch(rope_store<{kv}>, gx, gy, bx, qkv, inv, step, layer, n, heads, kv_heads, dim);
}}
void emu_attention_{kv}(G, const float* qkv, float* out, const i64* step, int layer, int n,
                        int rows, int heads, int kv_heads, int dim, float scale, int window) {{
    launch(attention<{kv}>, gx, gy, bx, qkv, out, step, layer, n, rows, heads, kv_heads, dim,
           scale, window);
}}
"""

PER_FORMAT = r"""
void emu_gemv_{f}_1(G, const u8* w, const float* x, float* y, int rows, int in, int out) {{
    launch(gemv<{cpp}, 1>, gx, gy, bx, w, x, y, rows, in, out);
}}
void emu_gemv_{f}_4(G, const u8* w, const float* x, float* y, int rows, int in, int out) {{
    launch(gemv<{cpp}, 4>, gx, gy, bx, w, x, y, rows, in, out);
}}
void emu_gemv_{f}_16(G, const u8* w, const float* x, float* y, int rows, int in, int out) {{
    launch(gemv<{cpp}, 16>, gx, gy, bx, w, x, y, rows, in, out);
}}
void emu_embed_{f}(G, const u8* t, const int* ids, float* x, int dim) {{
    launch(embed<{cpp}>, gx, gy, bx, t, ids, x, dim);
}}
void emu_dequantize_{f}_f32(G, const u8* w, float* dst, int in, int out) {{
    launch(dequantize<{cpp}, float>, gx, gy, bx, w, dst, in, out);
}}
void emu_dequantize_{f}_f16(G, const u8* w, u16* dst, int in, int out) {{
    launch(dequantize<{cpp}, u16>, gx, gy, bx, w, dst, in, out);
}}
"""


def _emulation_source() -> str:
    parts = [PRELUDE, kernels.SOURCE, LAUNCHER]
    parts += [TEMPLATED.format(kv=kv) for kv in kernels.KV_TYPES]
    parts += [PER_FORMAT.format(f=f, cpp=cpp) for f, cpp in formats.CPP_NAME.items()]
    return "\n".join([*parts, "}  // extern C\n"])


class Emulator:
    """The kernels as host functions: ``emu(name, grid, block, *args)``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def __call__(self, name: str, grid: tuple[int, int], block: int, *args: Any) -> None:
        fn = getattr(self._lib, "emu_" + name)
        fn.restype = None
        c_args: list[Any] = [ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(block)]
        for a in args:
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous
                c_args.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, float):
                c_args.append(ctypes.c_float(a))
            else:
                c_args.append(ctypes.c_int(int(a)))
        fn(*c_args)


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Emulator:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ to build the kernel emulation")
    folder = tmp_path_factory.mktemp("emu")
    src, lib = folder / "kernels.cpp", folder / "kernels.so"
    src.write_text(_emulation_source())
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return Emulator(ctypes.CDLL(str(lib)))


def test_source_compiles_for_the_device(tmp_path: Path) -> None:
    """Every kernel and template instance compiles to PTX (sm_75, the oldest CUDA 13 targets)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    refs = ", ".join(f"(void*)&{name}" for name in kernels.template_names())
    src = tmp_path / "k.cu"
    src.write_text(kernels.SOURCE + f"\nvoid* const mn_kernels[] = {{{refs}}};\n")
    cmd = [nvcc, "-ptx", "-arch=compute_75", "-diag-suppress", "177", str(src), "-o"]
    run = subprocess.run([*cmd, str(tmp_path / "k.ptx")], capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()
    ptx = (tmp_path / "k.ptx").read_text()
    entries = ptx.count(".entry ")
    assert entries == len(kernels.PLAIN_KERNELS) + len(kernels.template_names())


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_rms_norm_and_add_rms_norm(emu: Emulator) -> None:
    x, h, w = _f32(3, 200), _f32(3, 200), _f32(200)
    y = np.empty_like(x)
    emu("rms_norm", (3, 1), kernels.BLOCK, x, w, y, 200, 1e-5)
    np.testing.assert_allclose(y, ops.rms_norm(np, x, w, 1e-5), rtol=1e-5, atol=1e-6)
    want_x, want_y = ops.add_rms_norm(np, x, h, w, 1e-5)
    emu("add_rms_norm", (3, 1), kernels.BLOCK, x, h, w, y, 200, 1e-5)
    np.testing.assert_allclose(x, want_x, rtol=1e-6)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)


def test_softmax_and_silu_mul(emu: Emulator) -> None:
    x = _f32(2, 300)
    x[1, 100:] = -np.inf
    want = ops.softmax(np, x)
    emu("softmax", (2, 1), kernels.BLOCK, x, 300)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-8)
    gate_up = _f32(3, 2 * 96) * 5
    out = np.empty((3, 96), np.float32)
    emu("silu_mul", (kernels.flat_grid(3 * 96), 1), kernels.BLOCK, gate_up, out, 3, 96)
    np.testing.assert_allclose(out, ops.silu_mul(np, gate_up), rtol=1e-5, atol=1e-6)
    emu("gelu_tanh_mul", (kernels.flat_grid(3 * 96), 1), kernels.BLOCK, gate_up, out, 3, 96)
    np.testing.assert_allclose(out, ops.gelu_tanh_mul(np, gate_up), rtol=1e-5, atol=1e-5)


def test_qk_norm_normalises_every_query_and_key_head_in_place(emu: Emulator) -> None:
    heads, kv_heads, dim, n = 4, 2, 32, 3
    qkv, qw, kw = _f32(n, (heads + 2 * kv_heads) * dim), _f32(dim), _f32(dim)
    q = qkv[:, : heads * dim].reshape(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(n, kv_heads, dim)
    want = np.concatenate(
        [
            ops.rms_norm(np, q, qw, 1e-6).reshape(n, -1),
            ops.rms_norm(np, k, kw, 1e-6).reshape(n, -1),
        ],
        axis=1,
    )
    v = qkv[:, (heads + kv_heads) * dim :].copy()
    emu("qk_norm", (heads + kv_heads, n), kernels.BLOCK, qkv, qw, kw, heads, kv_heads, dim, 1e-6)
    np.testing.assert_allclose(qkv[:, : (heads + kv_heads) * dim], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(qkv[:, (heads + kv_heads) * dim :], v)  # V untouched


# The block table of a contiguous cache (kernels.kv_row): block i in rows i KV_BLOCK ...
IDENTITY = np.arange(64, dtype=np.int64)


def _step(
    pos0: int,
    k: np.ndarray,
    v: np.ndarray,
    n: int,
    rows: int | None = None,
    blocks: np.ndarray = IDENTITY,
) -> np.ndarray:
    """The step table of ``n`` new rows of one sequence from ``pos0``, keeping its last
    ``rows``, its cache read through ``blocks`` (``kernels`` module docstring; the caller
    keeps ``blocks`` alive: the table holds its address)."""
    rows = n if rows is None else rows
    table = np.zeros((n, kernels.STEP), np.int64)
    table[:, 0] = np.arange(pos0, pos0 + n)
    table[:, 1:4] = (k.shape[2], k.ctypes.data, v.ctypes.data)
    table[:rows, 4] = np.arange(n - rows, n)
    table[:, 5] = blocks.ctypes.data
    return table


def test_the_sources_constants_are_the_modules() -> None:
    """The step table's width and the KV block the kernels read by, as Python counts them."""
    assert f"#define MN_STEP {kernels.STEP}\n" in kernels.SOURCE
    assert f"#define MN_KV_BLOCK {kernels.KV_BLOCK}\n" in kernels.SOURCE
    assert f"#define MN_BLOCK {kernels.BLOCK}\n" in kernels.SOURCE
    assert f"#define MN_PART {kernels.PART}\n" in kernels.SOURCE
    assert f"#define MN_GEMV_WARPS {kernels.GEMV_WARPS}\n" in kernels.SOURCE


@pytest.mark.parametrize("kv", ["float", "u16"])
def test_rope_store_rotates_q_and_writes_k_v_into_the_cache(emu: Emulator, kv: str) -> None:
    heads, kv_heads, dim, n, pos0, cap, layers = 4, 2, 16, 3, 5, 12, 2
    dtype = np.float32 if kv == "float" else np.uint16
    k_cache, v_cache = (np.zeros((layers, kv_heads, cap, dim), dtype) for _ in range(2))
    qkv = _f32(n, (heads + 2 * kv_heads) * dim)
    inv = (1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
    cos, sin = ops.rope_cos_sin(np, inv, pos0, n)
    q = qkv[:, : heads * dim].reshape(n, heads, dim).transpose(1, 0, 2)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(n, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].reshape(n, kv_heads, dim).transpose(1, 0, 2)
    want_q = ops.rotate_half(np, q, cos, sin).transpose(1, 0, 2).reshape(n, -1)
    want_k = ops.rotate_half(np, k.transpose(1, 0, 2), cos, sin)
    total = n * (heads + kv_heads) * dim // 2 + n * kv_heads * dim
    step = _step(pos0, k_cache, v_cache, n)
    args = (qkv, inv, step, 1, n, heads, kv_heads, dim)
    emu(f"rope_store_{kv}", (kernels.flat_grid(total), 1), kernels.BLOCK, *args)

    def stored(c: np.ndarray) -> np.ndarray:
        got = c[1, :, pos0 : pos0 + n]
        return got if kv == "float" else got.view(np.float16).astype(np.float32)

    tol = 1e-5 if kv == "float" else 1e-3
    np.testing.assert_allclose(qkv[:, : heads * dim], want_q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stored(k_cache), want_k, rtol=tol, atol=tol)
    np.testing.assert_allclose(stored(v_cache), v, rtol=tol, atol=tol)
    assert not k_cache[0].any()  # other layers and positions untouched
    assert not k_cache[1, :, :pos0].any()


@pytest.mark.parametrize(
    ("kv", "pos0", "n", "rows", "window"),
    [("float", 290, 3, 3, 0), ("u16", 7, 4, 2, 0), ("float", 290, 3, 2, 5), ("u16", 7, 4, 4, 3)],
)
def test_attention_reads_the_cache_in_place(
    emu: Emulator, kv: str, pos0: int, n: int, rows: int, window: int
) -> None:
    """GQA heads, causal rows; 290 + 3 keys span two 256-key chunks of the online softmax;
    with a sliding window each row sees only its last ``window`` keys."""
    heads, kv_heads, dim, cap, layer = 4, 2, 32, 320, 1
    t = pos0 + n
    keys, values = _f32(kv_heads, t, dim), _f32(kv_heads, t, dim)
    dtype = np.float32 if kv == "float" else np.float16
    keys, values = keys.astype(dtype).astype(np.float32), values.astype(dtype).astype(np.float32)
    k_cache, v_cache = (np.zeros((2, kv_heads, cap, dim), dtype) for _ in range(2))
    k_cache[layer, :, :t], v_cache[layer, :, :t] = keys, values
    if kv == "u16":
        k_cache, v_cache = k_cache.view(np.uint16), v_cache.view(np.uint16)
    qkv = _f32(n, (heads + 2 * kv_heads) * dim)
    q = qkv[n - rows :, : heads * dim].reshape(rows, heads, dim).transpose(1, 0, 2)
    scale = dim**-0.5
    q = np.ascontiguousarray(q)
    want = ops.attention(np, q, keys, values, scale, window or None)  # [H, r, D]
    out = np.zeros((rows, heads * dim), np.float32)
    step = _step(pos0, k_cache, v_cache, n, rows)
    args = (qkv, out, step, layer, n, rows, heads, kv_heads, dim, scale, window)
    emu(f"attention_{kv}", (heads, rows), kernels.BLOCK, *args)
    got = out.reshape(rows, heads, dim).transpose(1, 0, 2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _weights(fmt: formats.Format, out: int, inp: int) -> np.ndarray:
    """Random rows ``[out, row_bytes]`` of format ``fmt``."""
    if fmt in ("q8_0", "q4_k"):
        blocks = random_blocks(RNG, (out, inp), fmt.upper())
        return np.ascontiguousarray(blocks).view(np.uint8).reshape(out, -1)
    w = formats.encode_dense(_f32(out, inp) * 0.1, fmt)
    return np.ascontiguousarray(w).view(np.uint8).reshape(out, -1)


FORMATS: list[formats.Format] = ["f32", "f16", "bf16", "q8_0", "q4_k"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_matches_decoded_weights_times_x(emu: Emulator, fmt: formats.Format) -> None:
    out, inp = 26, 512  # the last block's last two warps have no output feature
    raw = _weights(fmt, out, inp)
    w = formats.decode_units(raw, fmt, inp)
    grid = (kernels.gemv_grid(out), 1)
    for rows in (1, 3, kernels.MAX_ROWS, kernels.MAX_ROWS + 5):  # the last in two passes
        x = _f32(rows, inp)
        flat = np.full(rows * out + 8, np.nan, np.float32)  # guard values past y
        y = flat[: rows * out].reshape(rows, out)
        kernel = f"gemv_{fmt}_{kernels.gemv_rows(rows)}"  # the instance the launch picks
        emu(kernel, grid, kernels.GEMV_BLOCK, raw, x, y, rows, inp, out)
        np.testing.assert_allclose(y, x @ w.T, rtol=1e-4, atol=1e-4)
        assert np.isnan(flat[rows * out :]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_embed_and_dequantize_decode_like_the_reference(emu: Emulator, fmt: formats.Format) -> None:
    vocab, dim = 10, 256
    raw = _weights(fmt, vocab, dim)
    table = formats.decode_units(raw, fmt, dim)
    ids = np.array([3, 0, 9, 3], np.int32)
    x = np.empty((4, dim), np.float32)
    emu(f"embed_{fmt}", (4, 1), kernels.BLOCK, raw, ids, x, dim)
    np.testing.assert_allclose(x, table[ids], rtol=1e-6)
    grid = (kernels.flat_grid(vocab * dim // kernels.UNIT), 1)
    dense = np.empty((vocab, dim), np.float32)
    emu(f"dequantize_{fmt}_f32", grid, kernels.BLOCK, raw, dense, dim, vocab)
    np.testing.assert_allclose(dense, table, rtol=1e-6)
    half = np.empty((vocab, dim), np.uint16)
    emu(f"dequantize_{fmt}_f16", grid, kernels.BLOCK, raw, half, dim, vocab)
    np.testing.assert_array_equal(half.view(np.float16), table.astype(np.float16))


def _rope_attention(
    emu: Emulator, kv: str, qkv: np.ndarray, step: np.ndarray, rows: int, shape: tuple[int, ...]
) -> np.ndarray:
    """rope_store then attention of layer 1 over ``qkv`` as one launch each; the output."""
    heads, kv_heads, dim = shape
    n = qkv.shape[0]
    total = n * (heads + kv_heads) * dim // 2 + n * kv_heads * dim
    inv = (1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
    rope = (qkv, inv, step, 1, n, heads, kv_heads, dim)
    emu(f"rope_store_{kv}", (kernels.flat_grid(total), 1), kernels.BLOCK, *rope)
    out = np.full((rows, heads * dim), np.nan, np.float32)
    att = (qkv, out, step, 1, n, rows, heads, kv_heads, dim, dim**-0.5, 0)
    emu(f"attention_{kv}", (heads, rows), kernels.BLOCK, *att)
    return out


@pytest.mark.parametrize("kv", ["float", "u16"])
def test_a_batch_of_sequences_each_uses_its_own_cache_and_positions(emu: Emulator, kv: str) -> None:
    """Three sequences in one step table (a verify window keeping 2 rows, a decode row, a
    prompt chunk keeping 1) with caches of different sizes: RoPE, the K/V writes and
    attention equal each sequence run alone, bit for bit, and the NumPy attention."""
    shape, layers = (4, 2, 16), 2
    heads, kv_heads, dim = shape
    dtype = np.float32 if kv == "float" else np.uint16
    seqs = [(9, 3, 2, 16), (4, 1, 1, 12), (0, 5, 1, 8)]  # (start, new rows, kept, capacity)
    prior = [_f32(layers, kv_heads, cap, dim) for _, _, _, cap in seqs]
    if kv == "u16":
        prior = [p.astype(np.float16).view(np.uint16) for p in prior]

    def caches() -> list[tuple[np.ndarray, np.ndarray]]:
        return [(p.astype(dtype), p[::-1].astype(dtype).copy()) for p in prior]

    qkvs = [_f32(n, (heads + 2 * kv_heads) * dim) for _, n, _, _ in seqs]
    alone_caches, alone = caches(), []
    for (start, n, keep, _), (k, v), qkv in zip(seqs, alone_caches, qkvs, strict=True):
        alone.append(_rope_attention(emu, kv, qkv.copy(), _step(start, k, v, n, keep), keep, shape))
    batch_caches = caches()
    tables = [
        _step(start, k, v, n, keep)
        for (start, n, keep, _), (k, v) in zip(seqs, batch_caches, strict=True)
    ]
    step = np.concatenate(tables)  # the rows of every sequence, in order
    firsts = np.cumsum([0] + [n for _, n, _, _ in seqs])  # each sequence's first row
    kept = [t[:keep, 4] + a for t, a, (_, _, keep, _) in zip(tables, firsts, seqs, strict=False)]
    step[:, 4] = 0
    step[:4, 4] = np.concatenate(kept)  # output row i is new row step[i, 4]
    got = _rope_attention(emu, kv, np.concatenate(qkvs), step, 4, shape)
    np.testing.assert_array_equal(got, np.concatenate(alone))
    for (want_k, want_v), (k, v) in zip(alone_caches, batch_caches, strict=True):
        np.testing.assert_array_equal(k, want_k)
        np.testing.assert_array_equal(v, want_v)
    # The first sequence's kept rows against NumPy: positions 10, 11 over its own cache.
    k, v = (
        c[1].view(np.float16).astype(np.float32) if kv == "u16" else c[1] for c in batch_caches[0]
    )
    inv = (1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
    cos, sin = ops.rope_cos_sin(np, inv, 9, 3)
    q = qkvs[0][:, : heads * dim].reshape(3, heads, dim).transpose(1, 0, 2)
    q = ops.rotate_half(np, q, cos, sin)[:, 1:]  # [H, 2, D]
    want = ops.attention(np, np.ascontiguousarray(q), k[:, :12], v[:, :12], dim**-0.5)
    got0 = got[:2].reshape(2, heads, dim).transpose(1, 0, 2)
    np.testing.assert_allclose(got0, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv", ["float", "u16"])
def test_a_paged_cache_is_read_and_written_through_its_block_table(emu: Emulator, kv: str) -> None:
    """A sequence whose blocks sit in slots 4, 1, 3 of a pool of 6 (issue 30): 40 new rows
    after 30 cached positions, RoPE's K/V writes and attention through the table give the
    contiguous cache's outputs bit for bit, its rows in the table's slots, and leave every
    other slot as it was."""
    shape, layers, b = (2, 1, 16), 2, kernels.KV_BLOCK
    heads, kv_heads, dim = shape
    dtype = np.float32 if kv == "float" else np.uint16
    blocks = np.array([4, 1, 3], np.int64)
    rows = (blocks[:, None] * b + np.arange(b)).reshape(-1)  # the pool row of each position

    def cache(positions: int) -> np.ndarray:
        a = _f32(layers, kv_heads, positions, dim)
        return a.astype(np.float16).view(np.uint16) if kv == "u16" else a

    flat = [np.zeros((layers, kv_heads, 3 * b, dim), dtype) for _ in range(2)]
    pool = [cache(6 * b) for _ in range(2)]  # other slots: another sequence's values
    before = [p.copy() for p in pool]
    for f, p in zip(flat, pool, strict=True):
        f[:, :, :30] = p[:, :, rows[:30]] = cache(30)
    qkv = _f32(40, (heads + 2 * kv_heads) * dim)
    want = _rope_attention(emu, kv, qkv.copy(), _step(30, flat[0], flat[1], 40, 3), 3, shape)
    paged = _step(30, pool[0], pool[1], 40, 3, blocks)
    got = _rope_attention(emu, kv, qkv.copy(), paged, 3, shape)
    np.testing.assert_array_equal(got, want)
    for f, p, old in zip(flat, pool, before, strict=True):
        np.testing.assert_array_equal(p[1][:, rows[:70]], f[1][:, :70])
        others = np.setdiff1d(np.arange(6 * b), rows[:70])
        np.testing.assert_array_equal(p[:, :, others], old[:, :, others])


def test_gather_rows_takes_the_rows_the_step_table_keeps(emu: Emulator) -> None:
    x = _f32(7, 300)
    step = np.zeros((7, kernels.STEP), np.int64)
    step[:3, 4] = [2, 3, 6]
    out = np.empty((3, 300), np.float32)
    emu("gather_rows", (3, 1), kernels.BLOCK, x, step, out, 300)
    np.testing.assert_array_equal(out, x[[2, 3, 6]])


def test_gemv_rows_are_the_same_alone_and_in_a_batch(emu: Emulator) -> None:
    """A batch larger than one pass (MAX_ROWS) gives each row what it gets alone, through
    the one-row instance and the four-row one (the launch picks by rows)."""
    out, inp, rows = 24, 512, kernels.MAX_ROWS * 2 + 3
    raw = _weights("q4_k", out, inp)
    x = _f32(rows, inp)
    y = np.empty((rows, out), np.float32)
    grid = (kernels.gemv_grid(out), 1)
    emu("gemv_q4_k_16", grid, kernels.GEMV_BLOCK, raw, x, y, rows, inp, out)
    for r in (0, kernels.MAX_ROWS, rows - 1):
        for instance in ("gemv_q4_k_1", "gemv_q4_k_4"):
            alone = np.empty((1, out), np.float32)
            one = x[r : r + 1].copy()
            emu(instance, grid, kernels.GEMV_BLOCK, raw, one, alone, 1, inp, out)
            np.testing.assert_array_equal(y[r], alone[0])
    four = np.empty((4, out), np.float32)
    emu("gemv_q4_k_4", grid, kernels.GEMV_BLOCK, raw, x[:4].copy(), four, 4, inp, out)
    np.testing.assert_array_equal(y[:4], four)


def test_gemv_instances_cover_every_batch() -> None:
    """The launch's instance holds one, four or MAX_ROWS rows a pass."""
    picks = [kernels.gemv_rows(n) for n in (1, 2, 4, 5, 16, 17, kernels.MAX_BATCH_ROWS)]
    assert picks == [1, 4, 4, 16, 16, 16, 16]
    assert kernels.GEMV_ROWS[-1] == kernels.MAX_ROWS
