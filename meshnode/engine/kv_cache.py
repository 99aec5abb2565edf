"""Per-sequence KV cache: preallocated, written in place, rolled back by truncation."""

from __future__ import annotations

import math
import mmap
from typing import Any

import numpy as np

from meshnode.errors import ConfigError

__all__ = [
    "KV_BLOCK",
    "KV_DTYPES",
    "KVCache",
    "kv_bytes",
    "kv_numpy_dtype",
    "lazy_zeros",
    "parse_kv_dtype",
    "resolve_kv_dtype",
]

#: What ``--kv-dtype`` takes: ``f32`` (float32 K/V: the exact modes need it), ``f16``
#: (float16: half the memory and half the bytes decode attention reads, keys and values
#: rounded to nearest; the CPU kernels widen them to float32 to compute), or ``auto``
#: (:func:`resolve_kv_dtype`).
KV_DTYPES = ("auto", "f32", "f16")
#: Positions per block of a cache's block table (:attr:`KVCache.blocks`): the unit a stage's
#: pool hands out and its prefix cache shares (:mod:`meshnode.engine.kv_pages`). vLLM uses
#: 16, SGLang 1 (a radix tree), llama-server a whole slot; 32 keeps the per-block
#: bookkeeping (a hash, a table entry) negligible next to the block's bytes (SmolLM2: 1.5
#: MiB per block at f32) while a prompt loses at most 31 positions of reuse. The compiled
#: kernels take a power of two.
KV_BLOCK = 32


def parse_kv_dtype(v: object) -> str:
    """A ``--kv-dtype`` setting (:data:`KV_DTYPES`, any case); raises ``ConfigError`` (a
    ``ValueError``) naming the choices."""
    s = str(v).lower() if isinstance(v, str) else v
    if s not in KV_DTYPES:
        raise ConfigError(f"KV dtype must be one of {', '.join(KV_DTYPES)}, got {v!r}")
    return str(s)


def resolve_kv_dtype(name: str, weights_dtype: str) -> str:
    """``f32`` or ``f16`` for a ``--kv-dtype`` of ``name`` beside weights of
    ``weights_dtype``: ``auto`` is f16 for ``q8`` (the CPU's default, inexact: its
    products already round every activation to 8 bits, so rounded K/V lose no guarantee,
    and KV bandwidth is what several streams' decode attention waits on; llama.cpp's
    default cache is f16 too) and f32 for every other, exact, mode (golden parity needs
    float32 K/V). Raises ``ConfigError`` (a ``ValueError``) for another name."""
    name = parse_kv_dtype(name)
    if name == "auto":
        return "f16" if weights_dtype == "q8" else "f32"
    return name


def kv_numpy_dtype(name: str) -> Any:
    """The NumPy dtype of a CPU cache of KV dtype ``name`` (``f32`` or ``f16``); raises
    ``ValueError`` for another name (``auto`` included: resolve it first)."""
    if name == "f32":
        return np.float32
    if name == "f16":
        return np.float16
    raise ValueError(f"a KV cache is f32 or f16, not {name!r}")


def kv_bytes(name: str) -> int:
    """Bytes of one key or value element in a cache of KV dtype ``name``."""
    return int(np.dtype(kv_numpy_dtype(name)).itemsize)


def lazy_zeros(xp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """``xp.zeros(shape, dtype)``; on the CPU in anonymous memory that the kernel backs a
    4 KiB page at a time as it is first written, never with transparent huge pages.

    NumPy asks for huge pages (``madvise(MADV_HUGEPAGE)``) on every array of 4 MiB or
    more. A KV cache ``[L, Hkv, T, D]`` is written at ``L x Hkv`` places ``T x D`` apart,
    so with 2 MiB pages a sequence's first token makes the whole cache resident: SmolLM2 at
    2048 positions held 88 of its 90 MiB after one 32-token completion
    (``benchmarks/engine.py --join-rss``). With 4 KiB pages a sequence holds about the
    positions it has written.
    """
    if xp is not np:
        return xp.zeros(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    # Private and anonymous (mmap's default for -1 is shared memory, which the kernel keeps
    # as shmem): zero pages until written, freed with the array.
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, nbytes, flags=private) if private else mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux: also where THP is "always"
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype).reshape(shape)


