"""Translation between the pipeline's records and their wire messages, in one place.

``StepFrame`` ⇄ ``ActivationFrame`` and ``StepResult`` ⇄ ``Prediction``. Activations travel
as raw tensors in the frame's payload, in the run's wire dtype (f16 by default: half the
bytes of f32 for a rounding of about 1e-3 relative, see ``benchmarks/split.py``).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from meshnode_protocol import ActivationFrame, Prediction, Sampling, Tensor, TopLogprobs

from meshnode.engine.sampling import SamplingParams
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame, StepResult, TokenLogprob

WIRE_DTYPES: Final = {"f32": np.float32, "f16": np.float16}
"""Activation dtypes this node sends and accepts (bf16 needs a bit-level conversion NumPy
lacks; it is accepted on the wire by the codec but not offered by this implementation)."""


def sampling_to_wire(params: SamplingParams) -> Sampling:
    return Sampling(
        temperature=float(params.temperature),
        top_k=int(params.top_k),
        top_p=float(params.top_p),
        min_p=float(params.min_p),
        seed=params.seed,
        repetition_penalty=float(params.repetition_penalty),
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
    )


def sampling_from_wire(sampling: Sampling | None) -> SamplingParams:
    if sampling is None:
        return SamplingParams(temperature=0.0)
    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        seed=sampling.seed,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
    )


def tensor_from_array(array: Any, dtype: str) -> Tensor:
    """``array`` (host memory, any float dtype) as a wire tensor of ``dtype``."""
    host = np.ascontiguousarray(array, dtype=WIRE_DTYPES[dtype])
    return Tensor(dtype=dtype, shape=tuple(int(d) for d in host.shape), data=host.data)


def array_from_tensor(tensor: Tensor) -> np.ndarray[Any, Any]:
    """A float32 array of the tensor's values (the engine computes in float32)."""
    if tensor.dtype not in WIRE_DTYPES:
        raise ValueError(f"activation dtype {tensor.dtype!r} is not supported by this node")
    raw = np.frombuffer(tensor.data, dtype=WIRE_DTYPES[tensor.dtype])
    return raw.reshape(tensor.shape).astype(np.float32)


def frame_to_wire(
    frame: StepFrame, hidden: Any, *, run_id: str, term: int, wire_dtype: str
) -> ActivationFrame:
    """The frame as sent downstream, carrying ``hidden`` (this stage's output) as payload."""
    draft_probs = None
    if frame.draft_probs is not None:
        # Draft distributions stay float32: the acceptance rule divides by them.
        draft_probs = tensor_from_array(frame.draft_probs, "f32")
    return ActivationFrame(
        request_id=str(frame.request_id),
        run_id=run_id,
        term=term,
        kind=str(frame.kind),
        start_pos=frame.start_pos,
        # On the wire a verify frame's rows are ``tokens`` then ``draft_tokens``.
        tokens=frame.tokens[:1] if frame.kind is FrameKind.VERIFY else frame.tokens,
        payload=tensor_from_array(hidden, wire_dtype),
        sampling=sampling_to_wire(frame.sampling),
        draft_tokens=frame.drafts,
        draft_probs=draft_probs,
        out_rows=len(frame.tokens) if frame.kind is FrameKind.VERIFY else 1,
        final=frame.final,
        logprobs=frame.top_logprobs is not None,
        top_logprobs=frame.top_logprobs or 0,
    )


def frame_from_wire(message: ActivationFrame) -> StepFrame:
    """The pipeline frame an ``ActivationFrame`` describes (hidden as float32)."""
    draft_probs = None
    if isinstance(message.draft_probs, Tensor):
        draft_probs = array_from_tensor(message.draft_probs)
    return StepFrame(
        request_id=RequestId(message.request_id),
        kind=FrameKind(message.kind),
        start_pos=message.start_pos,
        tokens=message.tokens + message.draft_tokens,
        sampling=sampling_from_wire(message.sampling),
        final=message.final,
        draft_probs=draft_probs,
        hidden=None if message.payload is None else array_from_tensor(message.payload),
        top_logprobs=message.top_logprobs if message.logprobs else None,
    )


def result_to_wire(result: StepResult, *, run_id: str, term: int, start_pos: int) -> Prediction:
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
    )


def result_from_wire(message: Prediction) -> StepResult:
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
    )
