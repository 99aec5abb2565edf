"""RMSNorm as one compiled call, for the few rows of decode and verify steps.

:func:`meshnode.engine.ops.rms_norm` is five NumPy calls (square, mean, add, square root,
divide, multiply) of a few microseconds each; a decode step of a 30-layer model makes
sixty of them or more, in the serial time between weight products. Here the sum of
squares runs in sixteen float32 lanes, then across them (another order than NumPy's
pairwise sum), and each row is ``weight * (x / sqrt(mean + eps))`` as the reference
writes it. Each row is computed alone: the result does not depend on the other rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from meshnode.engine.cpu.simd import wfma, wload, wsum, wzero

__all__ = ["LANES", "rms_norm"]

LANES = 16  # the width of a sum step: rows must be a multiple of it


@njit(nogil=True, cache=True)
def rms_norm(x, weight, eps, out):  # type: ignore[no-untyped-def]
    """``out[i] = weight * (x[i] / sqrt(mean(x[i]^2) + eps))`` for ``x``, ``out``
    ``[r, E]`` float32 in C order, ``E`` a multiple of :data:`LANES`."""
    rows, width = x.shape
    flat, oflat = x.reshape(-1), out.reshape(-1)
    n = np.float32(width)
    for r in range(rows):
        at = r * width
        acc = wzero()
        for c in range(0, width, LANES):
            v = wload(flat, at + c)
            acc = wfma(v, v, acc)
        den = np.float32(math.sqrt(wsum(acc) / n + eps))
        for i in range(width):
            oflat[at + i] = weight[i] * (flat[at + i] / den)
