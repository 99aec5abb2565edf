"""The prompt's prefill from the stages' cached prefix (issue 30; the rule is in
:mod:`meshnode.node.prefix`).

:func:`prefill_prompt` is the generation loop's prefill: it asks the pipeline's
:class:`~meshnode.node.prefix.PrefixIndex` where the prompt may resume, sends the rest in
chunks (carrying where each stage starts and the keys of the prefixes it resumes from,
:class:`~meshnode.node.prefix.ResumePoint`) and, when a stage answers that it lacks the
prefix, releases the sequence, forgets the prompt's blocks and sends the whole prompt from
position 0. The tokens no stage computed (stage 0's start) are the request's
``cached_tokens``.

On hybrid stages (the index keeps ``snapshots``) the pieces are cut by
:func:`prefill_pieces`: at multiples of the block and at the prompt's last block boundary,
where the stages keep the recurrent snapshot a later request resumes from.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from meshnode.engine.prefix_cache import PrefixMissError, resume_length
from meshnode.node.pipeline import FrameKind, Pipeline, StepFrame, StepResult
from meshnode.node.prefix import PrefixCaching, ResumePoint

if TYPE_CHECKING:
    from meshnode.generation.records import GenerationRun
    from meshnode.generation.state import Delta

#: One pass of a frame for a run, committing what it returns (the loop's ``_pass``).
Send = Callable[
    [Pipeline, "GenerationRun", StepFrame], Awaitable[tuple[StepResult, "Delta | None"]]
]
#: Builds a frame of a run (the loop's ``_frame``).
MakeFrame = Callable[..., StepFrame]
#: A prompt computed whole on every stage.
FROM_ZERO = ResumePoint((0,), (None,))


async def prefill_prompt(
    pipeline: Pipeline, run: GenerationRun, chunk_tokens: int, send: Send, make: MakeFrame
) -> Delta:
    """Prefill ``run.prompt`` (module docstring); the final chunk's delta. Sets
    ``run.cached_tokens``. Raises what a pass raises (a miss is handled here)."""
    index = pipeline.prefix if isinstance(pipeline, PrefixCaching) else None
    align = index.block if index is not None and index.snapshots else 0
    point = FROM_ZERO
    if index is not None and run.params.cache_prompt:
        point = index.resume_point(run.request_id, run.prompt)
    try:
        delta = await _chunks(pipeline, run, (chunk_tokens, align), point, send, make)
    except PrefixMissError:
        assert index is not None  # only a resumed frame is refused so
        index.missed(run.prompt)
        # Release first: on a remote pipeline the refusals of chunks already on their way
        # then answer a wire id no waiter listens on any more.
        await pipeline.release(run.request_id)
        point = FROM_ZERO
        delta = await _chunks(pipeline, run, (chunk_tokens, align), point, send, make)
    run.cached_tokens = point.start
    return delta


async def _chunks(
    pipeline: Pipeline,
    run: GenerationRun,
    cut: tuple[int, int],
    point: ResumePoint,
    send: Send,
    make: MakeFrame,
) -> Delta:
    chunks = prefill_pieces(run.prompt, point.start, *cut)
    delta = None
    for i, (at, tokens) in enumerate(chunks):
        frame = make(run, FrameKind.PREFILL, at, tokens, final=i == len(chunks) - 1)
        _, delta = await send(pipeline, run, point.frame(frame))
    if delta is None:
        raise RuntimeError("the final prefill pass returned no token")
    return delta


def prefill_pieces(
    prompt: Sequence[int], start: int, size: int, align: int = 0
) -> list[tuple[int, list[int]]]:
    """The prefill frames of ``prompt`` from ``start``: ``(start_pos, tokens)`` of at most
    ``size`` tokens each. With ``align`` (a hybrid pipeline's block), ``size`` rounds down
    to a multiple of it (at least one block) and the cuts fall at its multiples of ``size``
    and at the prompt's last block boundary, so that: a snapshot exists there for the
    next request that begins with this prompt; every piece before the last has at least a
    block of rows, which the engine's products and attention compute with the same bits
    whatever the piece's length and start (the few-row path of a short piece rounds
    otherwise); and the last piece, the rows after the boundary, is the same whether the
    prompt resumed from a snapshot or not. So a resumed prompt gets the bits of an
    uncached one. Raises ``ValueError`` for ``size < 1``."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    if not align:
        return [(at, list(prompt[at : at + size])) for at in range(start, len(prompt), size)]
    size = max(size // align * align, align)
    last = resume_length(len(prompt), len(prompt), align)
    cuts = [start, *range((start // size + 1) * size, last, size), last, len(prompt)]
    bounds = sorted(set(c for c in cuts if c >= start))
    return [(a, list(prompt[a:b])) for a, b in itertools.pairwise(bounds)]
