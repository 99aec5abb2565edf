"""The compiled attention kernel (``engine.cpu.attention`` through ``KernelAttention``)
against the NumPy reference (``engine.attention.Attention``, i.e. ``engine.ops``).

The kernel sums in another order than NumPy/BLAS: outputs and cached keys agree within
``ATOL`` (values here are of order 1; float32 rounding of 64-256-term sums is ~1e-6),
cached values exactly (they are copied). What must be exact is exact: a segment's rows
alone and in any batch, and the RoPE table against a per-segment computation.

Most tests run over float32 and float16 caches (``KV``): the reference then attends over
the float16 cache's contents too (``KVCache.write`` hands them back widened), so the two
sides differ by the summation order and, rarely, by a key the two round to neighbouring
float16 values (a float32 difference that straddles a rounding boundary): ``ATOL_F16``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from meshnode.engine import ops
from meshnode.engine.attention import (
    KERNEL_MAX_ROWS,
    Attention,
    KernelAttention,
    RopeTable,
    Segment,
)
from meshnode.engine.config import ModelConfig
from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.attention import KEPT, KERNEL, NEW, ROW_BLOCK, _part_rows
from meshnode.engine.cpu.pool import CoreGauge, KernelPool
from meshnode.engine.kv_cache import KVCache

ATOL = 2e-5
LAYERS = 2
CONTEXT = 320
# The KV caches' dtypes, and the agreement of kernel and reference outputs over
# float16 caches: a key rounded to a neighbouring float16 (2**-10 relative) moves a score
# by about 1e-4 at these sizes, an output by less.
KV = [np.float32, np.float16]
KV_IDS = ["f32", "f16"]
ATOL_F16 = 5e-4


def _atol(dtype: type) -> float:
    return ATOL if dtype == np.float32 else ATOL_F16


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    window: int | None


SHAPES = [
    Shape(4, 2, 64, False, None),  # the tiny Llama: groups of 2
    Shape(9, 3, 64, False, None),  # SmolLM2-135M: groups of 3
    Shape(4, 1, 256, True, 8),  # Gemma 3 270M's kind: one KV head, QK-norm, sliding
    Shape(2, 2, 32, True, 5),  # no grouping, a narrow head
]


def _config(s: Shape) -> ModelConfig:
    """A decoder of two layers, the second sliding when the shape has a window."""
    window_types = ("full_attention", "sliding_attention")
    return ModelConfig(
        model_type="gemma3_text" if s.qk_norm else "llama",
        hidden_size=s.heads * s.head_dim,
        num_layers=LAYERS,
        num_heads=s.heads,
        num_kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=64,
        vocab_size=32,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        rope_scaling=None,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
        layer_types=window_types if s.window else (),
        sliding_window=s.window,
        rope_local_theta=100.0 if s.window else None,
        query_pre_attn_scalar=s.head_dim / 2 if s.qk_norm else None,
    )


def _norms(c: ModelConfig, qk_norm: bool, rng: np.random.Generator) -> tuple[object, object]:
    if not qk_norm:
        return None, None
    q, k = (1.0 + 0.2 * rng.standard_normal((2, c.head_dim))).astype(np.float32)
    return q, k


def _qkv(c: ModelConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((n, c.q_size + 2 * c.kv_size)).astype(np.float32)


class Twin:
    """The same sequences in two sets of caches: one for the kernel, one for the reference."""

    def __init__(self, c: ModelConfig, count: int, dtype: type = np.float32) -> None:
        self.c, self.dtype = c, dtype
        self.kernel = KernelAttention(np, c, 0, LAYERS)
        self.reference = Attention(np, c, 0, LAYERS)
        self.caches = [[self._cache() for _ in range(count)] for _ in range(2)]

    def _cache(self) -> KVCache:
        c = self.c
        return KVCache(np, LAYERS, c.num_kv_heads, c.head_dim, CONTEXT, dtype=self.dtype)

    def run(
        self,
        parts: list[tuple[int, int, int]],  # (sequence, start position, kept rows)
        qkvs: list[np.ndarray],
        norms: tuple[object, object],
        last: bool = False,
        sinks: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every layer of one forward on both sides (each with ``sinks``, if given); the
        last layer's outputs."""
        outs = []
        for attn, caches in zip((self.kernel, self.reference), self.caches, strict=True):
            segs = []
            for (i, start, kept), qkv in zip(parts, qkvs, strict=True):
                caches[i].truncate(start)
                segs.append(Segment(start, len(qkv), kept, caches[i]))
            plan = attn.prepare(segs)
            qkv = np.concatenate(qkvs)
            for layer in range(LAYERS):
                out = attn(qkv, segs, plan, layer, norms, last and layer == LAYERS - 1, sinks)
            for (i, start, _), q in zip(parts, qkvs, strict=True):
                caches[i].length = start + len(q)
            outs.append(out)
        return outs[0], outs[1]

    def check_caches(self) -> None:
        for mine, theirs in zip(*self.caches, strict=True):
            n = mine.length
            assert theirs.length == n
            assert mine.k.dtype == theirs.k.dtype == mine.v.dtype == self.dtype
            k, k_ref = (np.asarray(c.k[:, :, :n], np.float32) for c in (mine, theirs))
            # float16 keys: rounded from float32 values within ATOL, so at most one float16
            # step (2**-10 relative) apart
            rtol = 0 if self.dtype == np.float32 else 2**-10
            np.testing.assert_allclose(k, k_ref, rtol=rtol, atol=ATOL)
            np.testing.assert_array_equal(mine.v[:, :, :n], theirs.v[:, :, :n])


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_verify_and_prefill_segments_match_the_reference(shape: Shape, dtype: type) -> None:
    """Prefills (short and long, all through the kernel), then a batch mixing a
    decode row, a verify window (k + 1 rows) and a new prefill, in the last layer too
    (kept rows only): outputs and caches as the reference computes them."""
    c = _config(shape)
    rng = np.random.default_rng(7)
    norms = _norms(c, shape.qk_norm, rng)
    twin = Twin(c, 3, dtype)
    lengths = [12, KERNEL_MAX_ROWS + 9, 3]  # short, long, short: all through the kernel
    qkvs = [_qkv(c, n, rng) for n in lengths]
    got, want = twin.run([(i, 0, n) for i, n in enumerate(lengths)], qkvs, norms)
    np.testing.assert_allclose(got, want, atol=_atol(dtype))
    qkvs = [_qkv(c, 1, rng), _qkv(c, 5, rng), _qkv(c, 20, rng)]
    parts = [(0, 12, 1), (1, KERNEL_MAX_ROWS + 9, 2), (2, 3, 1)]
    got, want = twin.run(parts, qkvs, norms, last=True)
    assert got.shape == (4, c.q_size)
    np.testing.assert_allclose(got, want, atol=_atol(dtype))
    twin.check_caches()


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
def test_a_long_prefill_and_windows_after_it_go_through_the_kernel(
    dtype: type,
) -> None:
    """A prefill of more than KERNEL_MAX_ROWS rows, a verify window of 16 rows late in the
    long sequence and decode rows after it all take the kernel (however many rows and
    positions: a row's bits must not depend on how its prompt was cut) and agree with the
    reference."""
    c = _config(SHAPES[2])
    rng = np.random.default_rng(13)
    norms = _norms(c, True, rng)
    twin = Twin(c, 1, dtype)
    for start, n in [(0, 290), (290, KERNEL_MAX_ROWS), (306, 1), (307, 4)]:
        cache = twin.caches[0][0]
        plan = twin.kernel.prepare([Segment(start, n, n, cache)])
        assert plan is not None
        got, want = twin.run([(0, start, n)], [_qkv(c, n, rng)], norms, last=True)
        np.testing.assert_allclose(got, want, atol=_atol(dtype))
    twin.check_caches()


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s.window], ids=str)
def test_sliding_window_at_its_edge(shape: Shape, dtype: type) -> None:
    """Query positions just before, at and after the window's length: the keys a sliding
    layer drops are the reference's (one row at a time, and a window of rows at once)."""
    c = _config(shape)
    w = shape.window
    assert w is not None
    rng = np.random.default_rng(11)
    norms = _norms(c, shape.qk_norm, rng)
    twin = Twin(c, 2, dtype)
    twin.run([(0, 0, w - 1), (1, 0, w - 2)], [_qkv(c, w - 1, rng), _qkv(c, w - 2, rng)], norms)
    for step in range(3):  # positions w - 1, w, w + 1 of sequence 0
        start = w - 1 + step
        got, want = twin.run([(0, start, 1)], [_qkv(c, 1, rng)], norms)
        np.testing.assert_allclose(got, want, atol=_atol(dtype))
    got, want = twin.run([(1, w - 2, 4)], [_qkv(c, 4, rng)], norms)  # rows across the edge
    np.testing.assert_allclose(got, want, atol=_atol(dtype))
    twin.check_caches()


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
def test_rollback_rewrites_the_truncated_positions(dtype: type) -> None:
    """A verify window rejected in part: the cache truncated, then rewritten from the
    rollback point; the result is that of a sequence that never saw the dropped rows."""
    c = _config(SHAPES[1])
    rng = np.random.default_rng(3)
    norms = _norms(c, False, rng)
    prompt, window, redo = _qkv(c, 9, rng), _qkv(c, 4, rng), _qkv(c, 2, rng)
    twin = Twin(c, 1, dtype)
    twin.run([(0, 0, 9)], [prompt], norms)
    twin.run([(0, 9, 4)], [window], norms)
    rolled = twin.run([(0, 10, 2)], [redo], norms)[0]  # keeps one of the window's rows
    fresh = Twin(c, 1, dtype)
    fresh.run([(0, 0, 10)], [np.concatenate([prompt, window[:1]])], norms)
    clean = fresh.run([(0, 10, 2)], [redo], norms)[0]
    np.testing.assert_array_equal(rolled, clean)
    twin.check_caches()


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=str)
def test_a_segment_is_bit_identical_alone_and_in_any_batch(shape: Shape, dtype: type) -> None:
    """A sequence's rows do not depend on what else is in the batch, nor where."""
    c = _config(shape)
    rng = np.random.default_rng(5)
    norms = _norms(c, shape.qk_norm, rng)
    prompts = [_qkv(c, n, rng) for n in (6, 10, 4, 30)]
    steps = [_qkv(c, n, rng) for n in (1, 3, 1, 1)]
    alone = []
    for p, s in zip(prompts, steps, strict=True):
        twin = Twin(c, 1, dtype)
        twin.run([(0, 0, len(p))], [p], norms)
        alone.append(twin.run([(0, len(p), len(s))], [s], norms, last=True)[0])
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0]):
        twin = Twin(c, 4, dtype)
        twin.run([(i, 0, len(prompts[i])) for i in order], [prompts[i] for i in order], norms)
        parts = [(i, len(prompts[i]), len(steps[i])) for i in order]
        out = twin.run(parts, [steps[i] for i in order], norms, last=True)[0]
        row = 0
        for i in order:
            rows = len(steps[i])
            np.testing.assert_array_equal(out[row : row + rows], alone[i])
            row += rows


