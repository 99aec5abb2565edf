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


@pytest.mark.parametrize("branch_norm", [False, True])
@pytest.mark.parametrize("then", [False, True])
@pytest.mark.parametrize("rows", [1, 8])
def test_residual_add_and_norm_in_one_call_equal_the_separate_calls_bit_for_bit(
    branch_norm: bool, then: bool, rows: int
) -> None:
    """A block's ``x + h`` (``h`` normed first, as Gemma's post-attention and post-MLP
    norms do) and the next norm in one compiled call: the bits of the separate calls."""
    rng = np.random.default_rng(rows)
    x, h = (rng.standard_normal((2, rows, 640)) * 3).astype(np.float32)
    w1, w2 = (1 + 0.3 * rng.standard_normal((2, 640))).astype(np.float32)
    h_weight, weight = (w1 if branch_norm else None), (w2 if then else None)
    backend = cpu_backend("native")
    total, normed = backend.add_rms_norm(x, h, h_weight, weight, 1e-6)
    want = x + (backend.rms_norm(h, w1, 1e-6) if branch_norm else h)
    np.testing.assert_array_equal(total, want)
    if then:
        np.testing.assert_array_equal(normed, backend.rms_norm(want, w2, 1e-6))
    else:
        assert normed is None
    reference = cpu_backend("float32").add_rms_norm(x, h, h_weight, weight, 1e-6)
    np.testing.assert_allclose(total, reference[0], rtol=RTOL, atol=ATOL)


def test_a_prefill_s_rows_cut_between_two_threads_are_the_bits_of_one_row_at_a_time() -> None:
    # 150 rows (past matrix.SHARED_ROWS): the norm, the add and norm and the SwiGLU each
    # run as two parts on the tile threads; every row equals that row computed alone
    from meshnode.engine.cpu import matrix
    from meshnode.engine.cpu.pool import KernelPool
    from meshnode.engine.cpu.tiles import TileThreads
    from tests.engine.test_kernel_pool import idle_gauge

    rng = np.random.default_rng(7)
    x, h = rng.standard_normal((2, 150, 576)).astype(np.float32)
    gate_up = rng.standard_normal((150, 2 * 576)).astype(np.float32)
    w1, w2 = rng.standard_normal((2, 576)).astype(np.float32)
    backend, team = cpu_backend("native"), TileThreads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matrix, "_threads", 2)
        mp.setattr(matrix, "_pool", lambda: KernelPool(idle_gauge(4)))
        mp.setattr(matrix, "_tile_threads", lambda: team)
        normed = backend.rms_norm(x, w1, 1e-5)
        total, both = backend.add_rms_norm(x, h, w1, w2, 1e-5)
        act = backend.glu(gate_up, "silu")
    assert team.posted == 3  # each call shared
    for i in range(0, 150, 7):
        one = slice(i, i + 1)
        np.testing.assert_array_equal(backend.rms_norm(x[one], w1, 1e-5), normed[one])
        alone = backend.add_rms_norm(x[one], h[one], w1, w2, 1e-5)
        assert alone[1] is not None
        assert both is not None
        np.testing.assert_array_equal(alone[0], total[one])
        np.testing.assert_array_equal(alone[1], both[one])
        np.testing.assert_array_equal(backend.glu(gate_up[one], "silu"), act[one])
