"""Translation between the pipeline's records and their wire messages, in one place.

``StepFrame`` ⇄ ``ActivationFrame`` and ``StepResult`` ⇄ ``Prediction`` (several of them
travel as one ``ActivationBatch``/``PredictionBatch`` to peers that accept it:
:func:`for_peer`). Activations travel as raw tensors in the frame's payload, in the run's
wire dtype (f16 by default: half the bytes of f32 for a rounding of about 1e-3 relative,
see ``benchmarks/split.py``).

Two things keep a decode frame small and allocation-free:

- ``sampling`` travels only on a sequence's first frame (``start_pos == 0``: the frame that
  creates the sequence on every stage, see ``StageRunner``), which the protocol allows; the
  receiving side remembers it per sequence (:class:`WireSequences`) instead of defaulting.
- Activations are staged through per-sequence arrays that are reused frame after frame
  (:class:`WireSequences`, each sequence's ``meshnode.engine.activations.Staging``): the
  outgoing wire-dtype copy and the incoming float32 copy are written in place, so a decode
  step allocates no activation-sized arrays here.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any

from meshnode_protocol import (
    BATCH_FEATURE,
    MAX_HEADER_BYTES,
    SPEED_QUERY_FEATURE,
    ActivationBatch,
    ActivationFrame,
    Message,
    Prediction,
    PredictionBatch,
    Sampling,
    SpeedQuery,
    SpeedReport,
    Tensor,
    TopLogprobs,
    header_size,
)

from meshnode.engine.activations import Staging, from_wire, to_wire, wire_nbytes
from meshnode.engine.model import HostArray
from meshnode.engine.sampling import SamplingParams
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame, StepResult, TokenLogprob


def sampling_to_wire(params: SamplingParams) -> Sampling:
    """The wire record of ``params``: the same fields, copied by name."""
    return Sampling(**{spec.name: getattr(params, spec.name) for spec in fields(Sampling)})


def sampling_from_wire(sampling: Sampling) -> SamplingParams:
    """The sampling record a wire ``Sampling`` carries (the inverse of :func:`sampling_to_wire`).

    Raises ValueError for a value outside a knob's range.
    """
    return SamplingParams(
        **{spec.name: getattr(sampling, spec.name) for spec in fields(SamplingParams)}
    )


def tensor_from_array(array: Any, dtype: str) -> Tensor:
    """``array`` (host memory, any float dtype) as a wire tensor of ``dtype``."""
    host = to_wire(array, dtype)
    return Tensor(dtype=dtype, shape=tuple(int(d) for d in host.shape), data=host.data)


def array_from_tensor(tensor: Tensor) -> HostArray:
    """A float32 array of the tensor's values (the engine computes in float32)."""
    return from_wire(tensor.data, tensor.dtype, tensor.shape)


#: Bytes of activations a sequence's staging keeps for reuse, each way. A decode or verify
#: frame (33 rows at a window of 32, hidden 16,384, float32: 2.2 MB) is staged in place; a
#: larger one (a prefill chunk) gets a copy of its own that goes with it. So a peer pins at
#: most this much per sequence (issue 36, item 6: before, buffers grew to any frame a peer
#: sent and stayed until Release: 8 refused 67 MB frames pinned 1.2 GiB).
MAX_KEPT_STAGING_BYTES = 4 << 20


@dataclass(slots=True)
class _WireSequence:
    sampling: SamplingParams | None = None
    staging: Staging = field(default_factory=Staging)  # its activation buffers


