"""RMSNorm as one compiled call, for the few rows of decode and verify steps.

:func:`meshnode.engine.ops.rms_norm` is five NumPy calls (square, mean, add, square root,
divide, multiply) of a few microseconds each; a decode step of a 30-layer model makes
sixty of them or more, in the serial time between weight products. Here the sum of
squares runs in sixteen float32 lanes, then across them (another order than NumPy's
pairwise sum), and each row is ``weight * (x / sqrt(mean + eps))`` as the reference
writes it. Each row is computed alone: the result does not depend on the other rows.

:func:`add_rms_norm` is a block's residual add and the next norm in one call (with, for
Gemma, the norm of the added branch first): the same row function and the same float32
additions as the separate calls, so the same bits.
"""

from __future__ import annotations

import math

import numpy as np

from meshnode.engine.cpu.simd import entry, inner, wfma, wload, wsum, wzero

__all__ = ["LANES", "add_rms_norm", "rms_norm"]

LANES = 16  # the width of a sum step: rows must be a multiple of it


@inner
def _row(flat, at, weight, eps, oflat, to, width):  # type: ignore[no-untyped-def]
    # oflat[to : to + width] = RMSNorm of flat[at : at + width]; a function of its own
    # (not inlined into each caller's numba IR): compiled once for the two entry points
    # and their three calls, a first start's ~0.4 s less
    acc = wzero()
    for c in range(0, width, LANES):
        v = wload(flat, at + c)
        acc = wfma(v, v, acc)
    den = np.float32(math.sqrt(wsum(acc) / np.float32(width) + eps))
    for i in range(width):
        oflat[to + i] = weight[i] * (flat[at + i] / den)


@entry(nogil=True)
def rms_norm(x, weight, eps, out):  # type: ignore[no-untyped-def]
    """``out[i] = weight * (x[i] / sqrt(mean(x[i]^2) + eps))`` for ``x``, ``out``
    ``[r, E]`` float32 in C order, ``E`` a multiple of :data:`LANES`."""
    rows, width = x.shape
    flat, oflat = x.reshape(-1), out.reshape(-1)
    for r in range(rows):
        _row(flat, r * width, weight, eps, oflat, r * width, width)


@entry(nogil=True)
def add_rms_norm(x, h, h_weight, weight, eps, total, out):  # type: ignore[no-untyped-def]
    """``total = x + h'`` and ``out = rms_norm(total, weight)``, where ``h'`` is ``h``, or
    ``rms_norm(h, h_weight)`` when ``h_weight`` is not empty; all ``[r, E]`` float32 in
    C order (``out`` may be empty: the sum only), ``E`` a multiple of :data:`LANES`."""
    rows, width = x.shape
    flat, hflat, tflat, oflat = x.reshape(-1), h.reshape(-1), total.reshape(-1), out.reshape(-1)
    normed = np.empty(width if h_weight.shape[0] else 0, np.float32)
    for r in range(rows):
        at = r * width
        if h_weight.shape[0]:
            _row(hflat, at, h_weight, eps, normed, np.int64(0), width)
            for i in range(width):
                tflat[at + i] = flat[at + i] + normed[i]
        else:
            for i in range(width):
                tflat[at + i] = flat[at + i] + hflat[at + i]
        if oflat.shape[0]:
            _row(tflat, at, weight, eps, oflat, at, width)
