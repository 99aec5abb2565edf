"""The compiled SwiGLU/GeGLU activation of CPU stages over GGUF blocks (``engine.cpu.glu``
through ``CpuBackend.glu``) against ``engine.ops.silu_mul`` and ``gelu_tanh_mul``.

Its exponential is ``cpu.vexp.wexp`` (NumPy's ``exp`` is another approximation, each
within 2 units in the last place) and GeGLU's tanh is built on it: results agree within
float32 rounding (``RTOL``, ``ATOL`` for values near 0, where GELU's ``1 + tanh`` cancels
in the reference itself). A row's result depends on that row alone, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshnode.engine import ops
from meshnode.engine.backend import cpu_backend

RTOL = 2e-6
ATOL = 1e-6
REFERENCE = {"silu": ops.silu_mul, "gelu_tanh": ops.gelu_tanh_mul}


def _gate_up(rows: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 2 * width)) * rng.uniform(0.01, 12, (rows, 1))
    x[0, :8] = [0.0, -0.0, 100.0, -100.0, 1e-20, -1e-20, 90.0, -90.0]  # clamps, saturation
    return x.astype(np.float32)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (8, 1536), (3, 2048), (16, 64)])
def test_compiled_glu_matches_the_reference(activation: str, rows: int, width: int) -> None:
    x = _gate_up(rows, width, rows)
    got = cpu_backend("native").glu(x, activation)
    want = REFERENCE[activation](np, x)
    assert got.dtype == np.float32
    assert got.shape == (rows, width)
    scale = np.abs(x[:, width:])  # |up|: the absolute error of act(gate) is scaled by it
    np.testing.assert_array_less(np.abs(got - want), RTOL * np.abs(want) + ATOL * scale + 1e-30)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_a_row_is_bit_identical_alone_and_among_others(activation: str) -> None:
    x = _gate_up(9, 1536, 3)
    backend = cpu_backend("native")
    together = backend.glu(x, activation)
    for i in range(len(x)):
        np.testing.assert_array_equal(backend.glu(x[i : i + 1], activation)[0], together[i])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_float32_weights_and_odd_widths_keep_the_reference(activation: str) -> None:
    """``--dtype float32`` (the parity-debugging mode), and a width the kernel's sixteen
    lanes do not divide, compute with ``ops`` exactly."""
    for dtype, width in (("float32", 1536), ("native", 40)):
        x = _gate_up(2, width, 4)
        got = cpu_backend(dtype).glu(x, activation)  # type: ignore[arg-type]
        np.testing.assert_array_equal(got, REFERENCE[activation](np, x))