def _window_rows(
    c: ModelConfig, norms: tuple[object, object], prompt: np.ndarray, window: np.ndarray,
    kept: int, at_once: bool, dtype: type = np.float32, sinks: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """The last layer's attention of ``window``'s last ``kept`` rows after ``prompt``
    (every layer given the same q/k/v, and ``sinks``): one forward of all its rows, or
    one per row."""
    attn = KernelAttention(np, c, 0, LAYERS)
    cache = KVCache(np, LAYERS, c.num_kv_heads, c.head_dim, CONTEXT, dtype=dtype)

    def forward(start: int, qkv: np.ndarray, rows: int) -> np.ndarray:
        cache.truncate(start)
        segs = [Segment(start, len(qkv), rows, cache)]
        plan = attn.prepare(segs)
        for layer in range(LAYERS):
            out = attn(qkv, segs, plan, layer, norms, layer == LAYERS - 1, sinks)
        cache.length = start + len(qkv)
        return np.asarray(out)

    forward(0, prompt, len(prompt))
    if at_once:
        return forward(len(prompt), window, kept)
    rows = [forward(len(prompt) + i, window[i : i + 1], 1) for i in range(len(window))]
    return np.concatenate(rows[len(window) - kept :])


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("prompt", "rows", "kept"), [(3, 5, 5), (40, 16, 16), (150, 16, 3)])
def test_a_windows_rows_are_bit_identical_to_the_same_rows_one_at_a_time(
    shape: Shape, prompt: int, rows: int, kept: int, dtype: type
) -> None:
    """A verify window's rows, computed together (each block of keys and values read once
    for all of them), give the bits of the same rows computed one forward at a time (as
    decode computes them): grouped queries, a sliding window narrower than the rows,
    after a prompt through the kernel and after one through BLAS, all rows or the last."""
    c = _config(shape)
    rng = np.random.default_rng(23)
    norms = _norms(c, shape.qk_norm, rng)
    first, window = _qkv(c, prompt, rng), _qkv(c, rows, rng)
    together = _window_rows(c, norms, first, window, kept, True, dtype)
    alone = _window_rows(c, norms, first, window, kept, False, dtype)
    assert together.shape == (kept, c.q_size)
    np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
