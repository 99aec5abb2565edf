"""The CUDA stage over a pool of KV blocks (issue 30), run without a GPU.

As ``test_ops_cuda_stage.py``: host arrays stand in for CuPy arrays and each kernel is its
NumPy reference, which reads and writes a position at the row its sequence's block table
names (``kernels.kv_row``), through the table's address in the step array, as the kernels
do. A sequence's blocks sit in scattered slots of the pool, so a wrong row is a wrong
value: the checks are bit for bit against contiguous caches (whose table is the identity),
alone and batched, and for a prefix one sequence stored and another resumes from (by
reference), with a rollback into a shared block (copy-on-write) and a rejected draft.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnode.engine import Stage
from meshnode.engine.kv_cache import KV_BLOCK
from meshnode.engine.kv_pages import BlockPool, PagedCache
from meshnode.engine.model import BatchRow
from meshnode.engine.prefix_cache import PrefixPool
from meshnode.node.prefix import StagePrefix, pool_blocks
from tests.engine.test_ops_cuda_batch import MIXED, Seq, run_sequences
from tests.engine.test_ops_cuda_stage import (
    IDS,
    HostArray,
    _reference_kernels,  # noqa: F401 (the autouse fixture: kernels replaced by references)
    _stages,
)

CONTEXT = 128
PROMPT = (IDS * 5)[:64]  # two full blocks: the shared prefix
SUFFIX = [41, 42, 43, 44, 45, 46]
# MIXED, and a decode row whose cache spans two blocks
SEQS: list[Seq] = [*MIXED, ((IDS * 3)[:40], 40, [79], 1)]


def scattered_pool(stage: Stage, capacity: int = 16) -> BlockPool:
    """A pool on ``stage``'s device for its layers, its free slots handed out in a
    scrambled order, so a sequence's blocks are not consecutive."""
    c, layers = stage.config, stage.end - stage.start
    dtype = stage.new_cache(1).k.dtype
    pool = BlockPool(layers, c.num_kv_heads, c.head_dim, capacity, dtype, xp=stage.xp)
    slots = [pool.take() for _ in range(capacity)]
    for slot in np.random.default_rng(3).permutation(slots):
        pool.drop(int(slot))
    return pool


def slot_rows(slots: list[int]) -> list[int]:
    """The pool rows of ``slots``, in order."""
    return [s * KV_BLOCK + r for s in slots for r in range(KV_BLOCK)]


def in_order(stage: Stage, cache: Any) -> list[np.ndarray]:
    """A cache's K and V ``[L, Hkv, length, D]`` on the host, positions in order (a paged
    cache's through its table)."""
    n, host = cache.length, stage.backend.to_numpy
    if not isinstance(cache, PagedCache):
        return [host(cache.k)[:, :, :n], host(cache.v)[:, :, :n]]
    return [host(a)[:, :, slot_rows(cache.slots())[:n]] for a in (cache.k, cache.v)]


def check_paged_batches(gpu: Stage, monkeypatch: pytest.MonkeyPatch, rounds: int = 2) -> None:
    """SEQS over contiguous caches, alone, then over a scattered pool ``rounds`` times,
    batched and alone in turn: the same outputs and K/V, bit for bit."""
    host = gpu.backend.to_numpy
    want = run_sequences(gpu, SEQS, batched=False, context=64)
    pool = scattered_pool(gpu)
    monkeypatch.setattr(gpu, "new_cache", lambda n: PagedCache(pool, n))
    for i in range(rounds):
        got = run_sequences(gpu, SEQS, batched=i % 2 == 0, context=64)
        for (out, cache), (want_out, want_cache) in zip(got, want, strict=True):
            assert isinstance(cache, PagedCache)
            np.testing.assert_array_equal(host(out), host(want_out))
            assert cache.length == want_cache.length
            for x, y in zip(in_order(gpu, cache), in_order(gpu, want_cache), strict=True):
                np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(host(cache.device_blocks), cache.blocks)
            assert not cache.blocks_stale
        slots = [s for _, c in got for s in c.slots()]
        assert len(set(slots)) == len(slots)  # no two sequences share a written block
        two = got[-1][1].slots()
        assert len(two) == 2
        assert two[1] != two[0] + 1  # not in consecutive slots
        for _, cache in got:
            cache.release_pages()
    assert pool.free_blocks == pool.capacity


@pytest.mark.parametrize(("qtype", "dtype"), [("Q8_0", "float32"), ("Q4_K", "float16")])
def test_paged_caches_give_the_contiguous_bits_alone_and_batched(
    tiny_gguf: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, qtype: str, dtype: str
) -> None:
    """Decode rows (one over two blocks), a verify window that rolls back 3 positions and
    a short prompt, each sequence's blocks scattered over the pool: outputs and K/V
    (float32, float16 bits) are those of contiguous caches, batched in one forward or run
    alone; the device copies of the tables are the tables."""
    _, (gpu,) = _stages(tiny_gguf, qtype, dtype)
    check_paged_batches(gpu, monkeypatch)


