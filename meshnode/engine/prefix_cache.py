"""A stage's pool of cached KV blocks, shared by the sequences whose prompts begin alike.

Chat clients resend the whole conversation every turn and many users share one system
prompt (issue 30), so most of a prompt's keys and values were already computed by an
earlier request. The K/V of a position depend only on the tokens up to it, so they can be
copied from any sequence that began with the same tokens.

Theory of operation:

- The blocks live in the stage's :class:`~meshnode.engine.kv_pages.BlockPool`, the one its
  sequences' paged caches take their blocks from; this pool is its index. A *full* block of
  a sequence is keyed by a hash chain (:func:`chain_keys`): block ``i``'s key hashes block
  ``i - 1``'s key with the block's own token ids, and block 0's hashes a salt naming what
  changes the math (the pipeline's model, layer ranges, nodes and dtypes: the host's
  prefix seed, :mod:`meshnode.node.prefix_keep`). So one key stands for the whole token
  prefix up to the block's end, and a pool never mixes two pipelines' blocks. A block
  also keeps its token ids: a lookup compares them, so a hash collision is a miss.
- Storing a block only names the sequence's own slot in the index (one more reference): no
  copy. A new sequence that begins with keyed blocks puts their slots in its block table
  (:meth:`PrefixPool.acquire`): no copy either; attention reads them in place, and the
  sequence writes only into blocks of its own (:class:`~meshnode.engine.kv_pages.PagedCache`:
  copy-on-write after a rollback into a shared one).
- A block stays keyed after its sequences end. Blocks only the index references are
  *cached*; they are evicted least-recently-used when a sequence needs a block and none is
  free (:attr:`BlockPool.reclaim <meshnode.engine.kv_pages.BlockPool.reclaim>`), and beyond
  the pool's prefix budget (:meth:`PrefixPool.trim`, so the memory a stage touches stays
  its live sequences' plus that budget). A block a sequence references is never evicted.

Pure array code; no I/O, not thread-safe (the stage runner serializes its calls).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshnode.engine.kv_cache import KV_BLOCK
from meshnode.engine.kv_pages import BlockPool
from meshnode.errors import MeshnodeError

__all__ = [
    "PREFIX_BLOCK_TOKENS",
    "PrefixMissError",
    "PrefixPool",
    "PrefixStats",
    "chain_keys",
    "extend_chain",
    "resume_length",
]

#: Positions per cached block: the paged caches' (:data:`~meshnode.engine.kv_cache.KV_BLOCK`).
#: Host and stages must agree on it: the host resumes at multiples.
PREFIX_BLOCK_TOKENS = KV_BLOCK

Key = bytes


class PrefixMissError(MeshnodeError, ValueError):
    """A frame asked to resume from a cached prefix this stage does not (or no longer)
    hold; the host sends the prompt again from position 0."""


def chain_keys(salt: str, tokens: Sequence[int], block: int = PREFIX_BLOCK_TOKENS) -> list[Key]:
    """The key of each full block of ``tokens``: a BLAKE2b-128 chain seeded by ``salt``
    (key ``i`` covers ``tokens[: (i + 1) * block]``)."""
    return extend_chain([], salt, tokens, block)


def extend_chain(
    keys: list[Key], salt: str, tokens: Sequence[int], block: int = PREFIX_BLOCK_TOKENS
) -> list[Key]:
    """``keys``, the chain keys of ``tokens``' first ``len(keys)`` blocks, extended in
    place to every full block of ``tokens`` (:func:`chain_keys`); returned."""
    key = keys[-1] if keys else hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for i in range(len(keys), len(tokens) // block):
        ids = np.asarray(tokens[i * block : (i + 1) * block], dtype="<u4")
        key = hashlib.blake2b(key + ids.tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


def resume_length(prompt_tokens: int, cached_blocks: int, block: int = PREFIX_BLOCK_TOKENS) -> int:
    """Positions of a prompt of ``prompt_tokens`` that may come from ``cached_blocks``
    leading cached blocks: whole blocks only, and never the prompt's last token, whose
    logits the request needs (so at least one position is computed)."""
    return min(cached_blocks, max(prompt_tokens - 1, 0) // block) * block


@dataclass(slots=True)
class PrefixStats:
    """Counters of one pool since it was made (``/metrics``)."""

    hit_tokens: int = 0  # positions read from cached blocks instead of computed
    miss_tokens: int = 0  # prompt positions computed (prefill rows of new sequences)
    stored_blocks: int = 0
    evicted_blocks: int = 0
    skipped_blocks: int = 0  # not stored: another prefix's block holds the key (a collision)


@dataclass(slots=True)
class _Block:
    slot: int
    tokens: tuple[int, ...]
    parent: Key | None  # the key of the block before (None: the chain's first)


@dataclass(slots=True)
class PrefixPool:
    """The keyed blocks of one stage's :class:`BlockPool` ``kv``; see the module docstring.
    ``budget`` is the most blocks kept cached (referenced by no sequence) after
    :meth:`trim`. Methods take and give block *keys*."""

    kv: BlockPool
    salt: str
    budget: int
    stats: PrefixStats = field(default_factory=PrefixStats)
    # key -> block, least recently used first; a referenced block may sit anywhere.
    _blocks: OrderedDict[Key, _Block] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"bad prefix pool: a budget of {self.budget} blocks")
        self.kv.reclaim = self._evict

    @property
    def block(self) -> int:
        """Positions per block."""
        return self.kv.block

    @property
    def capacity(self) -> int:
        """Blocks of the stage's pool (live sequences' and cached)."""
        return self.kv.capacity

    def usage(self) -> dict[str, int]:
        """Blocks in use by sequences, cached (referenced by the index alone), free, and
        the pool's size."""
        # One C-level copy each: a status read on the event loop while a step runs.
        slots, refs = [b.slot for b in list(self._blocks.values())], self.kv.refs
        cached = sum(1 for s in slots if refs[s] == 1)
        free = self.kv.free_blocks
        return {
            "blocks_used": self.capacity - free - cached,
            "blocks_cached": cached,
            "blocks_free": free,
            "blocks_total": self.capacity,
            "block_tokens": self.block,
        }

    def nbytes(self) -> int:
        """Bytes allocated for the stage's blocks."""
        return self.kv.nbytes()

    def keys(self, tokens: Sequence[int]) -> list[Key]:
        """The keys of ``tokens``' full blocks in this pool (:func:`chain_keys`)."""
        return chain_keys(self.salt, tokens, self.block)

    def held(self) -> list[Key]:
        """The keys of every block the pool holds, most recently used first (a chain's
        first block before its descendants: :meth:`_refresh`)."""
        return list(reversed(self._blocks))

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` the pool holds."""
        n = 0
        for i, key in enumerate(self.keys(tokens)):
            if not self._holds(key, tokens, i):
                break
            n += 1
        return n

    def acquire(self, key: Key, cache: Any) -> tuple[list[int], list[Key]]:
        """Begin ``cache`` (an empty :class:`~meshnode.engine.kv_pages.PagedCache` of this
        stage's pool) with the chain of blocks that ends with ``key``, by reference; their
        token ids and keys, in order. Raises :class:`PrefixMissError` (and changes nothing)
        when a block of the chain is not (or no longer) here."""
        chain: list[Key] = []
        at: Key | None = key
        while at is not None:
            entry = self._blocks.get(at)
            if entry is None:
                raise PrefixMissError(f"block {len(chain)} from the end of a prefix is not here")
            chain.append(at)
            at = entry.parent
        chain.reverse()
        entries = [self._blocks[k] for k in chain]
        cache.adopt([e.slot for e in entries])
        tokens = [t for e in entries for t in e.tokens]
        self.stats.hit_tokens += len(tokens)
        self._refresh(chain)
        return tokens, chain

    def store(self, tokens: Sequence[int], cache: Any, held: int) -> list[Key]:
        """Key the full blocks of ``tokens`` from block ``held`` on, each the slot that
        ``cache`` (a paged cache holding K/V for every one of ``tokens``) holds it in (a
        block already keyed with the same tokens stays the keyed one); the keys now known,
        in order (fewer than asked after a collision: later blocks could not be found)."""
        keys = self.keys(tokens)
        out: list[Key] = []
        for i in range(held, len(keys)):
            key = keys[i]
            if key in self._blocks:
                if not self._holds(key, tokens, i):
                    self.stats.skipped_blocks += len(keys) - i
                    break
            else:
                slot = int(cache.blocks[i])
                self.kv.hold(slot)
                span = tuple(tokens[i * self.block : (i + 1) * self.block])
                self._blocks[key] = _Block(slot, span, keys[i - 1] if i else None)
                self.stats.stored_blocks += 1
            out.append(key)
        self._refresh(keys[:held] + out)
        return out

    def trim(self) -> None:
        """Evict least recently used cached blocks beyond :attr:`budget`."""
        refs = self.kv.refs
        over = sum(1 for b in self._blocks.values() if refs[b.slot] == 1) - self.budget
        while over > 0 and self._evict():
            over -= 1

    def clear(self) -> None:
        """Forget every cached block (the blocks sequences use stay keyed)."""
        while self._evict():
            pass

    # -- internals --------------------------------------------------------------------

    def _holds(self, key: Key, tokens: Sequence[int], i: int) -> bool:
        entry = self._blocks.get(key)
        span = tuple(tokens[i * self.block : (i + 1) * self.block])
        return entry is not None and entry.tokens == span

    def _refresh(self, chain: Sequence[Key]) -> None:
        # A chain's first block is its most recently used: a block is only found through
        # its ancestors, so least-recently-used order must evict descendants first.
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _evict(self) -> bool:
        """Free the least recently used cached block; False when there is none."""
        refs = self.kv.refs
        victim = next((k for k, b in self._blocks.items() if refs[b.slot] == 1), None)
        if victim is None:
            return False
        self.kv.drop(self._blocks.pop(victim).slot)
        self.stats.evicted_blocks += 1
        return True
