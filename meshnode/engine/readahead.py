"""Read-ahead of a stage's next layer, for weights served from disk (issue 34).

A CPU stage's weights are views of the model file's memory map (GGUF blocks kept as
stored: :class:`~meshnode.engine.cpu.matrix.BlockMatrix`). When a mesh is short of memory,
the planner gives a node more layer bytes than it has memory
(:mod:`meshnode.node.planner`, Larger than memory), and the kernel pages them in from disk
as the kernels touch them: a fault and a read per page, with the CPU idle meanwhile. Asking
for the *next* layer's pages (``MADV_WILLNEED``, asynchronous) before the current layer
computes overlaps the disk with the compute, so a stage whose layers do not stay resident
runs at about the slower of the two rather than their sum.

Only a stage that reads from disk turns it on (:func:`read_ahead`, which the node calls
for a stage whose weights and KV exceed its memory): on resident pages the call still walks
the page cache, which a stage held in memory need not pay for every layer of every pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from meshnode_packaging.gguf_file import will_need

from meshnode.engine.cpu.matrix import BlockMatrix
from meshnode.engine.model import Stage


def read_ahead(stage: Stage, *, short: bool = True) -> bool:
    """Turn on ``stage``'s read-ahead of its next layer when its node is ``short`` of memory
    for it and its weights are views of the file (GGUF blocks on the CPU); whether it did."""
    if not short or not stage.backend.cpu_blocks:
        return False
    stage.read_ahead = ReadAhead(stage.layers)
    return True


class ReadAhead:
    """Calls ``MADV_WILLNEED`` on the file-mapped arrays of one layer of a stage's blocks."""

    def __init__(self, blocks: Sequence[Any]) -> None:
        self._arrays = [list(_arrays(block)) for block in blocks]

    def __call__(self, index: int) -> int:
        """Start reading layer ``index`` of the stage (wrapping to 0 past the last: the next
        pass's first); the number of arrays asked for."""
        if not self._arrays:
            return 0
        return sum(will_need(a) for a in self._arrays[index % len(self._arrays)])


def _arrays(block: Any) -> Iterator[np.ndarray[Any, Any]]:
    """The NumPy arrays a block's fields hold: plain arrays, a block matrix's parts. Nested
    records (a mixture of experts) are left out: a token reads only its chosen experts,
    which are not known before the router runs."""
    if not dataclasses.is_dataclass(block):
        return
    for field in dataclasses.fields(block):
        value = getattr(block, field.name)
        if isinstance(value, BlockMatrix):
            yield from (part.raw for part in value.parts)
        elif isinstance(value, np.ndarray):
            yield value
