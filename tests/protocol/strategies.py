"""Hypothesis strategies for every message, derived from the compiled field kinds."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st
from meshnode_protocol import (
    MESSAGE_TYPES,
    ActivationBatch,
    ActivationFrame,
    Load,
    Message,
    Prediction,
    PredictionBatch,
    Ready,
    Tensor,
)
from meshnode_protocol._fields import (
    Kind,
    _Float,
    _Int,
    _Optional,
    _Pair,
    _Record,
    _Scalar,
    _Tensor,
    _Tuple,
    _Union,
    compile_fields,
)
from meshnode_protocol._tensor import DTYPE_SIZES

texts = st.text(max_size=12)
ints = st.integers(min_value=0, max_value=2**64 - 1)
small = st.integers(min_value=0, max_value=8)
# Within every float field's valid range (top_p, min_p are in (0, 1]).
floats = st.floats(min_value=0.01, max_value=1.0)
token_lists = st.lists(st.integers(0, 2**31), max_size=6).map(tuple)
# prefix-cache keys and seeds: 16 bytes as 32 lowercase hex digits (empty: none)
keys = st.binary(min_size=16, max_size=16).map(bytes.hex)


@st.composite
def tensors(draw: st.DrawFn, rows: int | None = None) -> Tensor:
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    lead = draw(small) if rows is None else rows
    shape = (lead, *draw(st.lists(small, max_size=2)))
    size = DTYPE_SIZES[dtype]
    for dim in shape:
        size *= dim
    return Tensor(dtype, shape, draw(st.binary(min_size=size, max_size=size)))


def for_kind(kind: Kind) -> st.SearchStrategy[Any]:
    """A strategy producing valid values of one field kind."""
    if isinstance(kind, _Scalar):
        return {"str": texts, "bool": st.booleans(), "bytes": st.binary(max_size=8)}[kind.name]
    if isinstance(kind, _Int):  # the full range of the field's type, int64 or uint64
        return st.integers(min_value=kind.lo, max_value=kind.hi)
    if isinstance(kind, _Float):
        return floats
    if isinstance(kind, _Tuple):
        return st.lists(for_kind(kind.item), max_size=4).map(tuple)
    if isinstance(kind, _Pair):
        return st.tuples(small, small).map(lambda p: (min(p), max(p)))
    if isinstance(kind, _Optional):
        return st.none() | for_kind(kind.inner)
    if isinstance(kind, _Union):
        return st.one_of([for_kind(o) for o in kind.options])
    if isinstance(kind, _Tensor):
        return tensors()
    if isinstance(kind, _Record):
        return records(kind.cls)
    raise AssertionError(f"no strategy for {kind.name}")


def records(cls: type, **overrides: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Every field drawn independently, except ``overrides`` (for fields with value rules)."""
    fields = {
        f.name: overrides[f.name] if f.name in overrides else for_kind(f.kind)
        for f in compile_fields(cls)
    }
    return st.fixed_dictionaries(fields).map(lambda kwargs: cls(**kwargs))


@st.composite
def activation_frames(draw: st.DrawFn) -> ActivationFrame:
    kind = draw(st.sampled_from(["prefill", "decode", "verify"]))
    tokens = draw(token_lists)
    drafts = draw(token_lists) if kind == "verify" else ()
    rows = len(tokens) + len(drafts)
    probs = draw(
        st.none()
        | st.lists(floats, min_size=len(drafts), max_size=len(drafts)).map(tuple)
        | tensors(rows=len(drafts)).filter(lambda t: len(t.shape) == 2)
    )
    generic = {f.name: for_kind(f.kind) for f in compile_fields(ActivationFrame)}
    start_pos = draw(ints)
    starts: tuple[int, ...] = ()  # where later stages start: within the frame's rows
    if kind == "prefill" and rows and start_pos < 2**63:
        offsets = draw(st.lists(st.integers(0, rows - 1), max_size=3))
        starts = tuple(start_pos + offset for offset in sorted(offsets))
    return ActivationFrame(
        request_id=draw(texts),
        run_id=draw(texts),
        term=draw(ints),
        kind=kind,
        start_pos=start_pos,
        tokens=tokens,
        payload=draw(st.none() | tensors(rows=rows)),
        sampling=draw(generic["sampling"]),
        draft_tokens=drafts,
        draft_probs=probs,
        out_rows=draw(st.integers(0, rows)),
        final=draw(st.booleans()),
        logprobs=draw(st.booleans()),
        resume_starts=starts,
        resume_keys=tuple(draw(keys) if s > 0 and draw(st.booleans()) else "" for s in starts),
    )


@st.composite
def predictions(draw: st.DrawFn) -> Prediction:
    tokens = draw(st.lists(st.integers(0, 2**31), min_size=1, max_size=6).map(tuple))
    logprobs = st.lists(st.floats(-50.0, 0.0), min_size=len(tokens), max_size=len(tokens))
    return Prediction(
        request_id=draw(texts),
        run_id=draw(texts),
        term=draw(ints),
        start_pos=draw(ints),
        accepted=draw(st.integers(0, len(tokens) - 1)),
        tokens=tokens,
        logprobs=draw(st.none() | logprobs.map(tuple)),
    )


def _renamed(items: list[Any], run_id: str, term: int) -> tuple[Any, ...]:
    """The items with distinct request ids and the batch's run and term."""
    return tuple(
        replace(item, request_id=f"r{i}", run_id=run_id, term=term) for i, item in enumerate(items)
    )


@st.composite
def activation_batches(draw: st.DrawFn) -> ActivationBatch:
    run_id, term = draw(texts), draw(ints)
    frames = draw(st.lists(activation_frames(), min_size=1, max_size=3))
    return ActivationBatch(run_id=run_id, term=term, frames=_renamed(frames, run_id, term))


@st.composite
def prediction_batches(draw: st.DrawFn) -> PredictionBatch:
    run_id, term = draw(texts), draw(ints)
    items = draw(st.lists(predictions(), min_size=1, max_size=3))
    return PredictionBatch(run_id=run_id, term=term, predictions=_renamed(items, run_id, term))


SPECIAL: dict[type[Message], st.SearchStrategy[Any]] = {
    ActivationFrame: activation_frames(),
    Prediction: predictions(),
    ActivationBatch: activation_batches(),
    PredictionBatch: prediction_batches(),
    Load: records(
        Load,
        wire_dtype=st.sampled_from(sorted(DTYPE_SIZES)),
        batch_sizes=st.lists(st.integers(1, 64), max_size=3).map(tuple),
        prefix_seed=st.just("") | keys,
    ),
    Ready: records(
        Ready,
        prefix_seed=st.just("") | keys,
        prefix_keys=st.lists(keys, max_size=4).map(tuple),
    ),
}


def messages_of(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Valid messages of one type."""
    special = SPECIAL.get(cls)
    return records(cls) if special is None else special


any_message: st.SearchStrategy[Message] = st.one_of(
    [messages_of(cls) for cls in MESSAGE_TYPES.values()]
)
