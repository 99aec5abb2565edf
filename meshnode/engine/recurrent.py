"""Per-sequence state of a hybrid stage: KV for its attention layers, recurrent state for its
Gated DeltaNet layers, and the snapshot ring that rolls the recurrent state back.

A KV cache rolls back by forgetting positions; a recurrent state cannot, since every row
folds into it. So while a pass runs, each DeltaNet layer keeps a copy of its state after
each of the pass's rows in a ring of ``slots`` entries, indexed by position. A frame whose
``start_pos`` lies inside the ring (speculative decoding rejected drafts of the last
window) restores the state after position ``start_pos - 1`` by one copy. Further back,
the ring no longer holds it: the stage cannot rebuild it from its own inputs, so
:meth:`HybridCache.rollback` raises :class:`RollbackError` and the host prefills the
sequence again (prompt plus committed tokens) from position 0, which always works
(``meshnode.generation.replay``).

The host sizes the ring to its largest verify pass (:func:`ring_slots_for`, sent in
``Load.ring_slots``), so speculative decoding never rolls back further than the ring.

Every array is preallocated: a sequence's recurrent state and ring are a fixed size
whatever its length (the planner counts them per sequence, not per token).

A cached prefix (issue 30) resumes from a :class:`RecurrentSnapshot`: a copy of the state,
conv window and attention K/V after a prefill pass that ended at a block boundary
(:meth:`HybridCache.snapshot`), restored into an empty cache (:meth:`HybridCache.restore`);
:mod:`meshnode.engine.snapshots` keeps them.

Shapes: L DeltaNet layers of the stage, K conv kernel, C conv channels, Hv value heads,
Dk/Dv key/value head dims, R ring slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshnode.engine.kv_cache import KVCache
from meshnode.errors import MeshnodeError

__all__ = [
    "DEFAULT_RING_SLOTS",
    "MAX_RING_SLOTS",
    "HybridCache",
    "RecurrentShape",
    "RecurrentSnapshot",
    "RollbackError",
    "ring_slots_for",
]

#: Ring slots when nobody chooses: a verify pass of the default largest window (16 drafts,
#: ``speculative.window.WindowPolicy.max_window``) plus its last token is 17 rows, and
#: every one of them is a place the next frame may roll back to.
DEFAULT_RING_SLOTS = 17
#: The most slots a stage keeps, whatever a host asks: each slot is a whole recurrent state
#: of every DeltaNet layer, per sequence, and verify passes of 64 drafts are far past where
#: adaptive windows stop growing. A host with a larger window re-prefills on a deep rollback.
MAX_RING_SLOTS = 65


def ring_slots_for(max_window: int) -> int:
    """Snapshots a sequence needs when verify passes carry up to ``max_window`` drafts
    (0: no speculation): one per row of the largest pass, capped at :data:`MAX_RING_SLOTS`."""
    if max_window < 0:
        raise ValueError(f"max_window must be >= 0, got {max_window}")
    return min(max_window + 1, MAX_RING_SLOTS)


class RollbackError(MeshnodeError, ValueError):
    """``start_pos`` is further back than the snapshot ring reaches (replay from 0)."""


@dataclass(frozen=True)
class RecurrentShape:
    """Sizes of one DeltaNet layer's state: the conv window and the delta-rule matrix."""

    conv_taps: int  # K - 1 rows of conv input kept
    conv_channels: int  # C
    value_heads: int  # Hv
    key_dim: int  # Dk
    value_dim: int  # Dv

    def nbytes(self) -> int:
        """float32 bytes of one layer's state (one ring slot holds one per layer)."""
        conv = self.conv_taps * self.conv_channels
        return 4 * (conv + self.value_heads * self.key_dim * self.value_dim)


@dataclass(frozen=True, slots=True)
class RecurrentSnapshot:
    """A hybrid sequence's cache after its first :attr:`length` positions: the attention
    layers' keys and values ``[La, Hkv, length, D]``, every DeltaNet layer's conv window
    ``[L, K-1, C]`` and state ``[L, Hv, Dk, Dv]`` (copies, owned by the snapshot)."""

    length: int
    k: Any
    v: Any
    conv: Any
    state: Any

    def nbytes(self) -> int:
        """Bytes the snapshot holds."""
        return int(self.k.nbytes + self.v.nbytes + self.conv.nbytes + self.state.nbytes)