def test_a_segment_of_more_rows_than_a_pass_is_bit_identical_to_one_row_at_a_time(
    dtype: type,
) -> None:
    """Past ROW_BLOCK rows the kernel computes a segment in passes of ROW_BLOCK rows: the
    same bits as one row at a time."""
    c = _config(SHAPES[2])
    rng = np.random.default_rng(29)
    norms = _norms(c, True, rng)
    first, window = _qkv(c, 30, rng), _qkv(c, ROW_BLOCK + 7, rng)
    together = _window_rows(c, norms, first, window, ROW_BLOCK + 7, True, dtype)
    alone = _window_rows(c, norms, first, window, ROW_BLOCK + 7, False, dtype)
    np.testing.assert_array_equal(together, alone)


def test_a_full_cache_is_refused_before_anything_is_written() -> None:
    c = _config(SHAPES[0])
    attn = KernelAttention(np, c, 0, LAYERS)
    cache = KVCache(np, LAYERS, c.num_kv_heads, c.head_dim, 4)
    with pytest.raises(ValueError, match="KV cache full"):
        attn.prepare([Segment(2, 3, 1, cache)])


def test_rope_table_rows_equal_a_per_segment_computation_bit_for_bit() -> None:
    inv_freq = np.asarray(_config(SHAPES[2]).rope_inv_freq(0), np.float32)
    table = RopeTable(np, inv_freq)
    for start, n in [(0, 1), (5, 7), (250, 20), (1000, 3), (37, 600)]:
        cos, sin = table.rows(start, n)
        want_cos, want_sin = ops.rope_cos_sin(np, inv_freq, start, n)
        np.testing.assert_array_equal(cos, want_cos)
        np.testing.assert_array_equal(sin, want_sin)


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=str)
@pytest.mark.parametrize("batch", ["eight sequences", "one window"])
def test_shared_with_the_kernel_threads_is_bit_identical_to_one_thread(
    shape: Shape, batch: str, monkeypatch: pytest.MonkeyPatch, dtype: type
) -> None:
    """Six decode rows and verify windows of 8 and 16 rows over ~200 positions (past
    SHARED_MIN_READS), or one window of 16 rows (13 kept: its rows split into parts so
    that each thread has tasks): the query groups computed by the pool's threads give the
    outputs and caches of one thread, bit for bit, and the pool did take the calls."""
    c = _config(shape)
    rng = np.random.default_rng(17)
    norms = _norms(c, shape.qk_norm, rng)
    count = 8 if batch == "eight sequences" else 1
    prompts = [_qkv(c, 190 + 3 * i, rng) for i in range(count)]
    sizes = [{2: 8, 5: KERNEL_MAX_ROWS}.get(i, 1) for i in range(8)] if count == 8 else [16]
    steps = [_qkv(c, n, rng) for n in sizes]
    kept = sizes if count == 8 else [13]
    pool = KernelPool(CoreGauge(Path("/nonexistent/stat"), cpus=set(range(4))))  # all free
    monkeypatch.setattr(matrix, "_pool", lambda: pool)
    outs, caches = [], []
    for threads in (1, 2, 4):
        monkeypatch.setattr(matrix, "_threads", threads)
        twin = Twin(c, count, dtype)
        twin.run([(i, 0, len(p)) for i, p in enumerate(prompts)], prompts, norms)
        parts = [(i, len(p), k) for i, (p, k) in enumerate(zip(prompts, kept, strict=True))]
        before = pool.posted
        outs.append(twin.run(parts, steps, norms, last=True)[0])
        caches.append(twin.caches[0])
        assert (pool.posted > before) == (threads > 1)
        twin.check_caches()
    for out, mine in zip(outs[1:], caches[1:], strict=True):
        np.testing.assert_array_equal(out, outs[0])
        for a, b in zip(mine, caches[0], strict=True):
            np.testing.assert_array_equal(a.k, b.k)
            np.testing.assert_array_equal(a.v, b.v)


