"""Each CUDA kernel against its NumPy reference, on a device (skipped without one).

Tolerances: float32 paths 1e-5 relative (norms, softmax, SwiGLU, RoPE) and 1e-4 (sums of
hundreds of products: attention, matvec), since the device sums in a different order;
float16 KV cache 2e-3 (one float16 rounding of each K/V value, ~5e-4, through a softmax).
The same comparisons run on the CPU through ``test_ops_emulated.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshnode.engine import ops
from meshnode.engine.backend import Backend, BackendError, select_backend
from meshnode.engine.cuda import formats, kernels
from tests.engine.tiny import random_blocks

pytestmark = pytest.mark.gpu

RNG = np.random.default_rng(5)
FORMATS: list[formats.Format] = ["f32", "f16", "bf16", "q8_0", "q4_k"]


def cuda_backend(weights_dtype: str = "float32", *, cuda_graphs: bool = True) -> Backend:
    """The CUDA backend, or skip the test: no CuPy, no driver or no device here."""
    try:
        return select_backend("cuda", weights_dtype, cuda_graphs=cuda_graphs)
    except BackendError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def dev() -> tuple[Any, Any]:
    """(cupy, compiled kernels)."""
    backend = cuda_backend()
    from meshnode.engine.cuda.device import kernels_for

    return backend.xp, kernels_for(backend.xp)


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_row_kernels(dev: tuple[Any, Any]) -> None:
    cp, k = dev
    x, h, w = _f32(3, 576), _f32(3, 576), _f32(576)
    dx, dh, dw, dy = cp.asarray(x), cp.asarray(h), cp.asarray(w), cp.empty((3, 576), cp.float32)
    k.rms_norm(dx, dw, dy, 1e-5)
    np.testing.assert_allclose(dy.get(), ops.rms_norm(np, x, w, 1e-5), rtol=1e-5, atol=1e-6)
    want_x, want_y = ops.add_rms_norm(np, x, h, w, 1e-5)
    k.add_rms_norm(dx, dh, dw, dy, 1e-5)
    np.testing.assert_allclose(dx.get(), want_x, rtol=1e-6)
    np.testing.assert_allclose(dy.get(), want_y, rtol=1e-5, atol=1e-6)
    s = _f32(2, 1000)
    s[1, 10:] = -np.inf
    ds = cp.asarray(s)
    k.softmax(ds)
    np.testing.assert_allclose(ds.get(), ops.softmax(np, s), rtol=1e-5, atol=1e-8)
    gu = _f32(4, 2 * 1536) * 4
    act = cp.empty((4, 1536), cp.float32)
    k.silu_mul(cp.asarray(gu), act)
    np.testing.assert_allclose(act.get(), ops.silu_mul(np, gu), rtol=1e-5, atol=1e-6)


# A contiguous cache's block table on the device (kernels.kv_row: block i in rows i
# KV_BLOCK ...), made once and kept alive: step tables hold its address.
_IDENTITY: list[Any] = []


def _identity() -> int:
    """The address of the identity block table on the device."""
    if not _IDENTITY:
        import cupy

        _IDENTITY.append(cupy.arange(64, dtype=cupy.int64))
    return int(_IDENTITY[0].data.ptr)


def _table(pos0: int, kc: Any, vc: Any, n: int, rows: int) -> np.ndarray:
    """The step table of ``n`` new rows of one sequence from ``pos0``, keeping its last
    ``rows`` (``kernels`` module docstring), its cache contiguous."""
    table = np.zeros((n, kernels.STEP), np.int64)
    table[:, 0] = np.arange(pos0, pos0 + n)
    table[:, 1:4] = (kc.shape[2], kc.data.ptr, vc.data.ptr)
    table[:rows, 4] = np.arange(n - rows, n)
    table[:, 5] = _identity()
    return table


def _step(cp: Any, pos0: int, kc: Any, vc: Any, n: int, rows: int) -> Any:
    return cp.asarray(_table(pos0, kc, vc, n, rows))


@pytest.mark.parametrize("kv", ["float", "u16"])
def test_rope_store_and_attention(dev: tuple[Any, Any], kv: str) -> None:
    cp, k = dev
    heads, kv_heads, dim, pos0, n, rows, cap = 9, 3, 64, 700, 4, 3, 1024
    dtype = np.float32 if kv == "float" else np.float16
    # The cache holds what it stores: the reference reads the same (rounded) values.
    old_k, old_v = (_f32(kv_heads, pos0, dim).astype(dtype).astype(np.float32) for _ in "kv")
    kc = np.zeros((2, kv_heads, cap, dim), dtype)
    vc = np.zeros((2, kv_heads, cap, dim), dtype)
    kc[1, :, :pos0], vc[1, :, :pos0] = old_k, old_v
    dkc, dvc = cp.asarray(kc), cp.asarray(vc)
    if kv == "u16":
        dkc, dvc = dkc.view(cp.uint16), dvc.view(cp.uint16)
    qkv = _f32(n, (heads + 2 * kv_heads) * dim)
    inv = (1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
    dqkv, step = cp.asarray(qkv), _step(cp, pos0, dkc, dvc, n, rows)
    k.rope_store(dqkv, cp.asarray(inv), step, 1, heads, kv_heads, kv)
    cos, sin = ops.rope_cos_sin(np, inv, pos0, n)
    q = qkv[:, : heads * dim].reshape(n, heads, dim).transpose(1, 0, 2)
    new_k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(n, kv_heads, dim)
    new_k = ops.rotate_half(np, new_k.transpose(1, 0, 2), cos, sin)
    new_v = qkv[:, (heads + kv_heads) * dim :].reshape(n, kv_heads, dim).transpose(1, 0, 2)
    tol = 1e-5 if kv == "float" else 1e-3
    got_k = dkc.view(dtype).get()[1, :, pos0 : pos0 + n].astype(np.float32)
    got_v = dvc.view(dtype).get()[1, :, pos0 : pos0 + n].astype(np.float32)
    np.testing.assert_allclose(got_k, new_k, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_v, new_v, rtol=tol, atol=tol)
    q_rot = ops.rotate_half(np, q, cos, sin)  # [H, S, D]
    np.testing.assert_allclose(
        dqkv.get()[:, : heads * dim], q_rot.transpose(1, 0, 2).reshape(n, -1), rtol=1e-5, atol=1e-5
    )
    keys = np.concatenate([old_k, got_k], axis=1)
    values = np.concatenate([old_v, got_v], axis=1)
    out = cp.empty((rows, heads * dim), cp.float32)
    k.attention(dqkv, out, step, 1, heads, kv_heads, dim**-0.5, kv)
    want = ops.attention(np, np.ascontiguousarray(q_rot[:, n - rows :]), keys, values, dim**-0.5)
    np.testing.assert_allclose(
        out.get().reshape(rows, heads, dim).transpose(1, 0, 2), want, rtol=1e-4, atol=2e-5
    )
    assert not dkc.get()[0].any()  # another layer's cache is untouched


def _matrix(cp: Any, fmt: formats.Format, out: int, inp: int) -> tuple[Any, np.ndarray]:
    """A random device matrix and its float32 value."""
    from meshnode.engine.cuda.device import DeviceMatrix

    if fmt in ("q8_0", "q4_k"):
        raw = np.ascontiguousarray(random_blocks(RNG, (out, inp), fmt.upper())).view(np.uint8)
        raw = raw.reshape(out, -1)
        return DeviceMatrix(cp.asarray(raw), fmt, out, inp), formats.decode_units(raw, fmt, inp)
    data = formats.encode_dense(_f32(out, inp) * 0.05, fmt)
    value = formats.decode_units(data.view(np.uint8).reshape(out, -1), fmt, inp)
    return DeviceMatrix(cp.asarray(data), fmt, out, inp), value


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_embed_dequantize(dev: tuple[Any, Any], fmt: formats.Format) -> None:
    cp, k = dev
    w, value = _matrix(cp, fmt, 1000, 768)
    for rows in (1, 2, 5, 16):
        x = _f32(rows, 768)
        y = cp.full((rows, 1000), cp.nan, cp.float32)
        k.gemv(w, cp.asarray(x), y)
        np.testing.assert_allclose(y.get(), x @ value.T, rtol=1e-4, atol=1e-4)
    ids = np.array([999, 0, 17], np.int32)
    x = cp.empty((3, 768), cp.float32)
    k.embed(w, cp.asarray(ids), x)
    # The device may fuse Q4_K's d * q - m into one FMA: an ulp from NumPy's two roundings.
    np.testing.assert_allclose(x.get(), value[ids], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k.dequantize(w, cp.float32).get(), value, rtol=1e-6, atol=1e-6)
    half = k.dequantize(w, cp.float16).get().astype(np.float32)
    np.testing.assert_allclose(half, value, rtol=2**-11, atol=1e-6)


@pytest.mark.parametrize("kv", ["float", "u16"])
def test_a_batch_of_sequences_equals_each_alone(dev: tuple[Any, Any], kv: str) -> None:
    """Three sequences' rows in one step table (a verify window keeping 2 rows, a decode
    row, a prompt chunk keeping 1), caches of different sizes: RoPE, the K/V writes and
    attention give each sequence exactly what it gets alone."""
    cp, k = dev
    heads, kv_heads, dim = 8, 2, 64
    seqs = [(300, 3, 2, 512), (40, 1, 1, 64), (0, 5, 1, 16)]  # (start, rows, kept, capacity)
    prior = [_f32(2, kv_heads, cap, dim) for *_, cap in seqs]
    if kv == "u16":  # the cache holds float16 bit patterns
        prior = [p.astype(np.float16).view(np.uint16) for p in prior]
    qkvs = [_f32(n, (heads + 2 * kv_heads) * dim) for _, n, _, _ in seqs]
    inv = cp.asarray((1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32))

    def run(qkv: np.ndarray, table: np.ndarray, rows: int) -> np.ndarray:
        dqkv, step = cp.asarray(qkv), cp.asarray(table)
        k.rope_store(dqkv, inv, step, 1, heads, kv_heads, kv)
        out = cp.full((rows, heads * dim), cp.nan, cp.float32)
        k.attention(dqkv, out, step, 1, heads, kv_heads, dim**-0.5, kv)
        return np.asarray(out.get())

    def caches() -> list[tuple[Any, Any]]:
        return [(cp.asarray(p), cp.asarray(np.ascontiguousarray(p[::-1]))) for p in prior]

    alone_caches, alone = caches(), []
    for (start, n, keep, _), (kc, vc), qkv in zip(seqs, alone_caches, qkvs, strict=True):
        alone.append(run(qkv, _table(start, kc, vc, n, keep), keep))
    batch_caches = caches()
    tables = [
        _table(start, kc, vc, n, keep)
        for (start, n, keep, _), (kc, vc) in zip(seqs, batch_caches, strict=True)
    ]
    firsts = np.cumsum([0] + [n for _, n, _, _ in seqs])  # each sequence's first row
    kept = [t[:keep, 4] + a for t, a, (_, _, keep, _) in zip(tables, firsts, seqs, strict=False)]
    step = np.concatenate(tables)
    step[:, 4] = 0
    step[:4, 4] = np.concatenate(kept)  # output row i is new row step[i, 4]
    got = run(np.concatenate(qkvs), step, 4)
    np.testing.assert_array_equal(got, np.concatenate(alone))
    for (want_k, want_v), (kc, vc) in zip(alone_caches, batch_caches, strict=True):
        np.testing.assert_array_equal(kc.get(), want_k.get())
        np.testing.assert_array_equal(vc.get(), want_v.get())


def test_gather_rows_and_a_gemv_batch_in_several_passes(dev: tuple[Any, Any]) -> None:
    """gather_rows takes the rows the table lists; a gemv of more rows than one pass
    (MAX_ROWS) gives every row exactly what it gets alone."""
    cp, k = dev
    x = _f32(7, 576)
    step = np.zeros((7, kernels.STEP), np.int64)
    step[:3, 4] = [2, 3, 6]
    out = cp.empty((3, 576), cp.float32)
    k.gather_rows(cp.asarray(x), cp.asarray(step), out)
    np.testing.assert_array_equal(out.get(), x[[2, 3, 6]])
    w, value = _matrix(cp, "q4_k", 1000, 768)
    rows = 2 * kernels.MAX_ROWS + 5
    xs = _f32(rows, 768)
    y = cp.empty((rows, 1000), cp.float32)
    k.gemv(w, cp.asarray(xs), y)
    np.testing.assert_allclose(y.get(), xs @ value.T, rtol=1e-4, atol=1e-4)
    for r in (0, kernels.MAX_ROWS, rows - 1):
        alone = cp.empty((1, 1000), cp.float32)
        k.gemv(w, cp.asarray(xs[r : r + 1]), alone)
        np.testing.assert_array_equal(y.get()[r], alone.get()[0])


@pytest.mark.parametrize("kv", ["float", "u16"])
def test_a_paged_cache_is_read_and_written_through_its_block_table(
    dev: tuple[Any, Any], kv: str
) -> None:
    """Blocks in slots 4, 1, 3 of a pool of 6 (issue 30): 40 new rows after 30 cached
    positions through the table give the contiguous cache's outputs bit for bit, write
    its rows into the table's slots and leave every other slot as it was."""
    cp, k = dev
    heads, kv_heads, dim, b = 8, 2, 64, kernels.KV_BLOCK
    blocks = cp.asarray(np.array([4, 1, 3], np.int64))
    rows = (np.array([4, 1, 3])[:, None] * b + np.arange(b)).reshape(-1)
    dtype = np.float32 if kv == "float" else np.uint16

    def cache(positions: int) -> np.ndarray:
        a = _f32(2, kv_heads, positions, dim)
        return a.astype(np.float16).view(np.uint16) if kv == "u16" else a

    flat = [np.zeros((2, kv_heads, 3 * b, dim), dtype) for _ in "kv"]
    pool = [cache(6 * b) for _ in "kv"]
    for f, p in zip(flat, pool, strict=True):
        f[:, :, :30] = p[:, :, rows[:30]] = cache(30)
    qkv = _f32(40, (heads + 2 * kv_heads) * dim)
    inv = cp.asarray((1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32))

    def run(kc: Any, vc: Any, table: int) -> np.ndarray:
        step = _table(30, kc, vc, 40, 3)
        step[:, 5] = table
        dqkv, dstep = cp.asarray(qkv), cp.asarray(step)
        k.rope_store(dqkv, inv, dstep, 1, heads, kv_heads, kv)
        out = cp.full((3, heads * dim), cp.nan, cp.float32)
        k.attention(dqkv, out, dstep, 1, heads, kv_heads, dim**-0.5, kv)
        return np.asarray(out.get())

    dflat, dpool = [cp.asarray(a) for a in flat], [cp.asarray(a) for a in pool]
    want = run(dflat[0], dflat[1], _identity())
    np.testing.assert_array_equal(run(dpool[0], dpool[1], int(blocks.data.ptr)), want)
    others = np.setdiff1d(np.arange(6 * b), rows[:70])
    for f, p, old in zip(dflat, dpool, pool, strict=True):
        got = p.get()
        np.testing.assert_array_equal(got[1][:, rows[:70]], f.get()[1][:, :70])
        np.testing.assert_array_equal(got[:, :, others], old[:, :, others])
