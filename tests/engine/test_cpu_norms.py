"""The compiled RMSNorm of CPU stages over GGUF blocks (``engine.cpu.norms`` through
``CpuBackend.rms_norm``) against ``engine.ops.rms_norm``.

Its sum of squares runs in sixteen lanes (NumPy sums pairwise): within float32 rounding
(``RTOL``). A row's result depends on that row alone, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshnode.engine import ops
from meshnode.engine.backend import cpu_backend

RTOL = 1e-6
ATOL = 1e-6


@pytest.mark.parametrize(("rows", "width"), [(1, 576), (8, 576), (3, 640), (100, 64)])
def test_compiled_rms_norm_matches_the_reference(rows: int, width: int) -> None:
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, width)) * rng.uniform(0.01, 30, (rows, 1))).astype(np.float32)
    weight = (1 + 0.3 * rng.standard_normal(width)).astype(np.float32)
    got = cpu_backend("native").rms_norm(x, weight, 1e-6)
    want = ops.rms_norm(np, x, weight, 1e-6)
    assert got.dtype == np.float32
    assert got.shape == x.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_a_row_is_bit_identical_alone_and_among_others() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    weight = rng.standard_normal(576).astype(np.float32)
    backend = cpu_backend("native")
    together = backend.rms_norm(x, weight, 1e-5)
    for i in range(len(x)):
        np.testing.assert_array_equal(backend.rms_norm(x[i : i + 1], weight, 1e-5)[0], together[i])


def test_float32_weights_keep_the_reference() -> None:
    """``--dtype float32`` (the parity-debugging mode) computes with ``ops`` exactly."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 576)).astype(np.float32)
    weight = rng.standard_normal(576).astype(np.float32)
    got = cpu_backend("float32").rms_norm(x, weight, 1e-5)
    np.testing.assert_array_equal(got, ops.rms_norm(np, x, weight, 1e-5))
