"""Paged KV: a stage's pool of fixed-size blocks, and sequences that hold a table of them.

Issue 30: a sequence used to hold one preallocated ``[L, Hkv, context, D]`` array, and a
cached prefix was copied into it. Here a stage keeps one :class:`BlockPool` (K and V each
``[L, Hkv, capacity x block, D]``: slot ``s`` of a head is its rows ``s x block ...``), and
a :class:`PagedCache` holds a block table, the slot of each of its blocks of positions. A
block that several sequences begin with (a shared system prompt, the earlier turns of a
chat) is one slot that each of their tables names: the prefix cache
(:mod:`meshnode.engine.prefix_cache`) keys full blocks and hands their slots to new
sequences, by reference, never copied.

Theory of operation:

- A slot is reference-counted: one for each table that names it, one for the prefix
  cache's index while it keys it. A slot no one references is free; a slot only the index
  references is cached and is evicted (least recently used) when a sequence needs a block
  and none is free (:attr:`BlockPool.reclaim`).
- A sequence writes only into slots it alone references. Full blocks are shared, so
  writing past the end never touches a shared one; after a rollback into a shared block
  (a refold) the block is copied first (copy-on-write, :meth:`PagedCache.reserve`).
  Truncating (a rejected draft) drops the references of the blocks past the new end: the
  sequence's own slots go back to the pool, a shared one stays with its other holders.
- The compiled attention kernels read K/V through the table
  (:func:`meshnode.engine.cpu.attention_rows.slot_row`), in the order of positions: the
  same bits as a contiguous cache. The NumPy/BLAS path (:meth:`PagedCache.write`) gets a
  sequence's keys and values gathered in position order (a view when its slots are
  consecutive): the same arrays, so the same products.

On a CUDA stage (``xp`` CuPy) the pool's arrays are on the device and a cache keeps a
copy of its table there too (:attr:`PagedCache.device_blocks`, at a fixed address for the
cache's life); the stage copies it in before a forward whenever the table changed
(:attr:`PagedCache.blocks_stale`; :meth:`meshnode.engine.cuda.ops.CudaAttention.prepare`),
and its kernels read K/V through it (``kernels``: ``kv_row``). The table a captured CUDA
graph reads is thus data, never a captured pointer. :meth:`PagedCache.write` and
:meth:`PagedCache.gather` are the NumPy path's only.

Not thread-safe (the stage runner serializes its calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from itertools import pairwise
from typing import Any

import numpy as np

from meshnode.engine.kv_cache import KV_BLOCK, lazy_zeros

__all__ = ["BlockPool", "PagedCache", "block_bytes"]


def block_bytes(
    layers: int, kv_heads: int, head_dim: int, dtype: Any, block: int = KV_BLOCK
) -> int:
    """Bytes of one block of K and V for ``layers`` layers."""
    return 2 * layers * kv_heads * block * head_dim * int(np.dtype(dtype).itemsize)


class BlockPool:
    """A stage's K/V blocks (module docstring): ``k`` and ``v`` ``[L, Hkv, capacity x
    block, D]`` of ``xp`` (on the CPU taking memory as slots are first written; on a device
    allocated whole) and a reference count per slot. ``reclaim``, when set, frees one
    cached slot (True) or finds none (False)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: Any = np.float32,
        block: int = KV_BLOCK,
        *,
        xp: Any = np,
    ) -> None:
        if capacity < 0 or block < 1:
            raise ValueError(f"bad KV pool: {capacity} blocks of {block} positions")
        self.xp, self.block = xp, block
        shape = (layers, kv_heads, capacity * block, head_dim)
        self.k = lazy_zeros(xp, shape, dtype)
        self.v = lazy_zeros(xp, shape, dtype)
        self.refs = [0] * capacity
        self._free = list(range(capacity))[::-1]
        self.reclaim: Callable[[], bool] | None = None
        self._scratch = np.empty(0, np.float32)

    def scratch(self, floats: int) -> np.ndarray:
        """A float32 buffer of ``floats`` that the next call reuses: where the BLAS path's
        gathered keys and values go (:meth:`PagedCache.write`), so each layer's copy does
        not first-touch fresh pages (1 ms a layer for SmolLM2 at 1,600 positions). It
        grows to the longest sequence read, as the transient copies it replaces did."""
        if self._scratch.size < floats:
            self._scratch = np.empty(max(floats, self._scratch.size * 5 // 4), np.float32)
        return self._scratch[:floats]

    @property
    def capacity(self) -> int:
        """Slots the pool holds."""
        return len(self.refs)

    @property
    def free_blocks(self) -> int:
        """Slots no one references."""
        return len(self._free)

    def nbytes(self) -> int:
        """Bytes allocated for the pool's blocks."""
        return int(self.k.nbytes + self.v.nbytes)

    def take(self) -> int:
        """A free slot, referenced once; a cached one is evicted if none is free. Raises
        ``ValueError`` when every slot is in use."""
        while not self._free:
            if self.reclaim is None or not self.reclaim():
                raise ValueError(f"KV pool full: all {self.capacity} blocks are in use")
        slot = self._free.pop()
        self.refs[slot] = 1
        return slot

    def hold(self, slot: int) -> None:
        """One more reference to ``slot``."""
        self.refs[slot] += 1

    def drop(self, slot: int) -> None:
        """One reference less to ``slot``; freed at none."""
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._free.append(slot)
        assert self.refs[slot] >= 0, f"slot {slot} dropped more than held"

    def copy(self, src: int, dst: int, rows: int) -> None:
        """The first ``rows`` positions of slot ``src`` into slot ``dst`` (every layer).
        On a device the copy is complete on return: it runs on the caller's stream (CuPy's
        current), which the stage's own stream does not wait for."""
        b = self.block
        for a in (self.k, self.v):
            a[:, :, dst * b : dst * b + rows] = a[:, :, src * b : src * b + rows]
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()


class PagedCache:
    """One sequence's K/V in a :class:`BlockPool`, with the interface of
    :class:`~meshnode.engine.kv_cache.KVCache` (``k``/``v`` are the pool's arrays,
    ``blocks`` the table the kernels read, ``device_blocks`` its copy on a device); see the
    module docstring."""

    def __init__(self, pool: BlockPool, max_tokens: int) -> None:
        self.pool, self.max_tokens, self.block = pool, max_tokens, pool.block
        self.k, self.v = pool.k, pool.v
        self.blocks = np.zeros(-(-max_tokens // pool.block), np.int64)
        xp = pool.xp
        self.device_blocks = None if xp is np else xp.asarray(self.blocks)
        self.blocks_stale = False  # ``blocks`` changed since ``device_blocks`` was copied
        self.held = 0  # leading entries of the table that name a slot
        self.length = 0

    def slots(self) -> list[int]:
        """The slots of the blocks held, in position order."""
        return [int(s) for s in self.blocks[: self.held]]

    def truncate(self, n: int) -> None:
        """Forget every position from ``n`` on, dropping the blocks past it; raises
        ``ValueError`` if ``n > length``."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        keep = -(-n // self.block)
        for i in reversed(range(keep, self.held)):  # retaken in order: consecutive slots
            self.pool.drop(int(self.blocks[i]))
        self.held, self.length = min(self.held, keep), n

    def adopt(self, slots: Sequence[int]) -> None:
        """Begin an empty cache with the full blocks ``slots`` (a cached prefix), each
        referenced once more. Raises ``ValueError`` unless the cache is empty."""
        if self.held or self.length or len(slots) * self.block > self.max_tokens:
            raise ValueError("a cached prefix seeds an empty cache of room for it")
        for i, slot in enumerate(slots):
            self.pool.hold(slot)
            self.blocks[i] = slot
        self.blocks_stale = True
        self.held = len(slots)
        self.length = self.held * self.block

    def reserve(self, end: int) -> None:
        """Hold a private slot for every block a forward writes, positions ``length`` to
        ``end``: a shared block being extended is copied first. Raises ``ValueError`` past
        :attr:`max_tokens` or when the pool has no block to give."""
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} > {self.max_tokens} tokens")
        b, pool = self.block, self.pool
        part = self.length % b
        if part and end > self.length:
            last = int(self.blocks[self.held - 1])
            if pool.refs[last] > 1:  # copy-on-write
                mine = pool.take()
                pool.copy(last, mine, part)
                pool.drop(last)
                self.blocks[self.held - 1] = mine
                self.blocks_stale = True
        while self.held * b < end:
            self.blocks[self.held] = pool.take()
            self.held += 1
            self.blocks_stale = True

    def advance(self, start: int, rows: int) -> None:
        """Record a forward of ``rows`` new positions from ``start``."""
        self.length = start + rows

    def write(self, layer: int, start: int, k: Any, v: Any) -> tuple[Any, Any]:
        """As :meth:`KVCache.write <meshnode.engine.kv_cache.KVCache.write>`: store ``k, v``
        ``[Hkv, S, D]`` at ``start`` (their blocks :meth:`reserve`\\ d) and return keys and
        values ``[Hkv, start + S, D]`` in position order."""
        end, b = start + k.shape[1], self.block
        self.reserve(end)
        for i in range(start // b, -(-end // b)):
            lo, hi = max(start, i * b), min(end, (i + 1) * b)
            row = int(self.blocks[i]) * b + lo - i * b
            self.k[layer, :, row : row + hi - lo] = k[:, lo - start : hi - start]
            self.v[layer, :, row : row + hi - lo] = v[:, lo - start : hi - start]
        return self._gather(layer, end, np.dtype(np.float32), reuse=True)

    def gather(self, layer: int, end: int, dtype: Any = None) -> tuple[Any, Any]:
        """Keys and values ``[Hkv, end, D]`` of ``layer``, positions in order, in ``dtype``
        (None: the pool's): a view when the blocks sit in consecutive slots and keep their
        dtype, else a copy (widened on the way), a run of consecutive slots at a time."""
        return self._gather(layer, end, self.k.dtype if dtype is None else np.dtype(dtype))

    def _gather(self, layer: int, end: int, dtype: Any, reuse: bool = False) -> tuple[Any, Any]:
        # Issue 30: a resumed sequence's table is a few runs (each earlier turn's blocks).
        # A copy row by row (NumPy's fancy index), widening float16 value by value and
        # first-touching fresh pages cost up to 6 ms a layer at 1,600 positions, a tenth
        # of a chat turn's first token; ``reuse`` copies float32 into the pool's scratch
        # (:meth:`BlockPool.scratch`: what :meth:`write` returns is read before the next).
        b, n = self.block, -(-end // self.block)
        starts = [0, *(np.flatnonzero(np.diff(self.blocks[:n]) != 1) + 1).tolist(), n]
        if len(starts) <= 2 and dtype == self.k.dtype:  # one run (or none): a view
            row = int(self.blocks[0]) * b if n else 0
            return self.k[layer, :, row : row + end], self.v[layer, :, row : row + end]
        # (first table entry, slot, rows) of each run
        runs = [(i, int(self.blocks[i]), min(j * b, end) - i * b) for i, j in pairwise(starts)]
        heads, dim = self.k.shape[1], self.k.shape[3]
        size = heads * end * dim
        reuse = reuse and dtype == np.float32
        flat = self.pool.scratch(2 * size) if reuse else np.empty(2 * size, dtype)
        got = [flat[:size].reshape(heads, end, dim), flat[size:].reshape(heads, end, dim)]
        if _widens(self.k.dtype, dtype, dim):
            spans = self._spans(layer, runs, end)
            rows = _kv_rows()
            for kv, out in zip((self.k, self.v), got, strict=True):
                rows.widen_spans(kv.view(np.uint16), out.reshape(-1), spans)
            return got[0], got[1]
        for kv, out in zip((self.k[layer], self.v[layer]), got, strict=True):
            for i, slot, count in runs:
                out[:, i * b : i * b + count] = kv[:, slot * b : slot * b + count]
        return got[0], got[1]

    def _spans(self, layer: int, runs: list[tuple[int, int, int]], end: int) -> np.ndarray:
        """``(src, dst, n)`` flat float offsets of each run of each head (:mod:`.cpu.kv_rows`)."""
        _, heads, rows, dim = self.k.shape
        h = np.arange(heads)[:, None]
        first = np.array([[slot * self.block, i * self.block, count] for i, slot, count in runs])
        src = ((layer * heads + h) * rows + first[:, 0]) * dim  # [Hkv, runs]
        dst = (h * end + first[:, 1]) * dim
        n = np.broadcast_to(first[:, 2] * dim, src.shape)
        return np.stack([src, dst, n], axis=-1).reshape(-1, 3).astype(np.int64)

    def release_pages(self) -> None:
        """Empty the cache, its blocks back to the pool (or kept by their other holders)."""
        self.truncate(0)

    def nbytes(self) -> int:
        """Bytes of the blocks this cache holds (shared ones counted whole)."""
        return self.held * block_bytes(
            self.k.shape[0], self.k.shape[1], self.k.shape[3], self.k.dtype, self.block
        )


def _widens(stored: Any, dtype: Any, dim: int) -> bool:
    """Whether :meth:`PagedCache.gather` widens through the compiled copy
    (:mod:`meshnode.engine.cpu.kv_rows`): a float16 pool read as float32, heads of whole
    sixteen-lane steps."""
    return stored == np.float16 and dtype == np.float32 and dim % 16 == 0


@cache
def _kv_rows() -> Any:
    """The compiled copy's module, imported (numba with it) at the first widening gather."""
    from meshnode.engine.cpu import kv_rows as module

    return module
