"""The opt-in fast mode (``--dtype q8``): products of GGUF blocks with 8-bit activations.

llama.cpp multiplies its quantized weights with activations quantized to 8 bits per
32-value block and integer dot products; this mode does the same for every product whose
weights are all in a quantized format (:mod:`.q8_kernels`), of any number of rows:
decode, verify windows, batches and prefill alike, so that a row's result never depends
on the rows that share its product (a sequence decodes the same bits alone and batched).
F32/F16/BF16 weights, and rows that are not whole 64-value pairs of blocks, take the
exact kernels of :class:`.BlockMatrix`. The result is not
"dequantize, then multiply in float32": each activation moves by up to half its block's
step (``max|x| / 254``), so greedy tokens can differ from the float32 reference
(``benchmarks/engine.py`` prints how many golden prompts still match).

Layering: beside :mod:`.matrix` (whose parts it reads); numba is imported at the first
product, through :func:`.matrix.kernels`, which configures it.
"""

from __future__ import annotations

from functools import cache, partial
from types import ModuleType
from typing import Any

import numpy as np

from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.matrix import BlockMatrix

__all__ = ["Q8_FORMATS", "accepts", "q8_product"]

# The formats with integer quants (kernel ids of the .formats rows with a .q8 reading).
Q8_FORMATS = frozenset(f.kernel_id for f in FORMATS.values() if f.q8 is not None)
# An earlier version took only one-row products (Q8_MAX_ROWS = 1): its kernels took four
# rows per unpacked weight chunk in eight-lane vectors, with a scale and a scalar minimum
# per chunk and row, and in whole forwards of 2 and 4 rows were slower than the exact
# kernels' 4 x 4 tiles. The tiles of .q8_kernels step through two chunks per 512-bit
# register and keep the minimums in lanes across the rows.


@cache
def _kernels() -> ModuleType:
    matrix.kernels()  # numba configured (its cache folder) before it is imported
    from meshnode.engine.cpu import q8_kernels

    return q8_kernels


@cache
def _alone() -> Any:
    """:func:`.q8_alone.alone`, imported (numba configured first) on first use."""
    _kernels()
    from meshnode.engine.cpu.q8_alone import alone

    return alone


def accepts(m: BlockMatrix, rows: int) -> bool:
    """Whether ``rows`` activation rows times ``m`` go through the 8-bit kernels."""
    del rows  # any number: a row's result must not depend on the rows beside it
    return m.n_in % 64 == 0 and all(p.fmt.kernel_id in Q8_FORMATS for p in m.parts)


def q8_product(m: BlockMatrix, x: np.ndarray) -> np.ndarray:
    """``x @ m`` (``x`` ``[r, in]`` float32) with ``x`` quantized to 8 bits per 32-value
    block: ``[r, out]`` float32. Shared with the kernel threads as :class:`.BlockMatrix`
    shares its products. Raises ``ValueError`` on a shape mismatch."""
    if x.ndim != 2 or x.shape[1] != m.n_in:
        raise ValueError(f"x of shape {x.shape} does not multiply a matrix of {m.n_in} rows")
    kernels = _kernels()
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty((x.shape[0], m.n_out), np.float32)
    if not x.shape[0]:
        return out
    fmts, raws = m._fmts, m._raws
    tiled = x.shape[0] >= kernels.TILE_MIN_ROWS
    threads = min(matrix._threads_here(), m.nbytes // max(1, matrix.PARALLEL_MIN_BYTES))
    chunk = partial(kernels.chunk_kernel, *fmts, tiled)  # compiled at its first run
    if threads > 1:  # as BlockMatrix shares its products: a thread per PARALLEL_MIN_BYTES
        q = kernels.quantized(flat, x.shape[0])
        # posted as k rows of n_in bytes (the pool cuts the exact kernels' chunks); the
        # chunks read the whole buffer, which the pool keeps while they may
        if matrix._pool().run(chunk, raws, q[: flat.shape[0]], out, threads, keep=q):
            return out
    _alone()(chunk(), *raws, flat, out)  # the same chunk function, alone
    return out
