"""The stage side of prefix sharing on a hybrid stage (issue 30; the rule is in
:mod:`meshnode.node.prefix`): recurrent-state snapshots at block boundaries.

After each prefill piece of at least a block that ends at a block boundary
(:func:`~meshnode.node.prefix.snapshot_at`; the host cuts a prompt's prefill at multiples
of the block and at the prompt's last boundary,
:func:`meshnode.generation.prefix.prefill_pieces`), a :class:`HybridPrefix` keeps a
snapshot of the sequence's whole cache there (:mod:`meshnode.engine.snapshots`), keyed by
the hash chain of the token ids up to it. A prefill frame carries committed tokens only,
so a snapshot never holds a draft: speculation's verify passes store nothing, and a
rollback restores from the sequence's own ring (:mod:`meshnode.engine.recurrent`), never
from a snapshot. A new sequence whose first frame names a kept boundary
(``prefix_key``) starts as a copy of its snapshot; one that names another is refused with
:class:`~meshnode.engine.prefix_cache.PrefixMissError` and the host starts over from 0.
"""

from __future__ import annotations

from typing import Any

from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS, PrefixMissError, extend_chain
from meshnode.engine.snapshots import MAX_SNAPSHOTS, SnapshotPool
from meshnode.node.pipeline import RequestId, StepFrame
from meshnode.node.prefix import StagePrefix, Tracked, snapshot_at

__all__ = ["SNAPSHOT_CONTEXTS", "HybridPrefix", "snapshot_bytes", "stage_prefix"]

#: A hybrid stage's snapshots hold at most this many whole contexts of its attention
#: layers' K/V (plus their recurrent states) when nobody sets ``prefix_cache_bytes``: the
#: pool a plain stage's cached prefixes live in is a few contexts too
#: (:data:`~meshnode.node.prefix.DEFAULT_POOL_CONTEXTS`), and the planner still reserves a
#: whole context for every live hybrid sequence.
SNAPSHOT_CONTEXTS = 2


def stage_prefix(
    stage: Stage,
    context_size: int,
    *,
    budget_bytes: int | None,
    salt: str,
    sequences: int,
) -> StagePrefix:
    """The prefix cache of ``stage``: snapshots on a hybrid CPU stage
    (:meth:`HybridPrefix.for_stage`), else :meth:`StagePrefix.for_stage`."""
    if stage.config.hybrid is not None and stage.backend.name == "cpu":
        return HybridPrefix.for_stage(stage, context_size, budget_bytes=budget_bytes, salt=salt)
    return StagePrefix.for_stage(
        stage, context_size, budget_bytes=budget_bytes, salt=salt, sequences=sequences
    )


def snapshot_bytes(stage: Stage, positions: int) -> int:
    """Bytes of a snapshot of ``stage``'s cache after ``positions`` (float32): its
    attention layers' K and V rows, every DeltaNet layer's state and conv window."""
    hybrid = stage.config.hybrid
    assert hybrid is not None
    linear = sum(hybrid.is_linear(i) for i in range(stage.start, stage.end))
    attention = stage.end - stage.start - linear
    per_position = 2 * attention * hybrid.num_kv_heads * hybrid.head_dim * 4
    return positions * per_position + linear * hybrid.recurrent_shape().nbytes()


class HybridPrefix(StagePrefix):
    """A hybrid stage's snapshots of cached prefixes (module docstring); ``snaps`` None:
    it keeps none (and announces no block size, so the host resumes nothing)."""

    snapshots = True

    def __init__(self, snaps: SnapshotPool | None, salt: str) -> None:
        super().__init__(None)
        self.snaps, self.salt = snaps, salt

    @classmethod
    def for_stage(  # type: ignore[override]
        cls, stage: Stage, context_size: int, *, budget_bytes: int | None, salt: str
    ) -> HybridPrefix:
        """Snapshots of at most ``budget_bytes`` (None: :data:`SNAPSHOT_CONTEXTS` whole
        contexts; 0: none) for ``stage``'s sequences of ``context_size``."""
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"bad prefix pool: {budget_bytes} bytes")
        if budget_bytes is None:
            budget_bytes = SNAPSHOT_CONTEXTS * snapshot_bytes(stage, context_size)
        return cls(SnapshotPool(budget_bytes, MAX_SNAPSHOTS) if budget_bytes else None, salt)

    @property
    def block(self) -> int:
        """Positions between the boundaries snapshots are kept at (0: none kept)."""
        return 0 if self.snaps is None else PREFIX_BLOCK_TOKENS

    def resume(self, frame: StepFrame, cache: Any) -> list[int]:
        """Begin ``cache`` of a new sequence at the snapshot ``frame.prefix_key`` names;
        its prefix's token ids. Raises :class:`PrefixMissError` when it is not here or
        does not end where the frame starts (nothing is kept then)."""
        if self.snaps is None or frame.prefix_key is None:
            raise PrefixMissError("this stage keeps no prefix snapshots")
        tokens = self.snaps.restore(frame.prefix_key, cache)
        if len(tokens) != frame.start_pos:
            cache.truncate(0)
            raise PrefixMissError(
                f"the snapshot holds {len(tokens)} tokens; the frame starts at {frame.start_pos}"
            )
        keys = extend_chain([], self.salt, tokens, PREFIX_BLOCK_TOKENS)
        self._seqs[frame.request_id] = Tracked(tokens, keys, len(keys))
        return tokens

    def written(self, frame: StepFrame, cache: Any) -> None:
        """After ``frame``'s forward: note its tokens, and keep a snapshot where
        :func:`~meshnode.node.prefix.snapshot_at` says."""
        if self.snaps is None or (seq := self._track(frame, self.snaps.stats)) is None:
            return
        block = PREFIX_BLOCK_TOKENS
        del seq.keys[frame.start_pos // block :]
        seq.tokens[frame.start_pos :] = frame.tokens
        end = frame.end_pos
        if snapshot_at(frame, block):
            extend_chain(seq.keys, self.salt, seq.tokens[:end], block)
            self.snaps.store(seq.keys[-1], seq.tokens[:end], cache)

    def release(self, request_id: RequestId) -> None:
        """The sequence ended (its snapshots stay)."""
        self._seqs.pop(request_id, None)

    def usage(self) -> dict[str, int]:
        """The snapshots kept, their bytes and bounds, and hit/miss tokens, prefixed
        ``prefix_``; empty without any."""
        if self.snaps is None:
            return {}
        s = self.snaps
        return {
            "prefix_snapshots": len(s),
            "prefix_snapshots_max": s.limit,
            "prefix_snapshot_bytes": s.nbytes(),
            "prefix_snapshot_budget_bytes": s.budget,
            "prefix_block_tokens": PREFIX_BLOCK_TOKENS,
            "prefix_hit_tokens": s.stats.hit_tokens,
            "prefix_miss_tokens": s.stats.miss_tokens,
            "prefix_evicted_snapshots": s.stats.evicted,
        }
