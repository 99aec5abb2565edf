"""A hybrid stage's cached prefixes: recurrent-state snapshots at block boundaries.

A Gated DeltaNet layer's state at position ``P`` folds in every token before it and is
not made of per-position rows, so a hybrid stage cannot share a cached prefix block by
block as a plain stage does (:mod:`meshnode.engine.prefix_cache`). It keeps instead, for
some prefixes that end at a block boundary, a :class:`~meshnode.engine.recurrent.RecurrentSnapshot`
of the whole sequence cache there (DeltaNet states and conv windows, the attention layers'
K/V up to ``P``), keyed like a block: the hash chain of the token ids up to ``P``
(:func:`~meshnode.engine.prefix_cache.chain_keys`). A new sequence whose prompt begins
with those tokens starts as a copy of it and computes only the rest.

The snapshots are bounded: at most ``limit`` of them and ``budget`` bytes together, the
least recently used evicted first. A snapshot copies its prefix's K/V rather than sharing
blocks with other snapshots of the same conversation: a hybrid model's attention layers
are a quarter of its layers (Qwen3.5), and its sequences keep contiguous caches.

Pure array code; no I/O, not thread-safe (the stage runner serializes its calls).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshnode.engine.prefix_cache import PrefixMissError
from meshnode.engine.recurrent import HybridCache, RecurrentSnapshot

__all__ = ["MAX_SNAPSHOTS", "SnapshotPool", "SnapshotStats"]

#: Snapshots a stage keeps at most, whatever its byte budget: a prompt leaves one per
#: prefill piece that ends at a block boundary (every ``--prefill-chunk-tokens`` and the
#: prompt's last boundary), so sixteen hold the recent prompts of a few conversations and
#: a shared system prompt; each costs a copy of its prefix's attention K/V.
MAX_SNAPSHOTS = 16

Key = bytes


@dataclass(slots=True)
class SnapshotStats:
    """Counters of one pool since it was made (``/metrics``, ``meshnode status``)."""

    hit_tokens: int = 0  # positions restored from a snapshot instead of computed
    miss_tokens: int = 0  # prompt positions computed (prefill rows of new sequences)
    stored: int = 0
    evicted: int = 0


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]
    snap: RecurrentSnapshot


@dataclass(slots=True)
class SnapshotPool:
    """The snapshots of one hybrid stage (module docstring): at most ``limit`` of them and
    ``budget`` bytes, least recently used evicted first."""

    budget: int
    limit: int = MAX_SNAPSHOTS
    stats: SnapshotStats = field(default_factory=SnapshotStats)
    _entries: OrderedDict[Key, _Entry] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def __post_init__(self) -> None:
        if self.budget < 0 or self.limit < 1:
            raise ValueError(f"bad snapshot pool: {self.limit} snapshots, {self.budget} bytes")

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes the snapshots hold together."""
        return self._bytes

    def holds(self, key: Key) -> bool:
        """Whether the snapshot keyed ``key`` is here."""
        return key in self._entries

    def store(self, key: Key, tokens: Sequence[int], cache: HybridCache) -> bool:
        """Keep a snapshot of ``cache`` (holding ``tokens``, whose chain key is ``key``)
        unless the key is kept already (a collision keeps the first) or the snapshot alone
        exceeds the budget; whether ``tokens``' snapshot is kept now. Evicts the least
        recently used beyond the bounds."""
        held = self._entries.get(key)
        if held is not None:
            self._entries.move_to_end(key)
            return held.tokens == tuple(tokens)
        snap = cache.snapshot()
        if snap.nbytes() > self.budget:
            return False
        self._entries[key] = _Entry(tuple(tokens), snap)
        self._bytes += snap.nbytes()
        self.stats.stored += 1
        while len(self._entries) > self.limit or self._bytes > self.budget:
            self._evict()
        return True

    def restore(self, key: Key, cache: HybridCache) -> list[int]:
        """Begin the empty ``cache`` at the snapshot keyed ``key``; the token ids of its
        prefix. Raises :class:`PrefixMissError` (and changes nothing) when it is not here."""
        entry = self._entries.get(key)
        if entry is None:
            raise PrefixMissError("no snapshot of this prefix here (evicted, or never kept)")
        cache.restore(entry.snap)
        self._entries.move_to_end(key)
        self.stats.hit_tokens += len(entry.tokens)
        return list(entry.tokens)

    def clear(self) -> None:
        """Forget every snapshot."""
        while self._entries:
            self._evict()

    def _evict(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.snap.nbytes()
        self.stats.evicted += 1