class WireSequences:
    """What one stage's wire layer remembers per sequence: its sampling and its buffers.

    Buffers grow to the largest frame a sequence sent (a prefill chunk) and are then
    reused, so the decode loop writes each activation into the same memory every step.
    A frame's tensor views the buffer: it must be encoded (``Connection.send`` copies it
    into the frame) before the sequence's next frame is staged, which holds because a
    sequence has at most one frame in flight per stage. At most ``max_sequences`` are kept;
    a sequence never released (its ``Release`` lost with a broken session) is evicted
    oldest-first rather than held forever.
    """

    def __init__(self, max_sequences: int) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.max_sequences = max_sequences
        self._sequences: OrderedDict[RequestId, _WireSequence] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def kept_bytes(self) -> int:
        """Bytes of activations kept for reuse, over every sequence."""
        return sum(seq.staging.nbytes for seq in self._sequences.values())

    def release(self, request_id: RequestId) -> None:
        """Forget the sequence (idempotent)."""
        self._sequences.pop(request_id, None)

    def _get(self, request_id: RequestId) -> _WireSequence:
        seq = self._sequences.get(request_id)
        if seq is None:
            seq = self._sequences[request_id] = _WireSequence()
            while len(self._sequences) > self.max_sequences:
                self._sequences.popitem(last=False)
        return seq

    def tensor_from_array(self, request_id: RequestId, array: Any, dtype: str) -> Tensor:
        """``array`` ``[rows, hidden]`` as a wire tensor of ``dtype``, staged in place (up
        to :data:`MAX_KEPT_STAGING_BYTES`)."""
        if wire_nbytes(array, dtype) > MAX_KEPT_STAGING_BYTES:
            return tensor_from_array(array, dtype)
        staged = self._get(request_id).staging.to_wire(array, dtype)
        return Tensor(dtype=dtype, shape=tuple(int(d) for d in staged.shape), data=staged.data)

    def array_from_tensor(
        self, request_id: RequestId, tensor: Tensor, shape: tuple[int, int] | None = None
    ) -> HostArray:
        """The tensor's values as float32, written into the sequence's reused array (up to
        :data:`MAX_KEPT_STAGING_BYTES`). Raises ValueError, before copying anything, when
        ``shape`` is given and the tensor's is another."""
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"frame of {request_id}: activations of shape {tuple(tensor.shape)}, not {shape}"
            )
        if math.prod(tensor.shape) * 4 > MAX_KEPT_STAGING_BYTES:  # float32 on this side
            return array_from_tensor(tensor)
        return self._get(request_id).staging.from_wire(tensor.data, tensor.dtype, tensor.shape)

    def sampling_of(self, message: ActivationFrame) -> SamplingParams:
        """The sequence's sampling: the frame's own, else the one its first frame carried.

        Raises ValueError for a frame without sampling of a sequence not seen here (its
        first frame went elsewhere, or this stage restarted): no default is invented.
        """
        request_id = RequestId(message.request_id)
        if message.sampling is not None:
            params = sampling_from_wire(message.sampling)
            self._get(request_id).sampling = params
            return params
        seq = self._sequences.get(request_id)
        if seq is None or seq.sampling is None:
            raise ValueError(
                f"frame of {message.request_id} at {message.start_pos} carries no sampling "
                "and its sequence is unknown on this stage"
            )
        return seq.sampling


def frame_to_wire(
    frame: StepFrame,
    hidden: Any,
    *,
    run_id: str,
    term: int,
    wire_dtype: str,
    sequences: WireSequences | None = None,
    stage_compute_us: tuple[int, ...] = (),
) -> ActivationFrame:
    """The frame as sent downstream, carrying ``hidden`` (this stage's output) as payload.

    With ``sequences`` the payload is staged in the sequence's reused buffer. Sampling
    travels only on the frame at ``start_pos == 0``, which creates the sequence downstream.
    ``stage_compute_us`` are the compute times of the stages after the first so far.
    """
    draft_probs = None
    if frame.draft_probs is not None:
        # Draft distributions stay float32: the acceptance rule divides by them.
        draft_probs = tensor_from_array(frame.draft_probs, "f32")
    # A sequence's first frame: at 0, or resuming from a cached prefix (issue 30).
    first = frame.start_pos == 0 or frame.prefix_key is not None
    once = first or bool(frame.resume)  # where the grammar travels (below)
    if sequences is None:
        payload = tensor_from_array(hidden, wire_dtype)
    else:
        payload = sequences.tensor_from_array(frame.request_id, hidden, wire_dtype)
    return ActivationFrame(
        request_id=str(frame.request_id),
        run_id=run_id,
        term=term,
        kind=str(frame.kind),
        start_pos=frame.start_pos,
        # On the wire a verify frame's rows are ``tokens`` then ``draft_tokens``.
        tokens=frame.tokens[:1] if frame.kind is FrameKind.VERIFY else frame.tokens,
        payload=payload,
        sampling=sampling_to_wire(frame.sampling) if first else None,
        draft_tokens=frame.drafts,
        draft_probs=draft_probs,
        out_rows=len(frame.tokens) if frame.kind is FrameKind.VERIFY else 1,
        final=frame.final,
        logprobs=frame.top_logprobs is not None,
        top_logprobs=frame.top_logprobs or 0,
        stage_compute_us=stage_compute_us,
        mtp_drafts=frame.mtp_drafts,
        # Like sampling, the grammar travels once: the last stage keeps it per sequence;
        # and on a prompt piece that says where later stages start (issue 30): a later
        # stage's first frame may be cut from a piece that is not this stage's first.
        grammar=frame.grammar if once else None,
        grammar_start=frame.grammar_start if once and frame.grammar is not None else 0,
        prefix_key=None if frame.prefix_key is None else frame.prefix_key.hex(),
        resume_starts=tuple(start for start, _ in frame.resume),
        resume_keys=tuple("" if key is None else key.hex() for _, key in frame.resume),
    )


