"""A stage's pool of cached KV blocks, shared by the sequences whose prompts begin alike.

Chat clients resend the whole conversation every turn and many users share one system
prompt (issue 30), so most of a prompt's keys and values were already computed by an
earlier request. The K/V of a position depend only on the tokens up to it, so they can be
copied from any sequence that began with the same tokens.

Theory of operation:

- The pool holds ``capacity`` blocks of :data:`PREFIX_BLOCK_TOKENS` positions each, every
  one ``[L, Hkv, B, D]`` for K and for V (this stage's layers), in two arrays allocated
  once and bounded by a byte budget (:meth:`PrefixPool.for_budget`).
- A *full* block is keyed by a hash chain (:func:`chain_keys`): block ``i``'s key hashes
  block ``i - 1``'s key with the block's own token ids, and block 0's hashes a salt naming
  what changes the math (model and run, KV dtype, layer range). So one key stands for the
  whole token prefix up to the block's end, and a pool never mixes two stages' blocks. A
  block also keeps its token ids: a lookup compares them, so a hash collision is a miss.
- A sequence that uses a block (it copied it in, or stored it) holds a reference until it
  is released; a referenced block is never evicted. Unreferenced blocks stay cached and
  are evicted least-recently-used when a new block needs room; when every block is in
  use, a store is skipped (the sequence runs as without a cache), never an error.
- In this phase sequences still hold one preallocated array each
  (:class:`~meshnode.engine.kv_cache.KVCache`): a hit *copies* its blocks into the
  sequence's cache (a memcpy, next to which the prefill it replaces is thousands of times
  dearer). Sequences holding block lists, with attention reading the blocks in place, are
  phase 2; the planner's footprint follows that layout then.

Pure array code (NumPy or CuPy, through the arrays' own slicing); no I/O, not thread-safe
(the stage runner serializes its calls).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshnode.engine.kv_cache import lazy_zeros
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

#: Positions per cached block. vLLM uses 16, SGLang 1 (a radix tree), llama-server a whole
#: slot; 32 keeps the per-block bookkeeping (a hash, a dict entry) negligible next to the
#: block's bytes (SmolLM2: 1.5 MiB per block at f32) while a prompt loses at most 31
#: positions of reuse. Host and stages must agree on it: the host resumes at multiples.
PREFIX_BLOCK_TOKENS = 32

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

    hit_tokens: int = 0  # positions copied in instead of computed
    miss_tokens: int = 0  # prompt positions computed (prefill rows of new sequences)
    stored_blocks: int = 0
    evicted_blocks: int = 0
    skipped_blocks: int = 0  # not stored: every block was in use


@dataclass(slots=True)
class _Block:
    slot: int
    tokens: tuple[int, ...]
    parent: Key | None  # the key of the block before (None: the chain's first)
    refs: int = 0


@dataclass(slots=True)
class PrefixPool:
    """Cached KV blocks of one stage; see the module docstring.

    ``k`` and ``v`` are ``[capacity, L, Hkv, B, D]`` (on the CPU taking memory as blocks
    are first written). Methods take and give block *keys*; a sequence remembers the keys
    it holds and hands them back to :meth:`release`.
    """

    k: Any
    v: Any
    salt: str
    block: int = PREFIX_BLOCK_TOKENS
    stats: PrefixStats = field(default_factory=PrefixStats)
    # key -> block, least recently used first; a referenced block may sit anywhere.
    _blocks: OrderedDict[Key, _Block] = field(default_factory=OrderedDict)
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free = list(range(self.capacity))[::-1]

    @classmethod
    def for_budget(
        cls,
        xp: Any,
        *,
        budget_bytes: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        salt: str,
        block: int = PREFIX_BLOCK_TOKENS,
    ) -> PrefixPool:
        """A pool of as many blocks as ``budget_bytes`` holds (zero: a pool that caches
        nothing). Raises ``ValueError`` for a negative budget or a bad block size."""
        if budget_bytes < 0 or block < 1:
            raise ValueError(f"bad prefix pool: {budget_bytes} bytes, blocks of {block}")
        shape = (layers, kv_heads, block, head_dim)
        per_block = 2 * int(np.prod(shape)) * np.dtype(dtype).itemsize
        blocks = budget_bytes // per_block if per_block else 0
        k = lazy_zeros(xp, (blocks, *shape), dtype)
        v = lazy_zeros(xp, (blocks, *shape), dtype)
        return cls(k=k, v=v, salt=salt, block=block)

    @property
    def capacity(self) -> int:
        """Blocks the pool holds at most."""
        return int(self.k.shape[0])

    def usage(self) -> dict[str, int]:
        """Blocks in use by sequences, cached (unreferenced), free, and the pool's size."""
        # One C-level copy each: a status read on the event loop while a step runs.
        blocks, free = list(self._blocks.values()), len(self._free)
        used = sum(1 for b in blocks if b.refs)
        return {
            "blocks_used": used,
            "blocks_cached": len(blocks) - used,
            "blocks_free": free,
            "blocks_total": self.capacity,
            "block_tokens": self.block,
        }

    def nbytes(self) -> int:
        """Bytes allocated for the pool's blocks."""
        return int(self.k.nbytes + self.v.nbytes)

    def keys(self, tokens: Sequence[int]) -> list[Key]:
        """The keys of ``tokens``' full blocks in this pool (:func:`chain_keys`)."""
        return chain_keys(self.salt, tokens, self.block)

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` the pool holds."""
        n = 0
        for i, key in enumerate(self.keys(tokens)):
            if not self._holds(key, tokens, i):
                break
            n += 1
        return n

    def acquire(self, key: Key, cache: Any) -> tuple[list[int], list[Key]]:
        """Copy the chain of blocks that ends with ``key`` into positions ``0 … n x block``
        of ``cache`` (a :class:`~meshnode.engine.kv_cache.KVCache` of this stage's
        layers), set its length, and reference the blocks; their token ids and keys, in
        order. Raises :class:`PrefixMissError` (and changes nothing) when a block of the
        chain is not (or no longer) here."""
        chain: list[Key] = []
        at: Key | None = key
        while at is not None:
            entry = self._blocks.get(at)
            if entry is None:
                raise PrefixMissError(f"block {len(chain)} from the end of a prefix is not here")
            chain.append(at)
            at = entry.parent
        chain.reverse()
        tokens: list[int] = []
        cache.truncate(0)
        for i, k in enumerate(chain):
            entry = self._use(k)
            span = slice(i * self.block, (i + 1) * self.block)
            cache.k[:, :, span] = self.k[entry.slot]  # [L, Hkv, B, D]
            cache.v[:, :, span] = self.v[entry.slot]
            tokens.extend(entry.tokens)
        cache.length = len(tokens)
        self.stats.hit_tokens += len(tokens)
        self._refresh(chain)
        return tokens, chain

    def store(self, tokens: Sequence[int], cache: Any, held: int) -> list[Key]:
        """Store the full blocks of ``tokens`` from block ``held`` on, copied from the same
        positions of ``cache`` (which must hold K/V for every one of ``tokens``), and
        reference them; the keys of the blocks now held, in order (fewer than asked when
        the pool has no room: the later blocks could never be found without them)."""
        keys = self.keys(tokens)
        out: list[Key] = []
        for i in range(held, len(keys)):
            key = keys[i]
            if key in self._blocks and self._holds(key, tokens, i):
                self._use(key)
            elif key in self._blocks or not self._make_room():
                self.stats.skipped_blocks += len(keys) - i
                break
            else:
                self._write(key, keys[i - 1] if i else None, tokens, i, cache)
            out.append(key)
        self._refresh(keys[:held] + out)
        return out

    def release(self, keys: Sequence[Key]) -> None:
        """Drop one reference to each of ``keys`` (a sequence's blocks, at its end); they
        stay cached until evicted. Unknown keys are ignored."""
        for key in keys:
            entry = self._blocks.get(key)
            if entry is not None and entry.refs > 0:
                entry.refs -= 1

    def clear(self) -> None:
        """Forget every unreferenced block."""
        for key in [k for k, b in self._blocks.items() if not b.refs]:
            self._free.append(self._blocks.pop(key).slot)

    # -- internals --------------------------------------------------------------------

    def _holds(self, key: Key, tokens: Sequence[int], i: int) -> bool:
        entry = self._blocks.get(key)
        span = tuple(tokens[i * self.block : (i + 1) * self.block])
        return entry is not None and entry.tokens == span

    def _use(self, key: Key) -> _Block:
        entry = self._blocks[key]
        entry.refs += 1
        self._blocks.move_to_end(key)  # most recently used
        return entry

    def _refresh(self, chain: Sequence[Key]) -> None:
        # A chain's first block is its most recently used: a block is only found through
        # its ancestors, so least-recently-used order must evict descendants first.
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _make_room(self) -> bool:
        """A free slot, evicting the least recently used unreferenced block if needed."""
        if self._free:
            return True
        victim = next((k for k, b in self._blocks.items() if not b.refs), None)
        if victim is None:
            return False
        self._free.append(self._blocks.pop(victim).slot)
        self.stats.evicted_blocks += 1
        return True

    def _write(
        self, key: Key, parent: Key | None, tokens: Sequence[int], i: int, cache: Any
    ) -> None:
        slot = self._free.pop()
        span = slice(i * self.block, (i + 1) * self.block)
        self.k[slot] = cache.k[:, :, span]
        self.v[slot] = cache.v[:, :, span]
        self._blocks[key] = _Block(slot, tuple(tokens[span]), parent, refs=1)
        self.stats.stored_blocks += 1