def _backing_map(a: Any) -> mmap.mmap | None:
    """The anonymous map under an array of :func:`lazy_zeros` (None for any other)."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


class KVCache:
    """Keys and values of one sequence for the layers of one stage.

    Arrays are ``[L, Hkv, T, D]`` with ``T = max_tokens`` allocated up front, so decode
    never reallocates and a sequence that starts cannot run out of memory halfway. Only
    the first :attr:`length` positions are valid; truncating is O(1) (speculative
    decoding rolls back rejected drafts this way). ``dtype`` is float32 (the default) or
    float16 on the CPU (:data:`KV_DTYPES`: :meth:`write` rounds to nearest, ties to even,
    and hands back float32; the compiled kernels widen as they read); the CUDA stage may
    keep float16 bit patterns (``uint16``) and writes them itself. On the CPU the arrays
    take memory as positions are written (:func:`lazy_zeros`).

    :attr:`blocks` is the cache's block table as the attention kernels read it (position
    ``p`` of a head at row ``blocks[p // KV_BLOCK] KV_BLOCK + p % KV_BLOCK``): here
    ``blocks[i] = i``, the rows in order. A paged cache
    (:class:`~meshnode.engine.kv_pages.PagedCache`) offers the same interface over a
    stage's pool of blocks. On a device (``xp`` not NumPy) :attr:`device_blocks` is the
    table there, the one the CUDA kernels read (:attr:`blocks_stale`: ``blocks`` changed
    since it was copied; never here, the identity does not change).
    """

    def __init__(
        self,
        xp: Any,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_tokens: int,
        *,
        dtype: Any = None,
    ):
        dtype = xp.float32 if dtype is None else dtype
        self.max_tokens = max_tokens
        shape = (layers, kv_heads, max_tokens, head_dim)
        self.k = lazy_zeros(xp, shape, dtype)
        self.v = lazy_zeros(xp, shape, dtype)
        self.blocks = np.arange(-(-max_tokens // KV_BLOCK), dtype=np.int64)
        self.device_blocks = None if xp is np else xp.asarray(self.blocks)
        self.blocks_stale = False
        self.length = 0

    def reserve(self, end: int) -> None:
        """Make room for positions up to ``end`` (here preallocated: only checked); raises
        ``ValueError`` past :attr:`max_tokens`."""
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} > {self.max_tokens} tokens")

    def truncate(self, n: int) -> None:
        """Forget every position from ``n`` on; raises ``ValueError`` if ``n > length``."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def advance(self, start: int, rows: int) -> None:
        """Record a forward of ``rows`` new positions from ``start``: the cache now holds
        ``start + rows`` positions."""
        self.length = start + rows

    def write(self, layer: int, start: int, k: Any, v: Any) -> tuple[Any, Any]:
        """Store ``k, v`` ``[Hkv, S, D]`` at ``start``; return keys/values ``[Hkv, T', D]``.

        ``T' = start + S``: every position the new queries may attend to. A float16 cache
        stores them rounded to nearest (ties to even) and returns float32 copies of what
        it holds (the new rows as stored, rounded: what a later query reads too).
        """
        end = start + k.shape[1]
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} > {self.max_tokens} tokens")
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        keys, values = self.k[layer, :, :end], self.v[layer, :, :end]
        if keys.dtype == np.float16:
            return keys.astype(np.float32), values.astype(np.float32)
        return keys, values

    def release_pages(self) -> None:
        """Empty the cache (:meth:`truncate` to 0) and hand the memory of the positions
        written so far back to the system; on the CPU they read as zeros when written
        again. A stage keeps released caches for its next sequences, which would otherwise
        keep the pages of the longest sequence each cache ever held."""
        self.truncate(0)
        for a in (self.k, self.v):
            held = _backing_map(a)
            if held is not None and hasattr(mmap, "MADV_DONTNEED"):
                held.madvise(mmap.MADV_DONTNEED)

    def nbytes(self) -> int:
        """Bytes allocated for this cache."""
        return int(self.k.nbytes + self.v.nbytes)
