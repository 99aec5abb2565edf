"""A stage's memory-mapped weights into memory: read ahead a layer at a time when they
are served from disk (issue 34), every page faulted in at load when they fit (issue 31).

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

A stage whose weights fit in its node's memory has the opposite trouble: its pages are
in the page cache (or will be), but not yet in its own page tables, so the first touch of
each 4 KiB page costs a fault. A dense stage pays them all at its first token; a
mixture-of-experts stage at the first use of each expert, which may come late
(Qwen3-30B-A3B's layer 0, one row: 6.1 ms for experts never touched against 2.9 ms once
mapped, ``benchmarks/moe.py`` ``cold``). :func:`populate_weights` faults in every page of
its weights at load (``MADV_POPULATE_READ``), where it counts in the load's time instead
of the first requests'.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from meshnode_packaging.gguf_file import populate, will_need

from meshnode.engine.cpu.matrix import BlockMatrix
from meshnode.engine.model import Stage


@dataclasses.dataclass(frozen=True)
class Populated:
    """What :func:`populate_weights` did: ``nbytes`` of the weights' pages faulted in (or,
    ``advice`` ``willneed``, only read ahead: a kernel before Linux 5.14), in ``seconds``."""

    nbytes: int
    seconds: float
    advice: str  # populate, willneed, or empty: nothing was mapped from a file


def populate_weights(stage: Stage) -> Populated:
    """Fault in every page of ``stage``'s weights that are views of a file's map (GGUF
    blocks on the CPU, every expert of a mixture included) now, so that no first touch of
    one costs a page fault in a request (module docstring). Only for a stage whose node
    holds its weights in memory: pages not yet cached are read from the file. Nothing
    happens, quietly, for weights in memory (float32 copies, a GPU's) or where the kernel
    does not offer it."""
    began = time.perf_counter()
    paged = populate(weight_arrays(stage.weights)) if stage.backend.cpu_blocks else None
    if paged is None or not paged.nbytes:
        return Populated(0, 0.0, "")
    return Populated(paged.nbytes, time.perf_counter() - began, paged.advice)


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


def weight_arrays(held: Any) -> Iterator[np.ndarray[Any, Any]]:
    """Every NumPy array weights ``held`` hold (a stage's ``weights``, a layer's),
    however deep: records' fields, lists and tuples of them (a mixture's experts), a block
    matrix's parts."""
    if isinstance(held, np.ndarray):
        yield held
    elif isinstance(held, BlockMatrix):
        yield from (part.raw for part in held.parts)
    elif isinstance(held, (list, tuple)):
        for item in held:
            yield from weight_arrays(item)
    elif dataclasses.is_dataclass(held) and not isinstance(held, type):
        for field in dataclasses.fields(held):
            yield from weight_arrays(getattr(held, field.name))
