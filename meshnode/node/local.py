"""A pipeline whose every layer runs in this process (one :class:`StageRunner`).

Single-node serving (``meshnode.serve.single``), ``meshnode generate`` and the tests drive
the same generation loop over it as over the mesh's ``node.remote.RemotePipeline``.
"""

from __future__ import annotations

import functools

import trio

from meshnode.node.batcher import Ahead, Batcher, BatchLimits, Queued, next_decode
from meshnode.node.pipeline import QueuedPass, RequestId, Slot, StepFrame, StepResult
from meshnode.node.prefix import NotedPass, host_pools, note_pass, note_release
from meshnode.node.stage import StageRunner, step_results

__all__ = ["LocalPipeline"]


class LocalPipeline:
    """Every layer in this process: one :class:`StageRunner` holding the whole model.

    Concurrent ``run`` calls are batched (:mod:`meshnode.node.batcher`): each step runs the
    ready frames of all sequences as one forward in a worker thread, so the event loop
    keeps serving HTTP meanwhile; plain decode steps run ahead there, one after the other,
    while the generation loops take their tokens (:class:`~meshnode.node.batcher.Ahead`;
    only when ``BatchLimits.ahead`` asks: it is off by default).
    Steps and releases never overlap, because the runner (and the BLAS threads under it)
    is shared by all sequences.
    """

    def __init__(self, runner: StageRunner, limits: BatchLimits | None = None):
        self.runner = runner
        limits = limits or BatchLimits(max_frames=runner.max_sequences)
        ends = frozenset(runner.stage.config.eos_token_ids)
        follow = functools.partial(next_decode, ends=ends)
        # Off by default (BatchLimits.ahead); with None only while one sequence decodes:
        # the work of several sequences' loops, overlapping the next forward on the cores
        # it uses, slowed it more than it saved (2 cores, load 5-7, tokens/s running
        # ahead over stepwise: 8 streams 0.88x at 2 threads, 0.75-1.10x at 1).
        rows = None if limits.ahead else 1
        ahead = Ahead(functools.partial(step_results, runner), follow, rows)
        self.batcher: Batcher[StepResult] = Batcher(
            self._step, limits, live=lambda: runner.live_sequences, ahead=ahead
        )
        # Hook (issue 30): what the runner's prefix pool holds, as the host sees it.
        self.prefix, self.kv_blocks = host_pools(runner, (), runner.prefix.salt)

    @property
    def context_size(self) -> int:
        return int(self.runner.context_size)

    async def run(self, frame: StepFrame) -> StepResult:
        result = await self.batcher.submit(frame)
        note_pass(self.prefix, frame)  # hook (issue 30)
        return result

    def queue(self, frame: StepFrame) -> QueuedPass:
        queued = Queued(self.batcher, self.batcher.enqueue(frame))
        # Hook (issue 30): the index notes a queued pass's result as run's.
        return queued if self.prefix is None else NotedPass(queued, frame, self.prefix)

    async def release(self, request_id: RequestId) -> None:
        # Between steps, so a release never races the worker thread's use of the cache.
        async with self.batcher.exclusive():
            self.runner.release(request_id)
            self.batcher.forget(request_id)
        note_release(self.prefix, request_id)  # hook (issue 30)

    async def _step(self, slots: list[Slot[StepResult]]) -> None:
        await trio.to_thread.run_sync(step_results, self.runner, slots)