def _reference(gpu: Stage, start: int, tokens: list[int]) -> list[np.ndarray]:
    """Outputs of a contiguous cache that computed PROMPT in one forward, then ``tokens``
    from ``start`` (a rollback below 64 when less), then two decode steps."""
    host, cache = gpu.backend.to_numpy, gpu.new_cache(CONTEXT)
    gpu.forward(np.array(PROMPT), 0, cache)
    outs = [host(gpu.forward(np.array(tokens), start, cache))]
    for i, t in enumerate([77, 78]):
        outs.append(host(gpu.forward(np.array([t]), start + len(tokens) + i, cache)))
    return outs


def _paged(stage: Stage, tokens: list[int], start: int, cache: PagedCache) -> Any:
    """``stage.forward`` over a paged cache."""
    return stage.forward_batch([BatchRow(np.array(tokens), start, cache, None)])[0]


def check_cached_prefix(gpu: Stage) -> None:
    """The scenario of :func:`test_a_cached_prefix_gives_the_bits_of_computing_it`."""
    host, pool = gpu.backend.to_numpy, scattered_pool(gpu)
    cached = PrefixPool(pool, "run", pool.capacity)
    a = PagedCache(pool, CONTEXT)
    _paged(gpu, PROMPT, 0, a)
    _paged(gpu, [9, 8, 7], 64, a)  # A's own tail, in a block of its own
    keys = cached.store(PROMPT, a, 0)
    assert len(keys) == 2
    _paged(gpu, [5, 6], 67, a)  # a draft, rejected: rolled back
    a.truncate(67)
    shared = a.slots()[:2]
    frozen = [host(x)[:, :, slot_rows(shared)] for x in (pool.k, pool.v)]
    a.release_pages()
    cached.trim()

    b, other = PagedCache(pool, CONTEXT), PagedCache(pool, CONTEXT)
    _paged(gpu, IDS, 0, other)
    tokens, _ = cached.acquire(keys[-1], b)
    assert tokens == PROMPT
    assert b.slots() == shared  # by reference: no copy
    first = gpu.forward_batch(
        [BatchRow(np.array(SUFFIX), 64, b, None), BatchRow(np.array([70]), len(IDS), other, 1)]
    )[0]
    got = [host(first)]
    got += [host(_paged(gpu, [t], 70 + i, b)) for i, t in enumerate([77, 78])]
    for x, y in zip(got, _reference(gpu, 64, SUFFIX), strict=True):
        np.testing.assert_array_equal(x, y)

    c = PagedCache(pool, CONTEXT)
    cached.acquire(keys[-1], c)
    redo = [50, 51, 52, 53]  # from 60: into the shared second block
    got = [host(_paged(gpu, redo, 60, c))]
    got += [host(_paged(gpu, [t], 64 + i, c)) for i, t in enumerate([77, 78])]
    assert c.slots()[0] == shared[0]
    assert c.slots()[1] != shared[1]  # copy-on-write
    for x, y in zip(got, _reference(gpu, 60, redo), strict=True):
        np.testing.assert_array_equal(x, y)
    now = [host(x)[:, :, slot_rows(shared)] for x in (pool.k, pool.v)]
    for before, after in zip(frozen, now, strict=True):
        np.testing.assert_array_equal(before, after)


def test_a_cached_prefix_gives_the_bits_of_computing_it(tiny_gguf: Callable[[str], Path]) -> None:
    """Sequence A computes the prompt, keys its two full blocks and ends after a rejected
    draft; B resumes from them by reference, batched beside another sequence's decode
    row; C resumes and rolls back into the shared last block (copied first). Each gives
    the outputs of a contiguous cache that computed the prompt itself (the same forwards:
    a CUDA row's bits depend on whether its prompt chunk took the matvec or the matmul),
    and the cached blocks never change."""
    _, (gpu,) = _stages(tiny_gguf, "Q8_0", "float32")
    check_cached_prefix(gpu)


def test_a_cuda_stage_keeps_its_pool_on_the_device(tiny_gguf: Callable[[str], Path]) -> None:
    """The stage's prefix cache (``StagePrefix.for_stage``) on a CUDA stage: a pool of the
    same blocks as a CPU stage's, its arrays the device's, its caches paged."""
    _, (gpu,) = _stages(tiny_gguf, "Q8_0", "float16")
    prefix = StagePrefix.for_stage(gpu, CONTEXT, budget_bytes=None, salt="run")
    assert prefix.kv is not None
    assert prefix.pool is not None
    assert prefix.kv.capacity == pool_blocks(CONTEXT)
    assert isinstance(prefix.kv.k, HostArray)  # the stand-in's device array
    assert prefix.kv.k.dtype == np.uint16  # float16 bits, as the stage's own caches
    cache = prefix.new_cache(CONTEXT)
    assert isinstance(cache, PagedCache)
    assert isinstance(cache.device_blocks, HostArray)
