"""How long one real layer takes on this machine (issue 34): the node's self-measurement.

A one-layer :class:`~meshnode.engine.model.Stage` of the model's own weights (its formats,
on this backend and thread count), fed random hidden states, is run

- at decode with one row (:data:`DECODE_REPEATS` passes, the median),
- at decode with :data:`BATCH_ROWS` rows in one pass (a batch of streams),
- at prefill over :data:`PREFILL_ROWS` rows,

each after one warm-up pass of its shape (a cold kernel compiles on its first call), the
KV cache rolled back to position 0 before every pass. Times are per row: a token's time
through one layer. :mod:`meshnode.node.selfmeasure` caches and reports them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from meshnode_packaging.sources import ModelSource

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage

#: Rows of the prefill timing: a short prompt's chunk, enough to reach the kernels' tiles.
PREFILL_ROWS = 32
#: Rows of the batched decode timing (the issue's "8 rows").
BATCH_ROWS = 8
#: One-row passes timed; their median is the decode time (one slow pass moves nothing).
DECODE_REPEATS = 7
#: Passes timed of each of the other two shapes.
BATCH_REPEATS = 3
#: The timing's budget after the first warm-up: a slow node times fewer passes (at least
#: one of each shape), never much longer.
BUDGET_S = 10.0


@dataclass(frozen=True, slots=True)
class LayerTiming:
    """Seconds per layer per token of one layer, at each shape, and its weight bytes."""

    decode_s: float
    batch_s: float
    prefill_s: float
    layer_bytes: int


def time_layer(
    config: ModelConfig,
    source: ModelSource,
    layer: int,
    backend: Backend,
    clock: Callable[[], float] = time.perf_counter,
) -> LayerTiming:
    """Time ``layer`` of ``source`` on ``backend`` (module docstring). Blocking. Raises what
    building the layer's stage raises (``ValueError`` for a layer outside the model)."""
    stage = Stage(config, source, layer, layer + 1, embed=False, head=False, backend=backend)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((PREFILL_ROWS, config.hidden_size)).astype(np.float32)
    cache = stage.new_cache(PREFILL_ROWS + 1)
    deadline: list[float] = []

    def timed(rows: int, repeats: int) -> float:
        inputs = stage.backend.asarray(hidden[:rows])
        stage.forward(inputs, 0, cache)  # warm-up: compiles a cold kernel
        if not deadline:
            deadline.append(clock() + BUDGET_S)
        seconds = []
        for _ in range(repeats):
            began = clock()
            stage.forward(inputs, 0, cache)  # start_pos 0: the cache is rolled back
            seconds.append(clock() - began)
            if clock() > deadline[0]:
                break
        return statistics.median(seconds) / rows

    decode = timed(1, DECODE_REPEATS)
    batch = timed(BATCH_ROWS, BATCH_REPEATS)
    prefill = timed(PREFILL_ROWS, BATCH_REPEATS)
    return LayerTiming(decode, batch, prefill, stage.weights.nbytes())


def compute_threads() -> int:
    """Threads the CPU kernels run on (numba's count): part of the measurement's key."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency of the CPU kernels
        return 1
    return int(numba.get_num_threads())