class HybridCache(KVCache):
    """A :class:`KVCache` for the stage's attention layers plus the recurrent state of its
    ``linear_layers`` DeltaNet layers.

    :attr:`length` is the number of positions folded into both; :meth:`rollback` (and
    ``truncate``, the name callers of a KV cache use) moves it back: KV by truncation, the
    recurrent state from the ring.
    """

    def __init__(
        self,
        xp: Any,
        attention_layers: int,
        kv_heads: int,
        head_dim: int,
        max_tokens: int,
        *,
        linear_layers: int,
        shape: RecurrentShape,
        ring_slots: int = DEFAULT_RING_SLOTS,
    ) -> None:
        if ring_slots < 1:
            raise ValueError(f"the snapshot ring needs at least one slot, got {ring_slots}")
        super().__init__(xp, attention_layers, kv_heads, head_dim, max_tokens)
        self.shape = shape
        self.ring_slots = ring_slots
        s, n = shape, linear_layers
        self.conv = xp.zeros((n, s.conv_taps, s.conv_channels), xp.float32)  # [L, K-1, C]
        self.state = xp.zeros((n, s.value_heads, s.key_dim, s.value_dim), xp.float32)
        # ring[p % R] holds the state after position p, for p in [ring_start, length)
        self.ring_conv = xp.zeros((ring_slots, *self.conv.shape), xp.float32)  # [R, L, K-1, C]
        self.ring_state = xp.zeros((ring_slots, *self.state.shape), xp.float32)
        self.ring_start = 0
        self.restores = 0  # rollbacks served from the ring (telemetry)

    def rollback(self, n: int) -> None:
        """Make the cache hold positions ``0 .. n - 1`` only.

        Raises :class:`RollbackError` when ``n`` is behind what the ring holds, and
        ``ValueError`` when ``n`` is past :attr:`length`.
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll a cache of {self.length} positions back to {n}")
        if n == self.length:
            return
        if n == 0:
            self.conv[...] = 0.0
            self.state[...] = 0.0
            self.ring_start = 0
        elif n - 1 >= self.ring_start and n - 1 >= self.length - self.ring_slots:
            slot = (n - 1) % self.ring_slots
            self.conv[...] = self.ring_conv[slot]
            self.state[...] = self.ring_state[slot]
            self.restores += 1
        else:
            raise RollbackError(
                f"cannot roll back to position {n}: the snapshot ring holds the states "
                f"after positions {self._oldest()} .. {self.length - 1} only "
                f"({self.ring_slots} slots); replay the sequence from position 0"
            )
        self.length = n

    def truncate(self, n: int) -> None:
        """:meth:`rollback`: what truncating means for a cache with recurrent state."""
        self.rollback(n)

    def keep(self, layer: int, pos: int, conv: Any, state: Any) -> None:
        """Store layer ``layer``'s conv window and state after position ``pos`` in the ring."""
        slot = pos % self.ring_slots
        self.ring_conv[slot, layer] = conv
        self.ring_state[slot, layer] = state

    def advance(self, start: int, rows: int) -> None:
        """Record a pass of ``rows`` rows from ``start``: the ring now ends at its last row."""
        end = start + rows
        self.ring_start = max(self.ring_start, end - self.ring_slots)
        self.length = end

    def snapshot(self) -> RecurrentSnapshot:
        """A copy of everything the cache holds after its :attr:`length` positions."""
        n = self.length
        k, v = self.k[:, :, :n].copy(), self.v[:, :, :n].copy()
        return RecurrentSnapshot(n, k, v, self.conv.copy(), self.state.copy())

    def restore(self, snap: RecurrentSnapshot) -> None:
        """Begin this empty cache at ``snap`` (its K/V, conv windows and states copied in).
        The ring holds nothing before ``snap.length``: a rollback behind it raises
        :class:`RollbackError`. Raises ``ValueError`` unless the cache is empty and ``snap``
        fits it (its shapes and :attr:`max_tokens`)."""
        n = snap.length
        fits = snap.conv.shape == self.conv.shape and snap.state.shape == self.state.shape
        if self.length or n > self.max_tokens or not fits:
            raise ValueError("a recurrent snapshot seeds an empty cache of its shape")
        self.k[:, :, :n] = snap.k
        self.v[:, :, :n] = snap.v
        self.conv[...] = snap.conv
        self.state[...] = snap.state
        self.length = self.ring_start = n

    def ring_nbytes(self) -> int:
        """Bytes of the snapshot ring."""
        return int(self.ring_conv.nbytes + self.ring_state.nbytes)

    def recurrent_nbytes(self) -> int:
        """Bytes of the live recurrent state (without the ring)."""
        return int(self.conv.nbytes + self.state.nbytes)

    def nbytes(self) -> int:
        """Bytes allocated for this sequence: KV, recurrent state and ring."""
        return super().nbytes() + self.recurrent_nbytes() + self.ring_nbytes()

    def _oldest(self) -> int:
        return max(self.ring_start, self.length - self.ring_slots)