def frame_from_wire(
    message: ActivationFrame, sequences: WireSequences, *, hidden_size: int | None = None
) -> StepFrame:
    """The pipeline frame an ``ActivationFrame`` describes (hidden as float32).

    ``sequences`` supplies the sampling of frames that omit it and the reused input array.
    With ``hidden_size``, activations must be ``[tokens, hidden_size]``, checked before
    they are copied. Raises ValueError for a frame this node cannot interpret (see
    :meth:`WireSequences.sampling_of`, unsupported dtypes, that shape).
    """
    request_id = RequestId(message.request_id)
    draft_probs = None
    if isinstance(message.draft_probs, Tensor):
        draft_probs = array_from_tensor(message.draft_probs)
    hidden = None
    if message.payload is not None:
        rows = len(message.tokens) + len(message.draft_tokens)
        shape = None if hidden_size is None else (rows, hidden_size)
        hidden = sequences.array_from_tensor(request_id, message.payload, shape)
    return StepFrame(
        request_id=request_id,
        kind=FrameKind(message.kind),
        start_pos=message.start_pos,
        tokens=message.tokens + message.draft_tokens,
        sampling=sequences.sampling_of(message),
        final=message.final,
        draft_probs=draft_probs,
        hidden=hidden,
        top_logprobs=message.top_logprobs if message.logprobs else None,
        mtp_drafts=message.mtp_drafts,
        grammar=message.grammar,
        grammar_start=message.grammar_start,
        prefix_key=None if message.prefix_key is None else bytes.fromhex(message.prefix_key),
        resume=tuple(
            (start, bytes.fromhex(key) if key else None)
            for start, key in zip(message.resume_starts, message.resume_keys, strict=True)
        ),
    )


def result_to_wire(
    result: StepResult,
    *,
    run_id: str,
    term: int,
    start_pos: int,
    stage_compute_us: tuple[int, ...] = (),
) -> Prediction:
    """The last stage's answer; ``stage_compute_us`` are the middle stages' compute times."""
    logprobs = None
    top: tuple[TopLogprobs, ...] = ()
    if result.logprobs is not None:
        logprobs = tuple(float(lp.logprob) for lp in result.logprobs)
        top = tuple(
            TopLogprobs(
                token_ids=tuple(int(t) for t, _ in lp.top),
                logprobs=tuple(float(v) for _, v in lp.top),
            )
            for lp in result.logprobs
        )
    return Prediction(
        request_id=str(result.request_id),
        run_id=run_id,
        term=term,
        start_pos=start_pos,
        accepted=result.accepted,
        tokens=result.tokens,
        logprobs=logprobs,
        top_logprobs=top,
        compute_us=int(result.compute_s * 1e6),
        stage_compute_us=stage_compute_us,
        drafts=result.drafts,
    )


def result_from_wire(message: Prediction) -> StepResult:
    """The last stage's answer; ``stage_compute_s`` lists every stage after the first."""
    logprobs = None
    if message.logprobs is not None:
        tops = [tuple(zip(t.token_ids, t.logprobs, strict=True)) for t in message.top_logprobs]
        if not tops:
            tops = [()] * len(message.tokens)
        logprobs = tuple(
            TokenLogprob(token=token, logprob=logprob, top=top)
            for token, logprob, top in zip(message.tokens, message.logprobs, tops, strict=True)
        )
    return StepResult(
        request_id=RequestId(message.request_id),
        accepted=message.accepted,
        tokens=message.tokens,
        logprobs=logprobs,
        compute_s=message.compute_us / 1e6,
        stage_compute_s=tuple(us / 1e6 for us in (*message.stage_compute_us, message.compute_us)),
        drafts=message.drafts,
    )


def for_peer(message: Message, features: frozenset[str]) -> tuple[Message, ...]:
    """``message`` as a peer with these Hello ``features`` may receive it: a batch goes as
    one message to a peer that accepts batches (as several if its header would be too
    large), else as its frames (or predictions) one by one, which mean the same
    (protocol/README.md: a new message type is only sent once its feature is negotiated).
    A speed query (or its answer) goes only to a peer that offers ``speed-query``, and to
    any other as nothing: it is never asked (meshnode.node.warm)."""
    if isinstance(message, SpeedQuery | SpeedReport) and SPEED_QUERY_FEATURE not in features:
        return ()
    if BATCH_FEATURE in features:
        return _fitting(message)
    if isinstance(message, ActivationBatch):
        return message.frames
    if isinstance(message, PredictionBatch):
        return message.predictions
    return (message,)


def _fitting(message: Message) -> tuple[Message, ...]:
    """``message``, or its batch split in halves until every header fits
    ``MAX_HEADER_BYTES``: the peer drops a session that sends a larger one, and honest
    batches reach it (8 sequences x 33 rows x top-20 logprobs: 73.5 KB; issue 36, item 8).
    A frame or prediction left alone goes as itself, as to a peer without batches."""
    if not isinstance(message, ActivationBatch | PredictionBatch):
        return (message,)
    if header_size(message) <= MAX_HEADER_BYTES:
        return (message,)
    parts = message.frames if isinstance(message, ActivationBatch) else message.predictions
    if len(parts) == 1:
        return parts
    half = len(parts) // 2
    return (*_fitting(_with_parts(message, parts[:half])),
            *_fitting(_with_parts(message, parts[half:])))  # fmt: skip


def _with_parts(batch: ActivationBatch | PredictionBatch, parts: tuple[Any, ...]) -> Message:
    if isinstance(batch, ActivationBatch):
        return dataclasses.replace(batch, frames=parts)
    return dataclasses.replace(batch, predictions=parts)
