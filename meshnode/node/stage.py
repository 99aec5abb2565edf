"""The stage host: one engine ``Stage`` (a layer range) and the sequences passing through it.

:class:`StageRunner` is the same object on every node of a pipeline; it does no I/O. For
each frame it finds (or creates) the sequence's KV cache, runs the stage's layers from
``start_pos`` (the engine truncates the cache there first, which is how a rejected draft
is rolled back) and returns either the hidden states for the next stage or, on the last
stage, a :class:`~meshnode.node.pipeline.StepResult` with the chosen tokens.

The last stage decides tokens itself (DESIGN §2): it keeps each sequence's token history
(from the frames' ``tokens``, truncated with ``start_pos``) for the penalties, samples
with the sequence's counter-based generator at each token's position (keyed on the
request's seed, so no state of it lives only here: a replay on another last stage draws
the same), and for a verify frame applies the acceptance rule of
``meshnode.speculative.acceptance`` to the ``k + 1`` rows it computed.

Calls are not thread-safe: the owner serializes ``process`` and ``release`` (the local
pipeline holds a lock around both).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from meshnode.engine.config import ModelConfig
from meshnode.engine.constraint import Constraint, GrammarError, Grammars
from meshnode.engine.model import BatchRow, HostArray, Stage, token_ids
from meshnode.engine.mtp import MtpCache
from meshnode.engine.prefix_cache import PrefixMissError
from meshnode.engine.recurrent import HybridCache, RollbackError
from meshnode.engine.sampling import Sampler, SamplingParams
from meshnode.node.hybrid_prefix import stage_prefix
from meshnode.node.pipeline import (
    MAX_SEQUENCES_PER_STAGE,
    FrameKind,
    PipelineError,
    RequestId,
    Slot,
    StepFrame,
    StepResult,
    TokenLogprob,
)
from meshnode.node.prefix import StagePrefix
from meshnode.speculative.decide import Decision, decide

T = TypeVar("T")

#: Context when nobody chooses one: the model's own limit, capped because every live
#: sequence preallocates a KV cache of this many positions on every stage
#: (``MAX_SEQUENCES_PER_STAGE``, :mod:`meshnode.node.pipeline`).
DEFAULT_MAX_CONTEXT = 2048


def default_context(config: ModelConfig) -> int:
    """The context a model is served with when none is asked for."""
    return min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT)


class StageError(PipelineError):
    """A frame this stage cannot process (a gap in positions, the sequence limit, ...)."""


@dataclass(slots=True)
class _Sequence:
    """Per-sequence state on this stage."""

    cache: Any
    sampling: SamplingParams
    sampler: Sampler | None = None
    history: list[int] = field(default_factory=list)
    # Where the prompt ends in ``history``: penalties count generated tokens only, as the
    # engine's ``generate`` does (and vLLM for presence/frequency).
    prompt_len: int = 0
    mtp: MtpCache | None = None  # the MTP drafter's KV (last stage, frames asking drafts)
    constraint: Constraint | None = None  # the grammar's state (last stage, constrained)


class StageRunner:
    """Runs frames of many sequences through one stage; see the module docstring."""

    def __init__(
        self,
        stage: Stage,
        *,
        context_size: int,
        max_sequences: int = MAX_SEQUENCES_PER_STAGE,
        grammars: Grammars | None = None,
        prefix_cache_bytes: int | None = None,
        prefix_salt: str = "",
        prefix_identity: str = "",
        prefix: StagePrefix | None = None,
    ):
        """``grammars`` builds the constraints of sequences that carry a grammar (last
        stage; without it such a sequence is refused). ``prefix_cache_bytes`` bounds the
        pool of cached prefixes (None: ``DEFAULT_PREFIX_CONTEXTS`` contexts; 0: none),
        whose keys ``prefix_salt`` (the run's prefix seed) seeds (:mod:`meshnode.node.prefix`);
        ``prefix``: an earlier run's pool to take over, which ``prefix_identity`` names as
        a pool of the same stage of the same pipeline (:mod:`meshnode.node.prefix_keep`)."""
        if context_size < 2 or max_sequences < 1:
            raise ValueError(f"bad limits: context {context_size}, sequences {max_sequences}")
        self.stage = stage
        self.first = stage.embed
        self.last = stage.head
        self.context_size = context_size
        self.max_sequences = max_sequences
        self._sequences: dict[RequestId, _Sequence] = {}
        self._grammars = grammars
        # Released caches are kept for the next sequence: allocating a context-sized cache
        # per request would churn hundreds of MiB per second under load.
        self._free_caches: list[Any] = []
        # Sequences whose resume this stage refused (issue 30), until released: their later
        # prompt pieces, already on their way, are refused as misses too, so the host hears
        # a miss on the final piece it waits for, not an unknown sequence.
        self._missed: OrderedDict[RequestId, None] = OrderedDict()
        # Hook (issue 30): the pool of cached prefixes shared by this stage's sequences.
        self.prefix = prefix or stage_prefix(
            stage,
            context_size,
            budget_bytes=prefix_cache_bytes,
            salt=prefix_salt,
            sequences=max_sequences,
        )
        self.prefix.identity = prefix_identity

    @property
    def batches(self) -> bool:
        """Whether a list of frames runs as one forward here (the CUDA stage runs them one
        by one)."""
        return self.stage.backend.name == "cpu"

    @property
    def live_sequences(self) -> int:
        """Sequences holding a KV cache on this stage."""
        return len(self._sequences)

    def activations(self, frame: StepFrame) -> HostArray:
        """Run ``frame`` through a stage that is not the last: the hidden states
        ``[len(tokens), hidden]`` for the next stage, in host memory.

        Raises StageError on the last stage, and for frames that do not fit this sequence
        or the limits.
        """
        return self.activations_batch([frame])[0]

    def activations_batch(self, frames: Sequence[StepFrame]) -> list[HostArray]:
        """Run several sequences' frames as one forward (one read of the weights); the
        hidden states of each, in order, as :meth:`activations` returns them.

        Raises StageError on the last stage, for two frames of one sequence, and for any
        frame that does not fit (check each with :meth:`admit` first to fail only it).
        """
        if self.last:
            raise StageError("the last stage returns tokens, not activations")
        seqs = self._admit_all(frames)
        outs = self._forward(frames, seqs)
        # Host memory at the stage boundary: the only device-to-host copy of a stage.
        return [self.stage.backend.to_numpy(out) for out in outs]

    def result(self, frame: StepFrame) -> StepResult:
        """Run ``frame`` through the last stage: the tokens it commits (none for a
        non-final prefill chunk).

        Raises StageError on a stage that is not the last, and for frames that do not fit
        this sequence or the limits.
        """
        return self.results_batch([frame])[0]

    def results_batch(self, frames: Sequence[StepFrame]) -> list[StepResult]:
        """Run several sequences' frames through the last stage as one forward; each
        frame's :class:`StepResult`, in order. Each sequence samples with its own state,
        so its tokens are those it would get alone. ``compute_s`` of each is the batch's.

        Raises StageError on a stage that is not the last, for two frames of one sequence,
        and for any frame that does not fit (check each with :meth:`admit` first).
        """
        if not self.last:
            raise StageError("only the last stage decides tokens")
        if any(f.mtp_drafts for f in frames):  # the MTP drafter reads the forward's hidden rows
            return [self._result_alone(frame) for frame in frames]
        began = time.perf_counter()
        seqs = self._admit_all(frames)
        outs = self._forward(frames, seqs)
        decided = [self._decide(f, s, o) for f, s, o in zip(frames, seqs, outs, strict=True)]
        elapsed = time.perf_counter() - began
        return [_result(frame, d, elapsed) for frame, d in zip(frames, decided, strict=True)]

    def _result_alone(self, frame: StepFrame) -> StepResult:
        began = time.perf_counter()
        (seq,) = self._admit_all([frame])
        (out,) = self._forward([frame], [seq])
        decided = self._decide(frame, seq, out)
        drafts = self._mtp_drafts(frame, seq, decided.accepted, decided.tokens)
        return _result(frame, decided, time.perf_counter() - began, drafts)

    def admit(self, frame: StepFrame) -> None:
        """Check that ``frame`` fits the model, its sequence and the limits, creating the
        sequence for a frame at position 0. Raises StageError naming what does not fit."""
        _check_frame(self.stage.config, frame)
        self._check_positions(frame, self._sequence(frame))
        if not self.first and frame.hidden is None:
            raise StageError(f"frame of {frame.request_id} carries no hidden states")

    def memory(self) -> dict[str, int]:
        """Bytes held by this stage's sequence caches (live and kept for reuse); for a
        hybrid model also the recurrent state, the snapshot ring and the ring's restores."""
        caches = [*self._free_caches, *(s.cache for s in self._sequences.values())]
        out = {"cache_bytes": sum(int(c.nbytes()) for c in caches)}
        hybrid = [c for c in caches if isinstance(c, HybridCache)]
        if hybrid:
            out["recurrent_state_bytes"] = sum(c.recurrent_nbytes() for c in hybrid)
            out["snapshot_ring_bytes"] = sum(c.ring_nbytes() for c in hybrid)
            out["snapshot_ring_slots"] = hybrid[0].ring_slots
            out["ring_restores"] = sum(c.restores for c in hybrid)
        return out

    def kv_usage(self) -> dict[str, int]:
        """How full this stage's KV caches are: live sequences of at most ``max_sequences``,
        and positions held of what they may hold together
        (:meth:`~meshnode.node.prefix.StagePrefix.capacity_tokens`); with a prefix pool, its
        blocks (or a hybrid stage's snapshots) and hit/miss tokens (``prefix_…``)."""
        # One C-level copy: the compute thread may add a sequence while the loop reads.
        live = list(self._sequences.values())
        return {
            "sequences": len(live),
            "max_sequences": self.max_sequences,
            "used_tokens": sum(int(s.cache.length) for s in live),
            "capacity_tokens": self.prefix.capacity_tokens(self.max_sequences, self.context_size),
        } | self.prefix.usage()

    def release(self, request_id: RequestId) -> bool:
        """Free the sequence's cache; False if it was not live (release is idempotent)."""
        self._missed.pop(request_id, None)
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        seq.cache.release_pages()  # kept for the next sequence, its memory handed back
        self.prefix.release(request_id)  # hook (issue 30): its blocks stay cached
        self._free_caches.append(seq.cache)
        return True

    def release_all(self) -> None:
        """Free every sequence (a run that ended: its pool may serve the next one)."""
        for request_id in list(self._sequences):
            self.release(request_id)

    # -- sequences --------------------------------------------------------------------

    def _sequence(self, frame: StepFrame) -> _Sequence:
        seq = self._sequences.get(frame.request_id)
        if seq is not None:
            return seq
        if frame.request_id in self._missed and frame.start_pos != 0:
            raise PrefixMissError(f"sequence {frame.request_id} missed its cached prefix here")
        if frame.start_pos != 0 and frame.prefix_key is None:
            raise StageError(
                f"sequence {frame.request_id} is unknown here and the frame starts at "
                f"{frame.start_pos}, not 0 (released, or this stage restarted)"
            )
        if len(self._sequences) >= self.max_sequences:
            raise StageError(f"this stage already holds {self.max_sequences} sequences")
        cache = (
            self._free_caches.pop()
            if self._free_caches
            # hook (issue 30): a paged cache of the stage's pool where it keeps one
            else self.prefix.new_cache(self.context_size) or self.stage.new_cache(self.context_size)
        )
        self._missed.pop(frame.request_id, None)  # a frame at 0 starts it over
        seq = _Sequence(cache=cache, sampling=frame.sampling)
        if frame.prefix_key is not None:  # hook (issue 30): resume from the cached prefix
            try:
                seq.history = self.prefix.resume(frame, cache)
            except PrefixMissError:
                self._free_caches.append(cache)
                self._missed[frame.request_id] = None
                while len(self._missed) > 2 * self.max_sequences:
                    self._missed.popitem(last=False)
                raise
        if self.last:
            seq.sampler = Sampler(frame.sampling)
            if frame.grammar is not None:
                seq.constraint = self._constraint(frame)
        self._sequences[frame.request_id] = seq
        return seq

    def _constraint(self, frame: StepFrame) -> Constraint:
        assert frame.grammar is not None
        if self._grammars is None:
            raise StageError("this stage cannot enforce grammars (no tokenizer given)")
        try:
            return self._grammars.constraint(frame.grammar, frame.grammar_start)
        except GrammarError as exc:
            raise StageError(f"sequence {frame.request_id}: {exc}") from exc

    def _check_positions(self, frame: StepFrame, seq: _Sequence) -> None:
        if frame.start_pos > seq.cache.length:
            raise StageError(
                f"frame of {frame.request_id} starts at {frame.start_pos} but only "
                f"{seq.cache.length} positions are cached"
            )
        if frame.end_pos > self.context_size:
            raise StageError(
                f"frame of {frame.request_id} ends at {frame.end_pos}, beyond the context "
                f"of {self.context_size}"
            )

    # -- compute ------------------------------------------------------------------------

    def _admit_all(self, frames: Sequence[StepFrame]) -> list[_Sequence]:
        if len({f.request_id for f in frames}) != len(frames):
            raise StageError("a batch carries at most one frame of each sequence")
        for frame in frames:
            self.admit(frame)
        return [self._sequences[f.request_id] for f in frames]

    def _forward(self, frames: Sequence[StepFrame], seqs: Sequence[_Sequence]) -> list[Any]:
        items = [self._row(f, s) for f, s in zip(frames, seqs, strict=True)]
        outs = self.stage.forward_batch(items)
        for frame, seq in zip(frames, seqs, strict=True):  # hook (issue 30): store blocks
            self.prefix.written(frame, seq.cache)
        return outs

    def _row(self, frame: StepFrame, seq: _Sequence) -> BatchRow:
        inputs: Any = token_ids(frame.tokens) if self.first else frame.hidden
        if self.last:
            seq.history[frame.start_pos :] = frame.tokens
            if frame.kind is FrameKind.PREFILL and frame.final:
                seq.prompt_len = frame.end_pos
        # the MTP drafter reads every row's hidden state
        self.stage.keep_hidden(self.stage.mtp is not None and frame.mtp_drafts > 0)
        # Only the rows whose logits are used go through the head (engine out_rows).
        return BatchRow(inputs, frame.start_pos, seq.cache, _out_rows(frame))

    def _decide(self, frame: StepFrame, seq: _Sequence, logits: Any) -> Decision:
        """The tokens a frame commits (none for a non-final prefill chunk), decided by
        :func:`meshnode.speculative.decide.decide` over the host copy of its rows."""
        if not frame.final:
            return Decision()
        assert seq.sampler is not None
        to_host = self.stage.backend.to_numpy
        raw = to_host(logits)
        rows = raw if seq.constraint is None else _constrained(frame, seq, raw)
        verifying = frame.kind is FrameKind.VERIFY
        probs = frame.draft_probs
        return decide(
            rows,
            seq.sampler,
            seq.history[seq.prompt_len :],
            end_pos=frame.end_pos,
            prompt_len=seq.prompt_len,
            drafts=frame.drafts if verifying else None,
            draft_probs=to_host(probs) if verifying and probs is not None else None,
            raw=raw,
            top=frame.top_logprobs,
        )

    def _mtp_drafts(
        self, frame: StepFrame, seq: _Sequence, accepted: int, tokens: Sequence[int]
    ) -> tuple[int, ...]:
        """Drafts of the model's MTP module for the tokens after ``tokens`` (DESIGN §7):
        the committed rows of this frame feed its layer, then it chains greedy drafts."""
        mtp = self.stage.mtp
        if mtp is None or frame.mtp_drafts == 0:
            return ()
        if seq.mtp is None:
            seq.mtp = mtp.new_cache(self.context_size)
        rows = accepted + 1 if frame.kind is FrameKind.VERIFY else len(frame.tokens)
        following = tokens[-1] if tokens else None  # the token after the last committed row
        hidden = self.stage.last_hidden[:rows]
        out = mtp.absorb(seq.mtp, frame.start_pos, hidden, list(frame.tokens[:rows]), following)
        if out is None or following is None:
            return ()
        return tuple(mtp.draft(seq.mtp, out, frame.mtp_drafts))


def _result(
    frame: StepFrame, decided: Decision, elapsed: float, drafts: tuple[int, ...] = ()
) -> StepResult:
    logprobs = None
    if decided.logprobs is not None:
        logprobs = tuple(
            TokenLogprob(token, logprob, top)
            for token, (logprob, top) in zip(decided.tokens, decided.logprobs, strict=True)
        )
    return StepResult(
        request_id=frame.request_id,
        accepted=decided.accepted,
        tokens=decided.tokens,
        logprobs=logprobs,
        compute_s=elapsed,
        stage_compute_s=(elapsed,),
        drafts=drafts,
    )


def step_results(runner: StageRunner, slots: list[Slot[StepResult]]) -> None:
    """One batched step on the last stage (in a worker thread): each slot's result, or its
    error when its frame does not fit or fails (that frame alone fails where it can)."""
    _step(runner, slots, runner.results_batch)


def step_activations(runner: StageRunner, slots: list[Slot[HostArray]]) -> None:
    """One batched step on a stage that is not the last: each slot's hidden states for the
    next stage, or its error (as :func:`step_results`)."""
    _step(runner, slots, runner.activations_batch)


def _step(
    runner: StageRunner,
    slots: list[Slot[T]],
    compute: Callable[[Sequence[StepFrame]], list[T]],
) -> None:
    admitted = [slot for slot in slots if _admit(runner, slot)]
    groups = [admitted] if runner.batches else [[slot] for slot in admitted]
    while groups:
        group = groups.pop()
        if not group:
            continue
        try:
            outputs = compute([slot.frame for slot in group])
        except (RollbackError, StageError, PrefixMissError, ValueError) as exc:
            if len(group) > 1:
                # Which frame failed is not known (a hybrid sequence rolled back past its
                # snapshot ring, a grammar that forbids every token): each runs alone, so
                # that only its own frame fails. A forward starts by truncating its
                # caches to the frame's start, so running a frame again is safe.
                groups.extend([slot] for slot in group)
                continue
            (slot,) = group
            known = RollbackError | StageError | PrefixMissError
            slot.error = exc if isinstance(exc, known) else StageError(str(exc))
            continue
        for slot, output in zip(group, outputs, strict=True):
            slot.output = output


def _admit(runner: StageRunner, slot: Slot[Any]) -> bool:
    try:
        runner.admit(slot.frame)
    except (StageError, PrefixMissError) as exc:
        slot.error = exc
        return False
    return True


def _constrained(frame: StepFrame, seq: _Sequence, rows: Any) -> Any:
    """The logits rows with the sequence's grammar applied (:mod:`meshnode.engine.constraint`):
    the constraint is synced to the committed tokens (those before the frame's drafts), then
    masks row ``i`` after drafts ``d_1 … d_i``."""
    constraint = seq.constraint
    assert constraint is not None
    committed = seq.history[constraint.start : frame.end_pos - len(frame.drafts)]
    try:
        constraint.sync(committed)
        return constraint.mask(rows, frame.drafts)
    except GrammarError as exc:
        raise StageError(f"sequence {frame.request_id}: {exc}") from exc


def _check_frame(config: ModelConfig, frame: StepFrame) -> None:
    """Refuse a frame whose ids or shapes do not fit this model: frames come from other
    nodes, and an id past the vocabulary would index past the embedding or the logits."""
    vocab = config.vocab_size
    bad = next((t for t in frame.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise StageError(f"frame of {frame.request_id}: token id {bad} is outside 0..{vocab - 1}")
    top = frame.top_logprobs
    if top is not None and not 0 <= top <= vocab:
        raise StageError(f"frame of {frame.request_id}: top_logprobs {top} > {vocab} tokens")
    probs = frame.draft_probs
    if probs is not None and tuple(probs.shape) != (len(frame.tokens) - 1, vocab):
        raise StageError(
            f"frame of {frame.request_id}: draft_probs of shape {tuple(probs.shape)}, "
            f"not {(len(frame.tokens) - 1, vocab)}"
        )
    hidden = frame.hidden
    width = config.hidden_size
    if hidden is not None and tuple(hidden.shape) != (len(frame.tokens), width):
        raise StageError(
            f"frame of {frame.request_id}: activations of shape {tuple(hidden.shape)}, "
            f"not {(len(frame.tokens), width)}"
        )


def _out_rows(frame: StepFrame) -> int:
    """Logit rows the last stage needs: k + 1 to verify k drafts, else one."""
    return len(frame.tokens) if frame.kind is FrameKind.VERIFY else 1
