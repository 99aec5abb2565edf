"""The opt-in fast mode (``--dtype q8``): products of GGUF blocks with 8-bit activations.

llama.cpp multiplies its quantized weights with activations quantized to 8 bits per
32-value block and integer dot products; this mode does the same for the products of up
to :data:`Q8_MAX_ROWS` activation rows (decode) whose weights are all in a quantized
format (:mod:`.q8_kernels`). Everything else (more rows, F32/F16/BF16 weights) takes
the exact kernels of :class:`.BlockMatrix`. The result is not
"dequantize, then multiply in float32": each activation moves by up to half its block's
step (``max|x| / 254``), so greedy tokens can differ from the float32 reference
(``benchmarks/engine.py`` prints how many golden prompts still match).

Layering: beside :mod:`.matrix` (whose parts it reads); numba is imported at the first
product, through :func:`.matrix.kernels`, which configures it.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import numpy as np

from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.matrix import BlockMatrix

__all__ = ["Q8_FORMATS", "Q8_MAX_ROWS", "accepts", "q8_product"]

# The formats with integer quants (kernel ids of .formats: Q4_0 .. Q6_K).
Q8_FORMATS = frozenset(range(3, 13))
# Products of more rows take the exact kernels. The q8 kernels take any number of rows
# (four at a time per unpacked weight chunk), but in whole forwards of 2 and 4 rows they
# were slower than the exact kernels' 4 x 4 tiles of sixteen float lanes: SmolLM2 27.2
# against 25.5 ms at 2 rows, 29.4 against 28.3 at 4; Gemma 3 61.8 against 54.2 and 64.8
# against 60.2 (benchmarks/engine.py --threads 1, k-row costs, load 1.4-3).
Q8_MAX_ROWS = 1


@cache
def _kernels() -> ModuleType:
    matrix.kernels()  # numba configured (its cache folder) before it is imported
    from meshnode.engine.cpu import q8_kernels

    return q8_kernels


def accepts(m: BlockMatrix, rows: int) -> bool:
    """Whether ``rows`` activation rows times ``m`` go through the 8-bit kernels."""
    return rows <= Q8_MAX_ROWS and all(p.fmt.kernel_id in Q8_FORMATS for p in m.parts)


def q8_product(m: BlockMatrix, x: np.ndarray) -> np.ndarray:
    """``x @ m`` (``x`` ``[r, in]`` float32) with ``x`` quantized to 8 bits per 32-value
    block: ``[r, out]`` float32. Shared with the kernel threads as :class:`.BlockMatrix`
    shares its products. Raises ``ValueError`` on a shape mismatch."""
    if x.ndim != 2 or x.shape[1] != m.n_in:
        raise ValueError(f"x of shape {x.shape} does not multiply a matrix of {m.n_in} rows")
    kernels = _kernels()
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty((x.shape[0], m.n_out), np.float32)
    fmts, raws = m._fmts, m._raws
    threads = min(matrix._threads_here(), m.nbytes // max(1, matrix.PARALLEL_MIN_BYTES))
    if threads > 1:  # as BlockMatrix shares its products: a thread per PARALLEL_MIN_BYTES
        chunk = kernels.chunk_kernel(*fmts)
        if matrix._pool().run(chunk, raws, kernels.quantized(flat), out, threads):
            return out
    kernels.product_kernel(*fmts)(*raws, flat, out)  # quantizes flat itself
    return out
