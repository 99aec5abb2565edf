"""How a CUDA stage runs its forwards: one stream, fixed input buffers, CUDA graphs.

``model.Stage`` hands every forward to :class:`GraphRunner` as ``prepare`` (the step
table, see ``kernels``) and ``forward`` (the block's operations, ``cuda.ops``). A batch
is cut into forwards: a sequence of more than ``MAX_ROWS`` new rows (a prefill) runs
alone, the others together, at most ``MAX_BATCH_ROWS`` rows per forward, so a row's
result is the same whatever else is in the batch (the matvec's sum for a row does not
depend on the other rows).

A forward of short sequences reads its inputs from buffers allocated once and its
positions and caches from the step table (also at a fixed address), so its launches
depend only on its shape: (new rows, rows kept, rows out). The first forward of a shape
runs eagerly; then the same launches are captured as a CUDA graph, which every later
forward of that shape replays after copying its inputs and step table in (up to
``MAX_GRAPHS`` shapes). The arrays the forward allocates come from a memory pool of the
stage's own while it runs and is captured: the eager run leaves the pool holding blocks
enough, so capture allocates nothing new, and no other allocation ever takes the
addresses a graph writes (replays run one at a time, on the stage's stream). If capture
fails the stage logs it once and stays eager. A prefill runs eagerly.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshnode.engine.config import ModelConfig
from meshnode.engine.cuda.kernels import MAX_BATCH_ROWS, MAX_ROWS
from meshnode.engine.runner import Forward, Prepare, stack_inputs

__all__ = ["MAX_GRAPHS", "GraphRunner", "batch_groups"]

log = logging.getLogger(__name__)

# CUDA graphs a stage keeps, one per (rows, kept rows, output rows) shape. A server meets
# few shapes (decode batches (B, B), verify windows (k + 1, k + 1), short prompt chunks
# (n, 1) and their mixes), each graph holding a few hundred launch nodes; the bound keeps
# a stream of odd shapes from growing device memory. Shapes past it run eagerly.
MAX_GRAPHS = 256


def batch_groups(sizes: Sequence[int]) -> list[list[int]]:
    """Items (by index) in forwards: a sequence of more than ``MAX_ROWS`` rows alone, the
    others together in order, at most ``MAX_BATCH_ROWS`` rows per forward."""
    groups: list[list[int]] = []
    run: list[int] = []
    for i, n in enumerate(sizes):
        if n > MAX_ROWS:
            groups.append([i])
            continue
        if run and sum(sizes[j] for j in run) + n > MAX_BATCH_ROWS:
            groups.append(run)
            run = []
        run.append(i)
    return [*groups, run] if run else groups


class GraphRunner:
    """The forwards of one CUDA stage (``cp``: CuPy); ``graphs``: capture decode steps."""

    def __init__(self, cp: Any, config: ModelConfig, *, embed: bool, graphs: bool) -> None:
        import cupyx

        self.cp, self.embed = cp, embed
        self.use_graphs = graphs
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.pool = cp.cuda.MemoryPool()  # what forwards allocate, see the module docstring
        # The inputs of a short forward, and their page-locked sources.
        e, rows = config.hidden_size, MAX_BATCH_ROWS
        self._ids = cp.zeros(rows, cp.int32)
        self._x = cp.zeros((rows, e), cp.float32)
        self._pinned_ids = cupyx.empty_pinned((rows,), dtype=np.int32)
        self._pinned_x = cupyx.empty_pinned((rows, e), dtype=np.float32)
        self._graphs: dict[tuple[int, int, int], tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def groups(self, sizes: Sequence[int]) -> list[list[int]]:
        """See :func:`batch_groups`."""
        return batch_groups(sizes)

    def run(
        self, key: tuple[int, int, int], inputs: Sequence[Any], prepare: Prepare, forward: Forward
    ) -> Any:
        """One forward (``runner.Runner.run``); returns a new device array."""
        # The stage's stream does not wait for the legacy default stream, where its
        # weights, caches and fixed buffers were uploaded and zeroed (``cp.asarray``,
        # ``cp.zeros`` outside any stream): work still queued there, such as the memset of
        # the step table behind a gigabyte of weight uploads, would otherwise land in the
        # middle of this forward (seen on an H200: rope_store read a zeroed block-table
        # address). Nothing is queued there between steps, so this costs a few
        # microseconds.
        self.cp.cuda.Stream.null.synchronize()
        with self._lock, self.stream, self.cp.cuda.using_allocator(self.pool.malloc):
            if any(len(i) > MAX_ROWS for i in inputs):
                x = stack_inputs(self.cp, inputs, self.embed, self.cp.int32)
                out = _copy(self.cp, forward(x, prepare()))
            else:
                out = self._short(key, inputs, prepare, forward)
            # The copies in read the pinned buffers when the stream reaches them: the
            # next forward may rewrite those only once this one is done.
            self.stream.synchronize()
        return out

    def _short(
        self, key: tuple[int, int, int], inputs: Sequence[Any], prepare: Prepare, forward: Forward
    ) -> Any:
        x = self._copy_inputs(inputs)
        plan = prepare()
        graph = self._graphs.get(key)
        if graph is not None:
            graph[0].launch(self.stream)
            return _copy(self.cp, graph[1])
        out = _copy(self.cp, forward(x, plan))
        if self.use_graphs and len(self._graphs) < MAX_GRAPHS:
            self._capture(key, x, plan, forward)
        return out

    def _copy_inputs(self, inputs: Sequence[Any]) -> Any:
        """Token ids or hidden rows of every item into the fixed buffers (a view of their
        first rows), through page-locked memory."""
        bounds = list(itertools.accumulate((len(i) for i in inputs), initial=0))
        n = bounds[-1]
        if self.embed:
            for part, a in zip(inputs, bounds, strict=False):
                self._pinned_ids[a : a + len(part)] = np.asarray(part)
            self._ids[:n].set(self._pinned_ids[:n], stream=self.stream)
            return self._ids[:n]
        host = [isinstance(p, np.ndarray) for p in inputs]
        if any(host):
            for part, a, on_host in zip(inputs, bounds, host, strict=False):
                if on_host:
                    self._pinned_x[a : a + len(part)] = part
            self._x[:n].set(self._pinned_x[:n], stream=self.stream)
        for part, a, on_host in zip(inputs, bounds, host, strict=False):
            if not on_host:  # already on the device (a stage chained in one process)
                self._x[a : a + len(part)] = part
        return self._x[:n]

    def _capture(self, key: tuple[int, int, int], x: Any, plan: Any, forward: Forward) -> None:
        """Record this shape's launches as a graph (recording runs nothing)."""
        self.stream.synchronize()
        try:
            self.stream.begin_capture()
            try:
                out = forward(x, plan)
            finally:
                graph = self.stream.end_capture()
        except Exception as exc:  # any CUDA/CuPy refusal: the eager path stays correct
            self.use_graphs = False
            log.warning("CUDA graph capture failed, decoding without graphs: %s", exc)
            return
        self._graphs[key] = (graph, out)

    def replay_seconds(self, rows: int, repeats: int) -> float | None:
        """Device seconds of one replay of the graph for ``rows`` new rows, all of them
        out, timed with CUDA events over ``repeats`` back-to-back replays (the device's
        share of a step without the host's). None when no such graph was captured. For
        benchmarks: the replays rewrite the K/V of the last step's positions."""
        graph = self._graphs.get((rows, rows, rows))
        if graph is None:
            return None
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        with self._lock:
            start.record(self.stream)
            for _ in range(repeats):
                graph[0].launch(self.stream)
            end.record(self.stream)
            end.synchronize()
        return float(cp.cuda.get_elapsed_time(start, end)) / 1e3 / repeats


def _copy(cp: Any, a: Any) -> Any:
    """A copy of ``a`` from the default memory pool: what a forward returns must not lie
    in the stage's pool, whose blocks a later graph replay may write as its scratch."""
    with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
        return a.copy()
