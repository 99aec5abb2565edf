"""Prefix sharing across requests through a pipeline (issue 30): both ends of the rule.

**The rule.** Every stage keeps a pool of KV blocks of the token prefixes it has computed
(:mod:`meshnode.engine.prefix_cache`), keyed by a chain its own seed salts. The host keeps
a :class:`PrefixIndex` of the blocks it believes each stage holds: those of the token
positions its frames carried and whose passes came back (each stage stored them on the
way, below the committed length), and those a stage kept of an earlier run
(:mod:`meshnode.node.prefix_keep`). For a new request it resumes stage ``k`` at the
longest prefix ``P_k`` (whole blocks, never the prompt's last token) that stage ``k`` and
every stage after it hold (a stage computes the rows the next one needs:
:class:`ResumePoint`): the sequence's first frame starts at ``start_pos = P_0`` and
carries ``prefix_key``, the hash-chain key of the prefix's last block, and ``resume``,
each later stage's start and key; a stage sends the next one only the rows from its start
on (:func:`~meshnode.node.pipeline.onward`). A stage that holds the whole chain puts its
blocks in the sequence's block table (by reference: a CPU stage's sequences hold paged
caches, :mod:`meshnode.engine.kv_pages`) and computes only the frame's tokens; a stage
that lacks a block (evicted under its own budget, or it keeps no pool) refuses the frame with
:class:`~meshnode.engine.prefix_cache.PrefixMissError` (``PREFIX_MISS`` on the wire) and
keeps nothing of the sequence (and refuses its later prompt pieces the same way, until it
is released). The host then forgets that prompt's blocks and sends the prompt from
position 0, which every stage accepts for a known or unknown sequence alike (a
frame at 0 truncates everything). So a wrong belief costs one wasted partial pass, never a
wrong token: the host needs no knowledge of the stages' budgets or eviction order.

**What is stored** (:class:`StagePrefix`). A stage writes a block to its pool once every
position of it is below the sequence's *committed* length: after a frame, that is its end
less its drafts (a prefill or decode frame carries committed tokens only; of a verify
frame's ``[last, d1 … dk]`` only ``last`` is committed, and the accepted drafts become so
when the next frame starts after them). A rolled-back draft therefore never lands in a
block.

**Hybrid stages** (Gated DeltaNet layers) keep no pool of blocks: their recurrent state at
position ``P`` is a function of every token before it, not made of per-position rows. They
keep snapshots of the whole sequence cache after prefill passes that end at a block
boundary instead (:mod:`meshnode.node.hybrid_prefix`), keyed by the same hash chain; the
host's index then believes the *boundaries* those passes ended at (``snapshots``), not
every block, and a request resumes at the last believed boundary of its prompt. The host
cuts such a prompt's prefill at that prompt's last block boundary (and at multiples of the
block), so the snapshot a later request needs exists and both paths compute the same bits
(:func:`meshnode.generation.prefix.prefill_pieces`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from meshnode.engine.kv_cache import KV_BLOCK
from meshnode.engine.kv_pages import BlockPool, PagedCache, block_bytes
from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import (
    PREFIX_BLOCK_TOKENS,
    PrefixMissError,
    PrefixPool,
    chain_keys,
    extend_chain,
    resume_length,
)
from meshnode.node.pipeline import (
    MAX_SEQUENCES_PER_STAGE,
    FrameKind,
    QueuedPass,
    RequestId,
    StepFrame,
    StepResult,
)

__all__ = [
    "DEFAULT_POOL_CONTEXTS",
    "MAX_INDEX_BLOCKS",
    "HostStage",
    "NotedPass",
    "PrefixCaching",
    "PrefixIndex",
    "ResumePoint",
    "StagePrefix",
    "host_pools",
    "note_pass",
    "note_release",
    "pipeline_blocks",
    "pool_blocks",
    "request_blocks",
    "snapshot_at",
]

#: A CPU stage's pool of KV blocks holds this many full contexts (at most one per live
#: sequence), whatever the sequence limit (``MAX_SEQUENCES_PER_STAGE`` = 8): the host admits
#: requests by the blocks they may write (:func:`request_blocks`), so a stage never runs out
#: mid-flight, and cached prefixes use whatever blocks are free. Four: four requests that
#: may each fill the context (no ``max_tokens``) run at once, and eight that need half of
#: it; the planner reserves half of what eight preallocated contexts took.
DEFAULT_POOL_CONTEXTS = 4
#: Blocks the host remembers: far more than any stage's pool holds (a belief that outlives
#: the stage's block is only a miss), small enough to be nothing next to it (~150 bytes an
#: entry: 40 MiB at the bound).
MAX_INDEX_BLOCKS = 1 << 18


def pool_blocks(
    context_size: int,
    sequences: int = MAX_SEQUENCES_PER_STAGE,
    contexts: int = DEFAULT_POOL_CONTEXTS,
) -> int:
    """Blocks of a stage's pool: ``min(sequences, contexts)`` whole contexts, and one for
    a copy-on-write in flight (taken before the shared block it copies is dropped). Pure:
    the stage allocates it, the planner and a worker's ``Load`` check count it
    (:func:`meshnode.node.footprint.stage_kv_bytes`), the host admits by it less the one."""
    if context_size < 1 or sequences < 1 or contexts < 1:
        raise ValueError(f"bad KV pool: {contexts} contexts of {context_size}, {sequences} seqs")
    return min(sequences, contexts) * -(-context_size // KV_BLOCK) + 1


def request_blocks(positions: int, context_size: int) -> int:
    """Blocks a request may hold on a stage: its prompt, its ``max_tokens`` and a verify
    pass's drafts past them (``positions``), within the context; a cached prefix it
    shares counts whole (its admission never waits on another request's blocks)."""
    return -(-min(positions, context_size) // KV_BLOCK)


def pipeline_blocks(
    local: StagePrefix | None, context_size: int, remote: Sequence[int] = ()
) -> int | None:
    """The blocks a host admits requests by (``ServeService.start``): the smallest pool of
    the pipeline's paged stages less its copy-on-write block: ``local``'s (the host's stage)
    and :func:`pool_blocks` of ``context_size`` for a remote stage that announced a pool
    (``remote``: each one's ``Ready.prefix_block``). None when no stage keeps one (a
    hybrid model: each sequence preallocates its context, the sequence limit bounds them)."""
    if local is not None and local.snapshots:  # a hybrid model: no stage keeps blocks
        return None
    budgets = [] if local is None or local.kv is None else [local.kv.capacity - 1]
    if any(remote):
        budgets.append(pool_blocks(context_size) - 1)
    return min(budgets, default=None)


@dataclass(slots=True)
class Tracked:
    """What one sequence holds on this stage: the token id at each cached position (drafts
    included) and the keys of the pool blocks it references."""

    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    tried: int = 0  # full committed blocks a store was attempted for


class StagePrefix:
    """The stage side of the rule (module docstring): the stage's pool of KV blocks
    (``kv``: None on a hybrid stage, whose sequences keep contiguous caches), and
    its index of cached prefixes (``pool``: None where it keeps none); resumes sequences
    from the index and keys their committed blocks. Not thread-safe: the stage runner
    serializes calls."""

    #: Whether the stage resumes from recurrent snapshots at block boundaries (a hybrid
    #: stage, :class:`~meshnode.node.hybrid_prefix.HybridPrefix`), not from shared blocks.
    snapshots = False

    def __init__(self, pool: PrefixPool | None, kv: BlockPool | None = None) -> None:
        self.pool = pool
        self.kv = pool.kv if pool is not None else kv
        self.salt = "" if pool is None else pool.salt
        # which stage's blocks these are, across runs (meshnode.node.prefix_keep); empty:
        # the pool is never kept for another run
        self.identity = ""
        self._seqs: dict[RequestId, Tracked] = {}

    @classmethod
    def for_stage(
        cls,
        stage: Stage,
        context_size: int,
        *,
        budget_bytes: int | None,
        salt: str,
        sequences: int = MAX_SEQUENCES_PER_STAGE,
    ) -> StagePrefix:
        """A pool of :func:`pool_blocks` KV blocks for ``stage``'s layers (``sequences``
        of ``context_size``), on the stage's device; cached prefixes keep at most
        ``budget_bytes`` of its free blocks (None: all of them; 0: none, no index). None on
        a hybrid stage (its caches stay contiguous arrays: it resumes from snapshots)."""
        if stage.config.hybrid is not None:
            return cls(None)
        c, layers = stage.config, stage.end - stage.start
        dtype = stage.new_cache(1).k.dtype  # the K/V dtype this stage's caches hold
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"bad prefix pool: {budget_bytes} bytes")
        capacity = pool_blocks(context_size, sequences)
        per_block = max(block_bytes(layers, c.num_kv_heads, c.head_dim, dtype), 1)
        cached = capacity if budget_bytes is None else min(capacity, budget_bytes // per_block)
        blocks = BlockPool(layers, c.num_kv_heads, c.head_dim, capacity, dtype, xp=stage.xp)
        pool = PrefixPool(blocks, salt, cached) if cached else None
        return cls(pool, blocks)

    def reusable(self, identity: str, capacity: int) -> bool:
        """Whether a stage of ``identity`` whose pool holds ``capacity`` blocks may take
        this pool over (its old sequences all released): the same stage, same size."""
        same = bool(identity) and identity == self.identity and not self._seqs
        return same and self.pool is not None and self.pool.capacity == capacity

    def new_cache(self, max_tokens: int) -> PagedCache | None:
        """A paged cache of the stage's pool for a new sequence (None: no pool here)."""
        return None if self.kv is None else PagedCache(self.kv, max_tokens)

    def capacity_tokens(self, sequences: int, context_size: int) -> int:
        """Positions the stage's sequences may hold together: the pool's blocks less its
        copy-on-write one; without a pool, ``sequences`` whole contexts."""
        if self.kv is None:
            return sequences * context_size
        return (self.kv.capacity - 1) * self.kv.block

    @property
    def block(self) -> int:
        """Positions per block of the pool (0: no pool), announced in ``Ready``."""
        return 0 if self.pool is None else self.pool.block

    def resume(self, frame: StepFrame, cache: Any) -> list[int]:
        """Seed ``cache`` of a new sequence with the prefix ``frame.prefix_key`` names; the
        prefix's token ids. Raises :class:`PrefixMissError` when this stage does not hold
        it whole or it does not end where the frame starts (nothing is kept then)."""
        if self.pool is None or frame.prefix_key is None:
            raise PrefixMissError("this stage keeps no prefix cache")
        tokens, keys = self.pool.acquire(frame.prefix_key, cache)
        if len(tokens) != frame.start_pos:
            cache.truncate(0)
            raise PrefixMissError(
                f"the cached prefix has {len(tokens)} tokens; the frame starts at {frame.start_pos}"
            )
        self._seqs[frame.request_id] = Tracked(tokens, keys, len(keys))
        return tokens

    def written(self, frame: StepFrame, cache: Any) -> None:
        """After ``frame``'s forward: note what ``cache`` now holds and store the blocks
        that became committed."""
        if self.pool is None or (seq := self._track(frame, self.pool.stats)) is None:
            return
        block = self.pool.block
        if frame.start_pos < len(seq.keys) * block:  # rewritten (a refold, a replay)
            kept = _same_blocks(seq.tokens, frame.start_pos, frame.tokens, block)
            if kept < len(seq.keys):
                del seq.keys[kept:]
                seq.tried = min(seq.tried, kept)
        seq.tokens[frame.start_pos :] = frame.tokens
        full = (frame.end_pos - len(frame.drafts)) // block
        if full > seq.tried:
            seq.keys += self.pool.store(seq.tokens[: full * block], cache, len(seq.keys))
            seq.tried = full

    def _track(self, frame: StepFrame, stats: Any) -> Tracked | None:
        """The record of ``frame``'s sequence, its prefill rows counted as computed in
        ``stats``; None when the frame leaves a gap (never for a frame the stage took)."""
        seq = self._seqs.setdefault(frame.request_id, Tracked())
        if frame.kind is FrameKind.PREFILL:
            stats.miss_tokens += len(frame.tokens)
        return None if frame.start_pos > len(seq.tokens) else seq

    def release(self, request_id: RequestId) -> None:
        """The sequence ended (its cache emptied first): its keyed blocks stay cached,
        the least recently used beyond the budget evicted."""
        self._seqs.pop(request_id, None)
        if self.pool is not None:
            self.pool.trim()

    def usage(self) -> dict[str, int]:
        """The pool's blocks (:meth:`PrefixPool.usage`) and hit/miss counters, prefixed
        ``prefix_``; empty without a pool."""
        if self.pool is None:
            return {}
        s = self.pool.stats
        out = {f"prefix_{k}": v for k, v in self.pool.usage().items()}
        out |= {"prefix_hit_tokens": s.hit_tokens, "prefix_miss_tokens": s.miss_tokens}
        out |= {"prefix_evicted_blocks": s.evicted_blocks, "prefix_bytes": self.pool.nbytes()}
        return out


def _same_blocks(held: list[int], start: int, tokens: Sequence[int], block: int) -> int:
    """Leading whole blocks of ``held`` unchanged when ``tokens`` are written at ``start``."""
    for i in range(start // block, len(held) // block):
        lo, hi = i * block, (i + 1) * block
        new = tokens[max(lo - start, 0) : hi - start]
        if list(new) != held[max(lo, start) : max(lo, start) + len(new)]:
            return i
    return len(held) // block


@dataclass(slots=True)
class _Sent:
    tokens: list[int]
    keys: list[list[bytes]]  # each stage's chain keys of ``tokens``' full blocks


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a new sequence starts on each stage (``starts``, whole blocks, never
    decreasing) and the key of the prefix each resumes from (``keys``; None at 0). One
    entry: every stage starts there with that key (one salt for every stage)."""

    starts: tuple[int, ...]
    keys: tuple[bytes | None, ...]

    @property
    def start(self) -> int:
        """Stage 0's start: the prompt tokens no stage computes (``cached_tokens``)."""
        return self.starts[0]

    @property
    def key(self) -> bytes | None:
        """Stage 0's key."""
        return self.keys[0]

    def frame(self, frame: StepFrame) -> StepFrame:
        """``frame``, a piece of the prompt from :attr:`start` on, with what the stages need
        to resume it: stage 0's key on the piece at its start, and each later stage's
        start and key (:attr:`StepFrame.resume`) while one of them starts at or after the
        piece (a stage already past its start continues it from the piece's)."""
        key = self.key if frame.start_pos == self.start else None
        later = list(zip(self.starts[1:], self.keys[1:], strict=True))
        ahead = bool(later) and later[-1][0] > 0 and frame.start_pos <= later[-1][0]
        if not ahead:
            return replace(frame, prefix_key=key) if key is not None else frame
        at = frame.start_pos
        resume = tuple((s, k) if s >= at else (at, None) for s, k in later)
        return replace(frame, prefix_key=key, resume=resume)


class PrefixIndex:
    """The host side of the rule (module docstring): the keys of the blocks the stages of
    one pipeline should hold, least recently used first, at most ``limit`` of them, every
    stage's together (still far more than the stages' pools hold). ``salts`` are the
    stages' seeds, in order (each stage's prefix seed names the model, the dtypes and the
    arithmetic up to its layers, :mod:`meshnode.node.prefix_keep`, so the stages' keys
    differ); one salt: every stage keys with it (the run id from an older host)."""

    def __init__(
        self,
        salts: str | Sequence[str],
        *,
        block: int = PREFIX_BLOCK_TOKENS,
        limit: int = MAX_INDEX_BLOCKS,
        snapshots: bool = False,
    ) -> None:
        self.salts = (salts,) if isinstance(salts, str) else tuple(salts)
        if not self.salts:
            raise ValueError("a prefix index needs a salt")
        self.block = block
        self.limit = limit
        # hybrid stages: the keys are of boundaries snapshotted (prefill passes ended
        # there), a prefix resumes at the last one of them, not after leading blocks
        self.snapshots = snapshots
        # Every stage's keys in one order: a key names its stage (its salt differs).
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._sent: dict[RequestId, _Sent] = {}

    @classmethod
    def of_run(
        cls, stage0: StagePrefix, blocks: Sequence[int], salts: str | Sequence[str]
    ) -> PrefixIndex | None:
        """The index of a pipeline whose first stage is ``stage0`` and whose other stages
        announced ``blocks`` (``Ready.prefix_block``); None (requests never resume) unless
        every stage keeps a pool of stage 0's block size."""
        block = stage0.block
        agreed = block > 0 and all(b == block for b in blocks)
        return cls(salts, block=block, snapshots=stage0.snapshots) if agreed else None

    def resume_point(self, request_id: RequestId, prompt: Sequence[int]) -> ResumePoint:
        """Where the new sequence ``request_id`` of ``prompt`` starts on each stage, and
        the keys of the prefixes it resumes from (stage 0 at 0: from the beginning).

        A stage computes the rows the next one needs, so stage ``k`` starts at the
        smallest of what it and every later stage hold (whole blocks of the prompt, never
        its last token): after a re-plan the stages downstream of a changed one resume
        while the changed one, and those before it, compute from 0. On hybrid stages,
        the last boundary every stage believes, on all of them."""
        chains = [chain_keys(salt, prompt, self.block) for salt in self.salts]
        top = resume_length(len(prompt), len(prompt), self.block) // self.block
        if self.snapshots:  # the last boundary every stage believes, within reach
            known = next(
                (i + 1 for i in reversed(range(top)) if all(c[i] in self._keys for c in chains)),
                0,
            )
            blocks = [known] * len(chains)
        else:
            held = [next((i for i in range(top) if c[i] not in self._keys), top) for c in chains]
            blocks = list(itertools.accumulate(reversed(held), min))[::-1]
        self._sent[request_id] = _Sent(
            list(prompt[: blocks[0] * self.block]), [c[: blocks[0]] for c in chains]
        )
        starts = tuple(b * self.block for b in blocks)
        keys = tuple(c[b - 1] if b else None for c, b in zip(chains, blocks, strict=True))
        return ResumePoint(starts, keys)

    def passed(self, frame: StepFrame) -> None:
        """``frame``'s pass came back: every stage holds its committed positions."""
        sent = self._sent.setdefault(frame.request_id, _Sent([], [[] for _ in self.salts]))
        if frame.start_pos > len(sent.tokens):  # a pass this index did not see: stop here
            return
        sent.tokens[frame.start_pos :] = frame.tokens
        committed = frame.end_pos - len(frame.drafts)
        for keys, salt in zip(sent.keys, self.salts, strict=True):
            del keys[frame.start_pos // self.block :]
            extend_chain(keys, salt, sent.tokens[:committed], self.block)
            for key in self._believed(frame, keys):
                self._keys[key] = None
                self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def _believed(self, frame: StepFrame, keys: list[bytes]) -> list[bytes]:
        """The keys a stage holds after ``frame``'s pass (``keys``: its sequence's
        committed blocks'): all of them, or on hybrid stages the boundary a prefill pass
        ended at, where each stage kept a snapshot (``HybridPrefix.written``,
        :mod:`meshnode.node.hybrid_prefix`)."""
        if not self.snapshots:
            return keys
        end = frame.end_pos
        if not snapshot_at(frame, self.block) or len(keys) * self.block < end:
            return []
        return [keys[end // self.block - 1]]

    def believe(self, keys: Sequence[bytes]) -> None:
        """The stages hold the blocks of ``keys`` (least recently used first; each key
        names its stage): what the stages of a new run kept of an earlier one
        (:mod:`meshnode.node.prefix_keep`)."""
        for key in keys[-self.limit :]:
            self._keys[key] = None
            self._keys.move_to_end(key)

    def missed(self, prompt: Sequence[int]) -> None:
        """A stage lacked ``prompt``'s prefix: believe none of its blocks, on any stage."""
        for salt in self.salts:
            for key in chain_keys(salt, prompt, self.block):
                self._keys.pop(key, None)

    def released(self, request_id: RequestId) -> None:
        """The sequence ended (its blocks stay in the index)."""
        self._sent.pop(request_id, None)


def snapshot_at(frame: StepFrame, block: int) -> bool:
    """Whether a hybrid stage keeps a snapshot after ``frame``'s pass (and the host believes
    it does): a prefill piece of at least a ``block`` of rows (so computed on the engine's
    many-row path, as :func:`~meshnode.generation.prefix.prefill_pieces` cuts a prompt's;
    a replay's short last piece is not) that ends at a block boundary."""
    rows = len(frame.tokens)
    return frame.kind is FrameKind.PREFILL and rows >= block and frame.end_pos % block == 0


def note_pass(index: PrefixIndex | None, frame: StepFrame) -> None:
    """``frame``'s pass came back (:meth:`PrefixIndex.passed`; nothing without an index)."""
    if index is not None:
        index.passed(frame)


def note_release(index: PrefixIndex | None, request_id: RequestId) -> None:
    """The sequence ended (:meth:`PrefixIndex.released`; nothing without an index)."""
    if index is not None:
        index.released(request_id)


@dataclass(frozen=True, slots=True)
class NotedPass:
    """A queued pass (:class:`~meshnode.node.pipeline.QueuedPass`) whose result the index
    notes, as a ``run`` does."""

    inner: QueuedPass
    frame: StepFrame
    index: PrefixIndex

    async def result(self) -> StepResult:
        result = await self.inner.result()
        self.index.passed(self.frame)
        return result

    def cancel(self) -> None:
        self.inner.cancel()


@runtime_checkable
class PrefixCaching(Protocol):
    """A pipeline whose stages share cached prefixes (``prefix`` None: this one does not)."""

    prefix: PrefixIndex | None


class HostStage(Protocol):
    """What :func:`host_pools` reads of the host's stage (a ``StageRunner``)."""

    prefix: StagePrefix
    context_size: int


def host_pools(
    runner: HostStage,
    blocks: Sequence[int],
    salts: str | Sequence[str],
    held: Sequence[bytes] = (),
) -> tuple[PrefixIndex | None, int | None]:
    """What a host keeps of its pipeline's pools: the index of the prefixes the stages
    cache (:meth:`PrefixIndex.of_run`), believing ``held`` already, and the KV blocks its
    requests may hold at once (:func:`pipeline_blocks`). ``runner``: stage 0's;
    ``blocks``: each other stage's ``Ready.prefix_block``; ``salts``: each stage's prefix
    seed (:mod:`meshnode.node.prefix_keep`; one for all: the run id from an older host)."""
    index = PrefixIndex.of_run(runner.prefix, blocks, salts)
    if index is not None:
        index.believe(held)
    return index, pipeline_blocks(runner.prefix, runner.context_size, blocks)
