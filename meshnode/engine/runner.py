"""How a backend runs a stage's forward (``Backend.runner``): the batch cut into
forwards, the inputs put on the device, the forward run.

``model.Stage`` hands over a forward as two functions: ``prepare()``, which does the
host-side work of one forward (the attention's plan: RoPE tables, the segment or step
table) and returns the plan, and ``forward(x, plan)``, the array math from the stacked
inputs ``x`` to the output. The CPU runs them one after the other
(:class:`EagerRunner`); the CUDA runner (``meshnode.engine.cuda.graphs``) also records
``forward`` as a CUDA graph per shape and replays it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["EagerRunner", "Forward", "Prepare", "Runner", "stack_inputs"]

#: The host-side work of one forward; returns its plan.
Prepare = Callable[[], Any]
#: The forward proper: the stacked inputs (ids ``[N]`` or hidden ``[N, E]``), the plan.
Forward = Callable[[Any, Any], Any]


class Runner(Protocol):
    """Runs a stage's forwards (see the module docstring)."""

    def groups(self, sizes: Sequence[int]) -> list[list[int]]:
        """The items of a batch (by index, ``sizes`` new rows each) in forwards."""
        ...

    def run(
        self, key: tuple[int, int, int], inputs: Sequence[Any], prepare: Prepare, forward: Forward
    ) -> Any:
        """The output of one forward of ``inputs`` (one array per item); ``key`` is its
        shape: (new rows, rows kept past the last layer, rows out)."""
        ...

    def replay_seconds(self, rows: int, repeats: int) -> float | None:
        """Device seconds of one replay of a captured ``rows``-row decode step (None:
        nothing captured, or no device)."""
        ...


def stack_inputs(xp: Any, inputs: Sequence[Any], ids: bool, id_dtype: Any) -> Any:
    """The items' inputs as one array: token ids ``[N]`` (``id_dtype``) or hidden states
    ``[N, E]`` float32, on ``xp``'s device."""
    if ids:
        return xp.asarray(np.concatenate([np.asarray(i).reshape(-1) for i in inputs]), id_dtype)
    parts = [xp.asarray(i, dtype=xp.float32) for i in inputs]
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0)


class EagerRunner:
    """Every batch as one forward, run at once (the CPU backend)."""

    def __init__(self, xp: Any, embed: bool) -> None:
        self.xp, self.embed = xp, embed

    def groups(self, sizes: Sequence[int]) -> list[list[int]]:
        """One forward for the whole batch."""
        return [list(range(len(sizes)))]

    def run(
        self, key: tuple[int, int, int], inputs: Sequence[Any], prepare: Prepare, forward: Forward
    ) -> Any:
        """``forward`` over the stacked inputs (ids as int64)."""
        plan = prepare()
        return forward(stack_inputs(self.xp, inputs, self.embed, self.xp.int64), plan)

    def replay_seconds(self, rows: int, repeats: int) -> float | None:
        """None: nothing is captured on the CPU."""
        return None
