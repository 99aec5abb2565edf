"""A chi-square goodness-of-fit check without SciPy."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

# Standard normal quantile at 1 - 1e-4: a fixed seed makes the test deterministic, and this
# level makes a correct implementation fail only on a seed-specific 1-in-10,000 draw.
Z_999 = 3.719


def chi_square(counts: npt.NDArray[np.int64], probs: npt.NDArray[np.float64]) -> float:
    """Pearson's statistic over the cells with expected count > 0 (others must be empty)."""
    expected = probs * counts.sum()
    live = expected > 0
    assert counts[~live].sum() == 0, "a cell with probability 0 was observed"
    return float((((counts[live] - expected[live]) ** 2) / expected[live]).sum())


def critical_value(dof: int, z: float = Z_999) -> float:
    """Upper quantile of chi-square(dof), Wilson–Hilferty approximation."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


def assert_fits(counts: npt.NDArray[np.int64], probs: npt.NDArray[np.float64]) -> None:
    """Fail when the counts do not fit ``probs`` at the 1e-4 level."""
    dof = int((probs > 0).sum()) - 1
    stat = chi_square(counts, probs)
    assert stat < critical_value(dof), f"chi-square {stat:.1f} over {dof} dof"
