"""The prompt's prefill from the stages' cached prefix (issue 30; the rule is in
:mod:`meshnode.node.prefix`).

:func:`prefill_prompt` is the generation loop's prefill: it asks the pipeline's
:class:`~meshnode.node.prefix.PrefixIndex` where the prompt may resume, sends the rest in
chunks (the first carrying the prefix's key) and, when a stage answers that it lacks the
prefix, releases the sequence, forgets the prompt's blocks and sends the whole prompt from
position 0. The tokens it did not compute are the request's ``cached_tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from meshnode.engine.prefix_cache import PrefixMissError
from meshnode.node.pipeline import FrameKind, Pipeline, StepFrame, StepResult
from meshnode.node.prefix import PrefixCaching

if TYPE_CHECKING:
    from meshnode.generation.records import GenerationRun
    from meshnode.generation.state import Delta

#: One pass of a frame for a run, committing what it returns (the loop's ``_pass``).
Send = Callable[
    [Pipeline, "GenerationRun", StepFrame], Awaitable[tuple[StepResult, "Delta | None"]]
]
#: Builds a frame of a run (the loop's ``_frame``).
MakeFrame = Callable[..., StepFrame]


async def prefill_prompt(
    pipeline: Pipeline, run: GenerationRun, chunk_tokens: int, send: Send, make: MakeFrame
) -> Delta:
    """Prefill ``run.prompt`` (module docstring); the final chunk's delta. Sets
    ``run.cached_tokens``. Raises what a pass raises (a miss is handled here)."""
    index = pipeline.prefix if isinstance(pipeline, PrefixCaching) else None
    start, key = 0, None
    if index is not None and run.params.cache_prompt:
        start, key = index.resume_point(run.request_id, run.prompt)
    try:
        delta = await _chunks(pipeline, run, chunk_tokens, start, key, send, make)
    except PrefixMissError:
        assert index is not None  # only a resumed frame is refused so
        index.missed(run.prompt)
        # Release first: on a remote pipeline the refusals of chunks already on their way
        # then answer a wire id no waiter listens on any more.
        await pipeline.release(run.request_id)
        start = 0
        delta = await _chunks(pipeline, run, chunk_tokens, 0, None, send, make)
    run.cached_tokens = start
    return delta


async def _chunks(
    pipeline: Pipeline,
    run: GenerationRun,
    chunk_tokens: int,
    start: int,
    key: bytes | None,
    send: Send,
    make: MakeFrame,
) -> Delta:
    chunks = _split(run.prompt, start, chunk_tokens)
    delta = None
    for i, (at, tokens) in enumerate(chunks):
        frame = make(run, FrameKind.PREFILL, at, tokens, final=i == len(chunks) - 1)
        if i == 0 and key is not None:
            frame = dataclasses.replace(frame, prefix_key=key)
        _, delta = await send(pipeline, run, frame)
    if delta is None:
        raise RuntimeError("the final prefill pass returned no token")
    return delta


def _split(prompt: Sequence[int], start: int, size: int) -> list[tuple[int, list[int]]]:
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [(at, list(prompt[at : at + size])) for at in range(start, len(prompt), size)]
