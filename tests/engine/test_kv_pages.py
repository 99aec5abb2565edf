"""Paged KV (engine.kv_pages) against the contiguous cache (engine.kv_cache.KVCache).

The same forwards, through ``KernelAttention`` (decode, verify windows and short prompts
in the compiled kernel; long prompts through BLAS), on sequences whose blocks sit in
scrambled slots of a pool and on sequences with one array each: the outputs and the cached
keys and values are the same bits, alone, batched, with sliding windows, after rollbacks,
with shared prefix blocks (copy-on-write after a rollback into one), on one and on more
kernel threads. Many sequences of random lengths over a pool too small for all of them:
the one that finds no block is refused; no other sequence's output changes.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from meshnode.engine.attention import KernelAttention, Segment
from meshnode.engine.config import ModelConfig
from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.pool import CoreGauge, KernelPool
from meshnode.engine.kv_cache import KV_BLOCK, KVCache
from meshnode.engine.kv_pages import BlockPool, PagedCache
from tests.engine.test_cpu_attention import KV, KV_IDS, LAYERS, SHAPES, Shape, _config, _norms

CONTEXT = 320


def _pool(c: ModelConfig, blocks: int, dtype: type, rng: np.random.Generator) -> BlockPool:
    """A pool whose free slots are handed out in a random order (every slot taken once,
    then dropped shuffled), so that a sequence's blocks are never consecutive by luck."""
    pool = BlockPool(LAYERS, c.num_kv_heads, c.head_dim, blocks, dtype)
    slots = [pool.take() for _ in range(blocks)]
    for s in rng.permutation(slots):
        pool.drop(int(s))
    return pool


class Pair:
    """Sequences held both ways: ``flat[i]`` a contiguous cache, ``paged[i]`` a paged one."""

    def __init__(self, c: ModelConfig, count: int, dtype: type, pool: BlockPool) -> None:
        self.c, self.pool = c, pool
        self.attn = KernelAttention(np, c, 0, LAYERS)
        self.flat = [
            KVCache(np, LAYERS, c.num_kv_heads, c.head_dim, CONTEXT, dtype=dtype)
            for _ in range(count)
        ]
        self.paged = [PagedCache(pool, CONTEXT) for _ in range(count)]

    def run(
        self,
        parts: list[tuple[int, int, int]],
        qkvs: list[np.ndarray],
        norms: tuple[object, object],
    ) -> list[np.ndarray]:
        """One forward of every layer of ``(sequence, start, kept rows)`` on both sides;
        their outputs and caches must be the same bits. The paged side's outputs."""
        outs = []
        for caches in (self.flat, self.paged):
            segs = []
            for (i, start, kept), qkv in zip(parts, qkvs, strict=True):
                caches[i].truncate(start)
                caches[i].reserve(start + len(qkv))
                segs.append(Segment(start, len(qkv), kept, caches[i]))
            plan = self.attn.prepare(segs)
            qkv = np.concatenate(qkvs)
            layer_outs = [
                self.attn(qkv, segs, plan, layer, norms, layer == LAYERS - 1)
                for layer in range(LAYERS)
            ]
            for seg in segs:
                seg.cache.advance(seg.start_pos, seg.n)
            outs.append(layer_outs)
        for a, b in zip(*outs, strict=True):
            np.testing.assert_array_equal(a, b)
        self.check(i for i, _, _ in parts)
        return outs[1]

    def check(self, which: object = None) -> None:
        for i in range(len(self.flat)) if which is None else which:  # type: ignore[attr-defined]
            flat, paged = self.flat[i], self.paged[i]
            assert flat.length == paged.length
            for layer in range(LAYERS):
                k, v = paged.gather(layer, paged.length)
                np.testing.assert_array_equal(k, flat.k[layer, :, : flat.length])
                np.testing.assert_array_equal(v, flat.v[layer, :, : flat.length])