def test_a_lone_window_is_cut_into_parts_for_the_threads() -> None:
    """The shared call's tasks: a window of 16 rows of one KV head is cut into parts of
    fewer rows (two tasks per thread at least); eight decode rows are not cut."""
    window = np.zeros((1, 8), np.int64)
    window[0, NEW] = window[0, KEPT] = 16
    window[0, KERNEL] = 1
    assert [_part_rows(window, True, 1, n) for n in (2, 4)] == [4, 2]
    assert _part_rows(window, True, 3, 2) == 8  # three KV heads: 3 tasks, cut in two: 6
    decode = np.repeat(window, 8, axis=0)
    decode[:, NEW] = decode[:, KEPT] = 1
    assert _part_rows(decode, True, 3, 2) == 16


def _wexp(x: np.ndarray, nonpositive: bool = False) -> np.ndarray:
    from numba import njit

    from meshnode.engine.cpu.simd import wload, wstore
    from meshnode.engine.cpu.vexp import wexp, wexp_nonpositive

    @njit
    def run(x, out):  # type: ignore[no-untyped-def]
        for i in range(0, x.shape[0], 16):
            if nonpositive:
                wstore(out, i, wexp_nonpositive(wload(x, i)))
            else:
                wstore(out, i, wexp(wload(x, i)))

    x = np.concatenate([x, np.zeros(-len(x) % 16, np.float32)])
    out = np.empty_like(x)
    run(x, out)
    return out


