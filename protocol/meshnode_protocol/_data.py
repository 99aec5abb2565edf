"""Data-plane messages: activations from stage to stage, predictions back to the host,
releases, and their batched forms. The rules of every record are in ``_records``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from meshnode_protocol._fields import UInt
from meshnode_protocol._records import ACTIVATION_KINDS, Message, Record, Sampling, is_key
from meshnode_protocol._tensor import Tensor

#: Stages after this one a frame's ``resume_starts`` may name: more than any pipeline has
#: (one a layer), few enough that the lists stay small in a header (~40 bytes a stage).
MAX_RESUME_STAGES: Final = 255

# -- data plane ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TopLogprobs(Record):
    """The most likely alternatives at one position: parallel token ids and log-probs."""

    token_ids: tuple[UInt, ...]
    logprobs: tuple[float, ...]

    def _validate(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs must have the same length")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationFrame(Message):
    """One pipeline pass of one request, from stage to stage.

    The frame's rows are ``tokens`` followed by ``draft_tokens``, at positions
    ``start_pos, start_pos + 1, …``; each stage first truncates the request's KV cache to
    ``start_pos`` (rollback needs no message). ``payload`` is the hidden state
    ``[rows, hidden]`` (``None`` only when the frame enters the first stage, which embeds
    ``tokens``). The last stage computes logits for the last ``out_rows`` rows and, when
    ``final``, answers the host with a ``Prediction`` (``final`` is false on all but the last
    chunk of a chunked prefill). ``sampling`` may be omitted after a request's first frame.
    ``draft_probs`` are the proposer's probabilities: one per draft token, or (feature
    ``draft-distribution``) a ``[k, vocab]`` tensor of full distributions.
    ``stage_compute_us`` is the compute time of each stage after the first that the frame
    has passed through, in order (each middle stage appends its own), so that the host can
    tell each stage's compute from wire time; empty on the frame stage 0 sends.
    ``grammar`` (llguidance's serialized grammar, sent on the frame at ``start_pos`` 0 only)
    constrains the tokens the last stage chooses for this request from position
    ``grammar_start`` (the prompt's length) on. ``prefix_key`` (16 bytes in 32 lowercase
    hex digits, on a request's
    first frame only, at ``start_pos > 0``; sent only to stages whose ``Ready`` announced a
    prefix cache) asks each stage to resume the new request from its cached prefix of
    ``start_pos`` tokens, whose last block has this hash-chain key; a stage that lacks it
    answers ``PREFIX_MISS`` and the host sends the request again from 0.
    ``resume_starts`` and ``resume_keys`` (parallel, one entry for each later stage, in
    order; on a request's prompt frames only) say where each later stage starts the
    request: a stage sends the next one only the rows from that entry's start on (none,
    for a frame that ends before it: only a non-final one may), with ``start_pos`` that
    start, ``prefix_key`` the entry's key ("" for none; a key only at a start > 0) and the
    entries after it. Starts never decrease and none is below ``start_pos``; a final frame
    reaches every stage (each start is below its end). Empty: every later stage starts
    where this one does, with this frame's ``prefix_key``.
    """

    TYPE: ClassVar[int] = 30
    request_id: str
    run_id: str
    term: UInt
    kind: str
    start_pos: UInt
    tokens: tuple[UInt, ...]
    payload: Tensor | None = None
    sampling: Sampling | None = None
    draft_tokens: tuple[UInt, ...] = ()
    draft_probs: Tensor | tuple[float, ...] | None = None
    out_rows: UInt = 1
    final: bool = True
    logprobs: bool = False
    top_logprobs: UInt = 0
    stage_compute_us: tuple[UInt, ...] = ()
    mtp_drafts: UInt = 0
    grammar: str | None = None
    grammar_start: UInt = 0
    prefix_key: str | None = None
    resume_starts: tuple[UInt, ...] = ()
    resume_keys: tuple[str, ...] = ()

    def _validate(self) -> None:
        key = self.prefix_key
        if key is not None and not (is_key(key) and self.start_pos > 0):
            raise ValueError("prefix_key is 32 lowercase hex digits, at start_pos > 0")
        self._validate_resume()
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"kind must be one of {ACTIVATION_KINDS}, not {self.kind!r}")
        rows = len(self.tokens) + len(self.draft_tokens)
        if self.draft_tokens and self.kind != "verify":
            raise ValueError("draft_tokens are only sent with kind='verify'")
        if self.payload is not None and self.payload.shape[:1] != (rows,):
            raise ValueError(f"payload has shape {self.payload.shape}, expected {rows} rows")
        if self.out_rows > rows:
            raise ValueError(f"out_rows={self.out_rows} exceeds the frame's {rows} rows")
        self._validate_draft_probs()

    def _validate_resume(self) -> None:
        starts, keys = self.resume_starts, self.resume_keys
        if not starts and not keys:
            return
        if len(starts) != len(keys) or len(starts) > MAX_RESUME_STAGES:
            raise ValueError(f"resume_starts and resume_keys: one each for <= {MAX_RESUME_STAGES}")
        if self.kind != "prefill":
            raise ValueError("resume_starts are sent with kind='prefill' only")
        if any(b < a for a, b in zip((self.start_pos, *starts), starts, strict=False)):
            raise ValueError("resume_starts never decrease and start at start_pos or later")
        if any(k and not (is_key(k) and s > 0) for s, k in zip(starts, keys, strict=True)):
            raise ValueError("each of resume_keys is empty or 32 hex digits, at a start > 0")
        if self.final and starts[-1] >= self.start_pos + self.rows:
            raise ValueError("a final frame's resume_starts are below its end")

    def _validate_draft_probs(self) -> None:
        probs = self.draft_probs
        if probs is None:
            return
        k = len(self.draft_tokens)
        if isinstance(probs, Tensor):
            if len(probs.shape) != 2:
                raise ValueError("draft_probs as a tensor must be [k, vocab]")
            count = probs.shape[0]
        else:
            count = len(probs)
        if count != k:
            raise ValueError(f"draft_probs has {count} rows for {k} draft tokens")

    @property
    def rows(self) -> int:
        """Number of positions in this frame: ``len(tokens) + len(draft_tokens)``."""
        return len(self.tokens) + len(self.draft_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction(Message):
    """Last stage → host: ``accepted`` draft tokens were accepted, then one new token.

    ``tokens`` are what the host appends, starting at position ``start_pos``: the accepted
    drafts followed by the token sampled from the target (so ``accepted < len(tokens)``).
    ``logprobs``, when asked for, holds one log-probability per token, and
    ``top_logprobs`` (when the frame asked for ``top_logprobs > 0``) the alternatives at each
    token's position. ``compute_us`` is the last stage's compute time and
    ``stage_compute_us`` that of each stage between the first and the last, in order (copied
    from the frame), so the host can tell each stage's compute from wire time.
    ``drafts`` are the MTP module's guesses of the tokens after ``tokens`` (when the frame
    asked for ``mtp_drafts``), for the host to verify in its next frame.
    """

    TYPE: ClassVar[int] = 31
    request_id: str
    run_id: str
    term: UInt
    start_pos: UInt
    accepted: UInt
    tokens: tuple[UInt, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] = ()
    compute_us: UInt = 0
    stage_compute_us: tuple[UInt, ...] = ()
    drafts: tuple[UInt, ...] = ()

    def _validate(self) -> None:
        if not self.accepted < len(self.tokens):
            raise ValueError(f"accepted={self.accepted} needs more than that many tokens")
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError("logprobs must hold one value per token")
        if self.top_logprobs and len(self.top_logprobs) != len(self.tokens):
            raise ValueError("top_logprobs must hold one entry per token")


@dataclass(frozen=True, slots=True, kw_only=True)
class Release(Message):
    """Host → every stage: the request ended; free its KV cache."""

    TYPE: ClassVar[int] = 32
    request_id: str
    run_id: str
    term: UInt


#: Frames (or predictions) in one batch message. A step carries at most one frame per
#: sequence and a stage holds a few dozen sequences at most; the bound keeps a hostile
#: header from making the receiver build an unbounded list of records.
MAX_BATCH_FRAMES: Final = 256


def _check_batch(
    name: str, items: tuple[ActivationFrame, ...] | tuple[Prediction, ...], run_id: str, term: int
) -> None:
    if not 1 <= len(items) <= MAX_BATCH_FRAMES:
        raise ValueError(f"a batch carries 1 to {MAX_BATCH_FRAMES} {name}, not {len(items)}")
    if any(item.run_id != run_id or item.term != term for item in items):
        raise ValueError(f"every one of a batch's {name} names the batch's run and term")
    if len({item.request_id for item in items}) != len(items):
        raise ValueError(f"a batch carries at most one of its {name} per request")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationBatch(Message):
    """One pipeline step of several requests, from stage to stage as one message
    (feature ``activation-batch``).

    Each of ``frames`` means exactly what it means alone, and the receiving stage runs them
    as one multi-row forward; their payloads follow one another in the frame's raw payload,
    in order. At most one frame per request, all of this ``run_id`` and ``term``. The next
    stage receives the step as a batch again; the last stage answers with one
    ``PredictionBatch`` for the frames that want a token.
    """

    TYPE: ClassVar[int] = 33
    run_id: str
    term: UInt
    frames: tuple[ActivationFrame, ...]

    def _validate(self) -> None:
        _check_batch("frames", self.frames, self.run_id, self.term)


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictionBatch(Message):
    """Last stage → host: the ``Prediction`` of each final frame of one ``ActivationBatch``
    (feature ``activation-batch``), each meaning what it means alone."""

    TYPE: ClassVar[int] = 34
    run_id: str
    term: UInt
    predictions: tuple[Prediction, ...]

    def _validate(self) -> None:
        _check_batch("predictions", self.predictions, self.run_id, self.term)
