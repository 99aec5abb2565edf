"""A pipeline whose every layer runs in this process (one :class:`StageRunner`).

Single-node serving (``meshnode.serve.single``), ``meshnode generate`` and the tests drive
the same generation loop over it as over the mesh's ``node.remote.RemotePipeline``.
"""

from __future__ import annotations

import functools

import trio

from meshnode.engine.cpu.matrix import kernel_threads
from meshnode.engine.cpu.pool import usable_cpus
from meshnode.node.batcher import Ahead, Batcher, BatchLimits, Queued, Slot, next_decode
from meshnode.node.pipeline import QueuedPass, RequestId, StepFrame, StepResult
from meshnode.node.stage import StageRunner, step_results

__all__ = ["LocalPipeline"]


class LocalPipeline:
    """Every layer in this process: one :class:`StageRunner` holding the whole model.

    Concurrent ``run`` calls are batched (:mod:`meshnode.node.batcher`): each step runs the
    ready frames of all sequences as one forward in a worker thread, so the event loop
    keeps serving HTTP meanwhile; plain decode steps run ahead there, one after the other,
    while the generation loops take their tokens (:class:`~meshnode.node.batcher.Ahead`;
    steps of several sequences only where the event loop has a core of its own).
    Steps and releases never overlap, because the runner (and the BLAS threads under it)
    is shared by all sequences.
    """

    def __init__(self, runner: StageRunner, limits: BatchLimits | None = None):
        self.runner = runner
        limits = limits or BatchLimits(max_frames=runner.max_sequences)
        ends = frozenset(runner.stage.config.eos_token_ids)
        follow = functools.partial(next_decode, ends=ends)
        # where the kernels leave the event loop no core, only one sequence's steps
        rows = None if limits.ahead or _loop_has_a_core(runner) else 1
        ahead = Ahead(functools.partial(step_results, runner), follow, rows)
        self.batcher: Batcher[StepResult] = Batcher(
            self._step, limits, live=lambda: runner.live_sequences, ahead=ahead
        )

    @property
    def context_size(self) -> int:
        return int(self.runner.context_size)

    async def run(self, frame: StepFrame) -> StepResult:
        return await self.batcher.submit(frame)

    def queue(self, frame: StepFrame) -> QueuedPass:
        return Queued(self.batcher, self.batcher.enqueue(frame))

    async def release(self, request_id: RequestId) -> None:
        # Between steps, so a release never races the worker thread's use of the cache.
        async with self.batcher.exclusive():
            self.runner.release(request_id)
            self.batcher.forget(request_id)

    async def _step(self, slots: list[Slot[StepResult]]) -> None:
        await trio.to_thread.run_sync(step_results, self.runner, slots)


def _loop_has_a_core(runner: StageRunner) -> bool:
    """Whether running ahead pays for many sequences here: the event loop's work (the
    generation loops, the clients' I/O) then overlaps the next forward, which is only
    free on a core the forward does not use. On the kernels' own cores the work of eight
    loops slows the forward more than it saves between forwards, where one loop's does
    not (2 cores, load ~5, tokens/s running ahead over stepwise: 8 streams at 1 thread
    1.10x, at 2 threads 0.88x; 1 stream at 2 threads 1.09x)."""
    if runner.stage.cuda is not None:
        return True  # the forward waits on the device
    return kernel_threads() < len(usable_cpus())
