"""A small cached kernel for the tests of compiling ahead (``meshnode.engine.cpu.warmup``):
numba caches only functions defined in a file, at module level."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def scaled(x: np.ndarray, factor: float) -> np.ndarray:  # pragma: no cover (compiled)
    return x * factor
