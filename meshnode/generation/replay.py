"""Replay: a request outlives the loss of a stage, and of a hybrid stage's snapshots.

When a stage of the pipeline is lost (``StageLostError``: a dropped connection, dead
heartbeats, a missed pass deadline; :mod:`meshnode.node.remote`), nothing the client saw is
lost: the loop holds every committed token. It waits (at most ``REPLAY_WAIT_S``) for the
pipeline the coordinator brings up next (:func:`next_pipeline`), prefills the prompt on it
again (its final chunk tells the last stage where the prompt ends, for penalties and the
grammar, whose state then follows the committed tokens), then the committed tokens but the
last as non-final chunks (:func:`replay_history`), and goes on with the next step as if
nothing happened: the cache holds ``history[:-1]`` exactly as it did. The step that was
lost had committed nothing; the proposer and the window keep their state (both follow the
committed history). Greedy output is the undisturbed run's, and seeded sampling too: the
last stage draws the token at position ``p`` from a counter-based generator keyed on
(seed, ``p``), and the driver fixes the seed once per request. After ``MAX_REPLAYS``
replays, or when no pipeline comes in time, the error ends the stream as before.

The prompt resumes, stage by stage, from the prefix each stage of the new pipeline and
the stages after it still hold: when the host re-plans the same pipeline (a lost pass, a
dropped session), its stages keep their cached blocks across the new ``Load``
(:mod:`meshnode.node.prefix_keep`), and only the prompt's suffix is computed again
(``GenerationRun.replay_cached_tokens``: what stage 0 skipped); when a spare takes a
killed stage's range, the stages after it keep theirs and resume there while the spare
and the stages before it compute the prompt from 0.

A hybrid stage rolls its recurrent state back only as far as its snapshot ring reaches
(:mod:`meshnode.engine.recurrent`); a frame that starts further back fails there with
``RollbackError``, and the driver folds the history before it into every stage again from
position 0 (:func:`refold`: non-final prefill chunks) and sends the frame once more.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from meshnode.engine.prefix_cache import PrefixMissError
from meshnode.generation.prefix import FROM_ZERO, prefill_pieces
from meshnode.generation.records import GenerationRun, frame_of
from meshnode.generation.state import prefill_chunks
from meshnode.node.pipeline import FrameKind, Pipeline, StageLostError
from meshnode.node.prefix import PrefixCaching, ResumePoint

#: Longest wait of a request for the pipeline after a lost one. The coordinator replans in
#: ~4 s on loopback (issue 16); stages that must load their new layer ranges from disk take
#: longer, a large model on a CPU box up to a minute or two. A client waits no longer than
#: this for its next token.
REPLAY_WAIT_S = 120.0
#: Replays of one request. A mesh that keeps losing stages under a request ends it with
#: the error rather than holding the client forever; three covers a node that dies and a
#: second one that fails while the first is replaced.
MAX_REPLAYS = 3

log = logging.getLogger(__name__)

#: Waits for the pipeline that replaces ``lost`` (the coordinator's next one) and returns
#: it; the generation loop bounds the wait (``REPLAY_WAIT_S``).
PipelineSource = Callable[[Pipeline], Awaitable[Pipeline]]


async def next_pipeline(
    run: GenerationRun, lost: StageLostError, pipeline: Pipeline, source: PipelineSource | None
) -> Pipeline:
    """The pipeline that replaces ``pipeline`` (lost with ``lost``), for ``run`` to replay
    on. Raises ``lost`` when nothing replaces pipelines or ``run``'s replays are spent, and
    :class:`StageLostError` when none comes within ``REPLAY_WAIT_S``."""
    if source is None or run.replays >= MAX_REPLAYS:
        raise lost
    run.replays += 1
    log.warning(
        "request %s: %s; replaying it (%d of %d) on the next pipeline",
        run.request_id,
        lost,
        run.replays,
        MAX_REPLAYS,
    )
    with trio.move_on_after(REPLAY_WAIT_S):
        return await source(pipeline)
    raise StageLostError(f"{lost}; no pipeline came back within {REPLAY_WAIT_S:.0f} s")


async def refold(pipeline: Pipeline, run: GenerationRun, end: int) -> None:
    """Prefill ``history[:end]`` again from position 0 on every stage, asking no token: a
    stage's recurrent state could not be rolled back to ``end`` from its snapshot ring."""
    run.refolds += 1
    for start, tokens in prefill_chunks(run.history[:end], run.chunk_tokens):
        await pipeline.run(frame_of(run, FrameKind.PREFILL, start, tokens, final=False))


async def replay_history(pipeline: Pipeline, run: GenerationRun) -> None:
    """Put the request back on a new pipeline: the prompt as at the start (its final chunk
    returns the first committed token again), then the committed tokens but the last as
    non-final chunks, so the cache holds ``history[:-1]`` as the next step expects."""
    first = await _replay_prompt(pipeline, run)
    if first != run.state.tokens[0]:
        log.warning(
            "request %s: the replayed prompt gives token %s, not %d as before",
            run.request_id,
            first,
            run.state.tokens[0],
        )
    generated = run.state.tokens[:-1]
    for start, tokens in prefill_chunks(generated, run.chunk_tokens):
        at = len(run.prompt) + start
        await pipeline.run(frame_of(run, FrameKind.PREFILL, at, tokens, final=False))


async def _replay_prompt(pipeline: Pipeline, run: GenerationRun) -> int | None:
    """The prompt again, from the prefix every stage of the new pipeline still holds (the
    blocks the stages kept of the run before, :mod:`meshnode.node.prefix_keep`), as the
    first prefill resumes (:mod:`meshnode.generation.prefix`); the token its final chunk
    returns. A stage that lacks the prefix makes it start over from 0."""
    index = pipeline.prefix if isinstance(pipeline, PrefixCaching) else None
    point = FROM_ZERO
    if index is not None and run.params.cache_prompt:
        point = index.resume_point(run.request_id, run.prompt)
    try:
        first = await _prompt_from(pipeline, run, point)
    except PrefixMissError:
        assert index is not None  # only a resumed frame is refused so
        index.missed(run.prompt)
        await pipeline.release(run.request_id)  # as generation.prefix does, first
        point = FROM_ZERO
        first = await _prompt_from(pipeline, run, point)
    run.replay_cached_tokens += point.start
    if any(point.starts):
        log.info(
            "request %s: the replay resumed the prompt at %s (stage by stage)",
            run.request_id,
            list(point.starts),
        )
    return first


async def _prompt_from(pipeline: Pipeline, run: GenerationRun, point: ResumePoint) -> int | None:
    index = pipeline.prefix if isinstance(pipeline, PrefixCaching) else None
    align = index.block if index is not None and index.snapshots else 0
    chunks = prefill_pieces(run.prompt, point.start, run.chunk_tokens, align)
    first = None
    for i, (at, tokens) in enumerate(chunks):
        final = i == len(chunks) - 1
        frame = point.frame(frame_of(run, FrameKind.PREFILL, at, tokens, final=final))
        result = await pipeline.run(frame)
        first = result.tokens[0] if final and result.tokens else first
    return first