def _qkv(c: ModelConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((n, c.q_size + 2 * c.kv_size)).astype(np.float32)


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_paged_sequences_are_the_same_bits_as_contiguous_ones(shape: Shape, dtype: type) -> None:
    """Prefills long (BLAS) and short (kernel), then batches mixing decode rows and verify
    windows, with rollbacks, across many block boundaries (and sliding windows whose first
    key is anywhere in a block)."""
    c = _config(shape)
    rng = np.random.default_rng(31)
    norms = _norms(c, shape.qk_norm, rng)
    pair = Pair(c, 3, dtype, _pool(c, 3 * CONTEXT // KV_BLOCK, dtype, rng))
    lengths = [70, 9, 40]
    pair.run([(i, 0, n) for i, n in enumerate(lengths)], [_qkv(c, n, rng) for n in lengths], norms)
    slots = pair.paged[0].slots()
    assert np.any(np.diff(slots) != 1), "scrambled: the table is not the identity"
    for step in range(12):
        sizes = [1, 1 + step % 5, 16 if step % 4 == 0 else 1]
        starts = [n - (step % 3 == 1 and i == 1) for i, n in enumerate(lengths)]  # rollbacks
        parts = [(i, s, n) for i, (s, n) in enumerate(zip(starts, sizes, strict=True))]
        pair.run(parts, [_qkv(c, n, rng) for n in sizes], norms)
        lengths = [s + n for s, n in zip(starts, sizes, strict=True)]
    pair.run([(2, lengths[2], 40)], [_qkv(c, 40, rng)], norms)  # a long suffix: BLAS


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
def test_shared_prefix_blocks_are_read_in_place_and_copied_before_a_write(dtype: type) -> None:
    """Sequence 1 begins with sequence 0's first two blocks by reference (its contiguous
    twin with a copy of them); both go on; sequence 1 rolls back into a shared block and
    rewrites it: its block is copied first, sequence 0 reads what it wrote."""
    c = _config(SHAPES[1])
    rng = np.random.default_rng(5)
    norms = _norms(c, False, rng)
    pool = _pool(c, 40, dtype, rng)
    pair = Pair(c, 2, dtype, pool)
    pair.run([(0, 0, 80)], [_qkv(c, 80, rng)], norms)
    shared = pair.paged[0].slots()[:2]
    pair.paged[1].adopt(shared)
    flat0, flat1 = pair.flat
    flat1.k[:, :, : 2 * KV_BLOCK] = flat0.k[:, :, : 2 * KV_BLOCK]
    flat1.v[:, :, : 2 * KV_BLOCK] = flat0.v[:, :, : 2 * KV_BLOCK]
    flat1.length = 2 * KV_BLOCK
    assert [pool.refs[s] for s in shared] == [2, 2]
    pair.run([(1, 64, 1), (0, 80, 4)], [_qkv(c, 1, rng), _qkv(c, 4, rng)], norms)
    assert pair.paged[1].slots()[:2] == shared  # read in place
    pair.run([(1, 40, 3)], [_qkv(c, 3, rng)], norms)  # rollback into shared block 1
    mine = pair.paged[1].slots()
    assert mine[0] == shared[0]
    assert mine[1] != shared[1]  # copied on write
    assert [pool.refs[s] for s in shared] == [2, 1]
    pair.run([(0, 84, 1), (1, 43, 2)], [_qkv(c, 1, rng), _qkv(c, 2, rng)], norms)
    pair.check()
    for cache in pair.paged:
        cache.release_pages()
    assert pool.free_blocks == pool.capacity


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
def test_paged_on_the_kernel_threads_is_the_same_bits(
    dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows and windows over ~200 positions shared with two kernel threads: the
    same bits as the contiguous caches (on the same threads)."""
    c = _config(SHAPES[2])
    rng = np.random.default_rng(7)
    norms = _norms(c, True, rng)
    kernel_pool = KernelPool(CoreGauge(Path("/nonexistent/stat"), cpus=set(range(4))))
    monkeypatch.setattr(matrix, "_pool", lambda: kernel_pool)
    monkeypatch.setattr(matrix, "_threads", 2)
    pair = Pair(c, 4, dtype, _pool(c, 4 * CONTEXT // KV_BLOCK, dtype, rng))
    lengths = [190 + 7 * i for i in range(4)]
    pair.run([(i, 0, n) for i, n in enumerate(lengths)], [_qkv(c, n, rng) for n in lengths], norms)
    before = kernel_pool.posted
    sizes = [1, 8, 16, 1]
    parts = [(i, n, k) for i, (n, k) in enumerate(zip(lengths, sizes, strict=True))]
    pair.run(parts, [_qkv(c, n, rng) for n in sizes], norms)
    assert kernel_pool.posted > before


def _reserve_all(pair: Pair, batch: list[int], lengths: list[int], sizes: list[int]) -> None:
    for i, n in zip(batch, sizes, strict=True):
        pair.paged[i].reserve(lengths[i] + n)


def test_an_exhausted_pool_refuses_one_sequence_and_corrupts_none() -> None:
    """Twelve sequences of random lengths, in random batches, share a pool of a third of
    what they would hold at once: a forward whose sequence finds no block is refused
    (ValueError, before anything is computed); every forward that runs is the same bits
    as on contiguous caches, and the refused sequence, once others end, goes on."""
    c = _config(SHAPES[0])
    rng = np.random.default_rng(23)
    norms = _norms(c, False, rng)
    count = 12
    pool = _pool(c, count * 6 // 3, np.float32, rng)
    pair = Pair(c, count, np.float32, pool)
    lengths = [0] * count
    refused = 0
    for _ in range(60):
        batch = sorted(rng.choice(count, size=int(rng.integers(1, 4)), replace=False))
        sizes = [int(rng.choice([1, 3, 16, 24])) for _ in batch]
        if any(lengths[i] + n > 6 * KV_BLOCK for i, n in zip(batch, sizes, strict=True)):
            for i in batch:  # a sequence that would outgrow its share ends
                pair.flat[i].truncate(0)
                pair.paged[i].truncate(0)
                lengths[i] = 0
            continue
        need = sum(
            -(-(lengths[i] + n) // KV_BLOCK) - pair.paged[i].held
            for i, n in zip(batch, sizes, strict=True)
        )
        if need > pool.free_blocks:
            with pytest.raises(ValueError, match="KV pool full"):
                _reserve_all(pair, batch, lengths, sizes)
            refused += 1
            victim = int(np.argmax(lengths))  # make room: the longest sequence ends
            pair.flat[victim].truncate(0)
            pair.paged[victim].truncate(0)
            lengths[victim] = 0
            continue
        parts = [(int(i), lengths[i], n) for i, n in zip(batch, sizes, strict=True)]
        pair.run(parts, [_qkv(c, n, rng) for n in sizes], norms)
        for i, n in zip(batch, sizes, strict=True):
            lengths[i] += n
    assert refused > 0
    pair.check()
    held = sum(cache.held for cache in pair.paged)
    assert pool.free_blocks == pool.capacity - held


def _garbage(*caches: object) -> None:
    """NaN in every position of ``caches`` (pools or contiguous caches) no forward wrote
    yet: a read of one shows as NaN, not as a plausible number."""
    for cache in caches:
        cache.k[...] = np.nan  # type: ignore[attr-defined]
        cache.v[...] = np.nan  # type: ignore[attr-defined]


def test_threaded_paged_attention_is_exact_when_the_pool_runs_a_task_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 30's race, made to happen: the kernel pool's caller redoes a chunk that a
    helper still holds after its patience (a helper descheduled on a busy machine), and
    the helper may finish it after the caller has returned, so every task may run twice
    at once and must write its output as final values only (an 8-row window
    summed into its output, zeroed by the other run, gave wrong values in CI). Patience
    of ~nothing makes the caller redo every chunk a helper holds; 2 and 3 threads; each
    iteration fresh pools of scrambled slots and NaN wherever nothing was written, random
    prompt lengths, then batches of decode rows and windows of up to 16 rows: the same
    bits as the contiguous caches, and finite. Bounded: 120 iterations or 40 s."""
    kernel_pool = KernelPool(CoreGauge(Path("/nonexistent/stat"), cpus=set(range(4))))
    kernel_pool.set_waits(patience_us=0.0, spin_us=2000.0)  # helpers stay to claim
    monkeypatch.setattr(matrix, "_pool", lambda: kernel_pool)
    rng = np.random.default_rng(30)
    deadline = None
    for it in range(120):
        if deadline is not None and time.monotonic() > deadline:
            break
        monkeypatch.setattr(matrix, "_threads", 2 + it % 2)
        shape, dtype = SHAPES[1 + it % 2], KV[it // 2 % 2]
        c = _config(shape)
        norms = _norms(c, shape.qk_norm, rng)
        pair = Pair(c, 4, dtype, _pool(c, 4 * CONTEXT // KV_BLOCK, dtype, rng))
        _garbage(pair.pool, *pair.flat)
        lengths = [int(n) for n in rng.integers(40, 200, 4)]
        pair.run(
            [(i, 0, n) for i, n in enumerate(lengths)], [_qkv(c, n, rng) for n in lengths], norms
        )
        for _ in range(2):
            sizes = [int(rng.choice([1, 2, 5, 8, 16])) for _ in lengths]
            parts = [(i, n, k) for i, (n, k) in enumerate(zip(lengths, sizes, strict=True))]
            outs = pair.run(parts, [_qkv(c, n, rng) for n in sizes], norms)
            assert all(np.isfinite(out).all() for out in outs)
            lengths = [n + k for n, k in zip(lengths, sizes, strict=True)]
        deadline = deadline or time.monotonic() + 40  # after the first: compiled
    assert kernel_pool.posted > it


@pytest.mark.parametrize("dtype", KV, ids=KV_IDS)
@pytest.mark.parametrize("dim", [64, 24], ids=["compiled", "numpy"])
def test_gathered_runs_are_the_rows_in_position_order(dtype: type, dim: int) -> None:
    """A resumed sequence's table is runs of consecutive slots (issue 30): ``gather`` and
    what ``write`` returns (float32, in the pool's scratch) are the rows the table names,
    in order, widened exactly, at every length, whatever the run boundaries."""
    rng = np.random.default_rng(7)
    pool = BlockPool(3, 2, dim, 24, dtype)
    pool.k[...] = rng.standard_normal(pool.k.shape).astype(dtype)
    pool.v[...] = rng.standard_normal(pool.v.shape).astype(dtype)
    first, other = PagedCache(pool, 16 * KV_BLOCK), PagedCache(pool, KV_BLOCK)
    first.reserve(5 * KV_BLOCK)
    other.reserve(1)  # the next turn's blocks do not follow the prefix's
    seq = PagedCache(pool, 16 * KV_BLOCK)
    seq.adopt(first.slots())
    seq.reserve(9 * KV_BLOCK)
    assert np.count_nonzero(np.diff(seq.slots()) != 1) == 1
    rows = (np.array(seq.slots())[:, None] * KV_BLOCK + np.arange(KV_BLOCK)).reshape(-1)
    for end in (1, KV_BLOCK, 5 * KV_BLOCK, 5 * KV_BLOCK + 1, 9 * KV_BLOCK - 3):
        for layer in range(3):
            want = [a[layer][:, rows[:end]] for a in (pool.k, pool.v)]
            for kind in (dtype, np.float32):
                for g, w in zip(seq.gather(layer, end, kind), want, strict=True):
                    assert g.dtype == kind
                    np.testing.assert_array_equal(g, w.astype(kind))
    k = rng.standard_normal((2, 3, dim)).astype(np.float32)
    seq.advance(0, 9 * KV_BLOCK - 3)
    seq.truncate(5 * KV_BLOCK + 2)
    keys, values = seq.write(1, 5 * KV_BLOCK + 2, k, -k)
    assert keys.dtype == values.dtype == np.float32
    assert keys.shape == (2, 5 * KV_BLOCK + 5, dim)
    np.testing.assert_array_equal(keys[:, -3:], k.astype(dtype))
    np.testing.assert_array_equal(values[:, -3:], (-k).astype(dtype))
    np.testing.assert_array_equal(keys[:, :KV_BLOCK], pool.k[1][:, rows[:KV_BLOCK]])