def test_vector_exp_is_within_two_ulps_of_the_exact_exponential() -> None:
    """The softmax's exponential (``cpu.vexp.wexp``) over every range a score difference
    takes, against float64's rounded to float32 (``np.exp`` is within 2 as well); 0 below
    the smallest normal result, inf past the largest, NaN kept."""
    rng = np.random.default_rng(19)
    parts = [
        rng.uniform(-87.3, 0, 200_000),
        rng.uniform(-1, 1, 50_000),
        rng.uniform(0, 88.7, 50_000),
    ]
    x = np.concatenate(parts).astype(np.float32)
    got = _wexp(x)[: len(x)]
    exact = np.exp(x.astype(np.float64)).astype(np.float32)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - exact.view(np.int32))
    assert ulps.max() <= 2
    assert (ulps == 0).mean() > 0.85
    edges = np.array([0, -0.0, -88, -1000, -np.inf, 89, np.inf, np.nan], np.float32)
    got = _wexp(edges)[: len(edges)]
    np.testing.assert_array_equal(got[:6], [1, 1, 0, 0, 0, np.inf])
    assert got[6] == np.inf
    assert np.isnan(got[7])


def test_the_softmax_exponential_is_the_same_bits_at_or_below_zero() -> None:
    """``wexp_nonpositive`` (the softmax's ``exp(s - max)``) leaves out only what ``wexp``
    does above 0: the same bits for every argument at or below 0, and for NaN."""
    rng = np.random.default_rng(23)
    x = np.concatenate(
        [
            -rng.exponential(3.0, 100_000),
            rng.uniform(-88, -86, 10_000),
            [0, -0.0, -1e-30, -87.33654, -87.33655, -88, -1000, -np.inf, np.nan],
        ]
    ).astype(np.float32)
    got, want = _wexp(x, nonpositive=True)[: len(x)], _wexp(x)[: len(x)]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_lane_sums_from_their_first_level_are_wsums_bits() -> None:
    """The score tiles' sums across lanes (``simd_sums``: the first level in registers,
    the rest sixteen keys at a time) are ``simd.wsums``' bit for bit, on sums whose
    order shows: magnitudes from 1e-8 to 1e8 of both signs."""
    from numba import njit

    from meshnode.engine.cpu.simd import wload, wstore, wsums
    from meshnode.engine.cpu.simd_sums import wpair, wsums_pairs

    @njit
    def both(x, out):  # type: ignore[no-untyped-def]
        v0, v1, v2, v3 = wload(x, 0), wload(x, 16), wload(x, 32), wload(x, 48)
        v4, v5, v6, v7 = wload(x, 64), wload(x, 80), wload(x, 96), wload(x, 112)
        v8, v9, v10, v11 = wload(x, 128), wload(x, 144), wload(x, 160), wload(x, 176)
        v12, v13, v14, v15 = wload(x, 192), wload(x, 208), wload(x, 224), wload(x, 240)
        whole = (v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
        wstore(out, 0, wsums(whole))
        pairs = (
            wpair(v0, v1), wpair(v2, v3), wpair(v4, v5), wpair(v6, v7),
            wpair(v8, v9), wpair(v10, v11), wpair(v12, v13), wpair(v14, v15),
        )  # fmt: skip
        wstore(out, 16, wsums_pairs(pairs))

    rng = np.random.default_rng(29)
    for _ in range(20):
        scale = 10.0 ** rng.uniform(-8, 8, 256)
        x = (rng.standard_normal(256) * scale).astype(np.float32)
        out = np.empty(32, np.float32)
        both(x, out)
        np.testing.assert_array_equal(out[16:].view(np.uint32), out[:16].view(np.uint32))
