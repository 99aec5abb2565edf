"""The exact products' Q8_0 decoder by an integer add and a fused multiply-add
(``engine/cpu/q8_0_exact.py``, :mod:`.narrow`'s passes on AVX2) makes the float32 ``d *
q`` of every int8 ``q`` under every finite float16 scale ``d``, and the products of 1..16
activation rows, in both tile forms, equal value for value the exact products' definition
computed with :func:`.wide._q8_0`'s conversion (each output sixteen FMA chains in order,
then the tree sum), whatever the rows' length."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.q8_0_exact import q8_0_block
from meshnode.engine.cpu.simd import vstore, wfma, wload, wsum, wzero
from meshnode.engine.cpu.wide import wchunk

Q8_0 = FORMATS["Q8_0"].kernel_id


@njit(cache=True)
def _decode(row, out):  # type: ignore[no-untyped-def]
    for c in range(out.shape[0] // 32):
        w0, w1, w2, w3 = q8_0_block(row, c)
        vstore(out, 32 * c, w0)
        vstore(out, 32 * c + 8, w1)
        vstore(out, 32 * c + 16, w2)
        vstore(out, 32 * c + 24, w3)


def test_every_int8_under_every_finite_scale_decodes_to_its_float32() -> None:
    """Eight blocks a scale (every int8 once), every finite float16 scale: subnormal,
    negative, zero and the largest; +0 and -0 count as equal (no FMA chain from +0 tells
    them apart), every other value bit for bit."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    scales = bits.view(np.float16)
    scales = scales[np.isfinite(scales)]
    q = np.arange(-128, 128, dtype=np.int8).reshape(8, 32)
    blocks = np.zeros((scales.size, 8, 34), np.uint8)
    blocks[:, :, :2] = scales.view(np.uint8).reshape(-1, 1, 2)
    blocks[:, :, 2:] = q.view(np.uint8)[None]
    row = blocks.reshape(-1)
    got = np.empty(scales.size * 256, np.float32)
    _decode(row, got)
    want = (scales.astype(np.float32)[:, None] * q.reshape(-1).astype(np.float32)[None]).ravel()
    zero = want == 0
    assert np.all(got[zero] == 0)
    np.testing.assert_array_equal(got[~zero].view(np.uint32), want[~zero].view(np.uint32))


@njit(cache=True)
def _definition(raw, x, out):  # type: ignore[no-untyped-def]
    # out[r, o]: sixteen chains over x[r] and row o decoded by wide._q8_0 (a conversion)
    k, n_in = out.shape[0], x.shape[0] // out.shape[0]
    for o in range(out.shape[1]):
        for r in range(k):
            acc = wzero()
            for c in range(n_in // 32):
                w0, w1 = wchunk(Q8_0, raw[o], c)
                acc = wfma(w0, wload(x, r * n_in + 32 * c), acc)
                acc = wfma(w1, wload(x, r * n_in + 32 * c + 16), acc)
            out[r, o] = wsum(acc)


@pytest.mark.parametrize("n_in", [320, 1024, 2880])
def test_products_equal_the_definition_at_any_row_length(n_in: int) -> None:
    """Rows of whole 256-value blocks (1024) and with a short last one (320: the passes
    up to four activation rows, the scratch's room; gpt-oss's 2880), 1..16 activation
    rows, both tile forms: the definition's bits, and a row alone equals it in a batch."""
    kernels = matrix.kernels()
    rng = np.random.default_rng(31)
    n_out = 37  # passes of four and a partial one
    blocks = rng.integers(0, 256, (n_out * n_in // 32, 34), np.uint8)
    d = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(n_out, -1)
    none = np.zeros((0, 34), np.uint8)
    forms = [kernels._serial_product(Q8_0, Q8_0, Q8_0, form, kernels.ANY_ROWS) for form in (8, 16)]
    for k in range(1, 17):
        x = rng.standard_normal(k * n_in).astype(np.float32)
        x[::97] *= 1e6  # lanes of very different sizes: an order change shows
        want = np.empty((k, n_out), np.float32)
        _definition(raw, x, want)
        for product in forms:
            got = np.empty((k, n_out), np.float32)
            product(raw, none, none, x, got)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            alone = np.empty((1, n_out), np.float32)
            product(raw, none, none, x[(k - 1) * n_in :], alone)
            np.testing.assert_array_equal(alone[0].view(np.uint32), got[k - 1].view(np.uint32))
