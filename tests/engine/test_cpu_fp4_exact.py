"""The exact MXFP4 products by byte shuffles (``engine/cpu/fp4_exact.py``, AVX2) give the
bits of the other exact kernels: every code under every scale decodes to the float32
``d * KVALUES[code]``, and products of 1..16 activation rows equal, value for value, the
sixteen-lane tiles' (:func:`.kernels.tile_form` 16, which keep the conversions or
AVX-512's ``vpermps`` tables), and a row alone equals that row in a batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshnode.engine.cpu import MAX_KERNEL_ROWS, matrix, narrow
from meshnode.engine.cpu.formats import FORMATS
from tests.engine.test_cpu_fp4 import reference

fp4 = pytest.importorskip("meshnode.engine.cpu.fp4")
if not fp4.shuffles_bytes():
    pytest.skip("this CPU has no AVX2 (vpshufb on 256 bits)", allow_module_level=True)

MXFP4 = FORMATS["MXFP4"].kernel_id


def _every_byte_under_every_scale() -> np.ndarray:
    """256 blocks: block ``e`` has the scale byte ``e`` and the sixteen code bytes
    ``16 (e % 16) ..`` (each scale meets sixteen byte values, every byte sixteen
    scales)."""
    blocks = np.zeros((256, 17), np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = (16 * (np.arange(256)[:, None] % 16) + np.arange(16)[None, :]) % 256
    return blocks.reshape(-1)


def test_the_tables_hold_the_products_high_bytes() -> None:
    from meshnode.engine.cpu import fp4_exact

    t = fp4_exact.TABLES
    words = (t[:, 16:].astype(np.uint32) << 24) | (t[:, :16].astype(np.uint32) << 16)
    e = np.arange(256)
    d = np.ldexp(np.float32(1), e - 128).astype(np.float32)  # the subnormal 0 and 1 too
    with np.errstate(over="ignore"):
        want = d[:, None] * np.asarray(fp4.KVALUES, np.float32)[None, :]
    np.testing.assert_array_equal(words, want.view(np.uint32))


def test_every_code_under_every_scale_decodes_to_its_float32() -> None:
    """fp4_block8's four vectors are a block's values 0, 2, .., 14, then 1, 3, .., 15,
    16, 18, .., 30 and 17, .., 31: the definition's values, bit for bit (subnormal
    scales, infinities, code 8 as +0)."""
    from numba import njit

    from meshnode.engine.cpu import fp4_exact
    from meshnode.engine.cpu.simd import vstore

    @njit(cache=False)
    def values(raw, table, out):  # type: ignore[no-untyped-def]
        for b in range(256):
            w0, w1, w2, w3 = fp4_exact.fp4_block8(raw, 17 * b, table)
            vstore(out, 32 * b, w0)
            vstore(out, 32 * b + 8, w1)
            vstore(out, 32 * b + 16, w2)
            vstore(out, 32 * b + 24, w3)

    raw = _every_byte_under_every_scale()
    out = np.zeros(256 * 32, np.float32)
    values(raw, fp4_exact.TABLES.reshape(-1), out)
    with np.errstate(over="ignore"):
        defined = reference(raw, 1, 256 * 32).astype(np.float32).reshape(-1)
        blocks = raw.reshape(256, 17)
        d = np.ldexp(np.float32(1), blocks[:, :1].astype(np.int32) - 128).astype(np.float32)
        codes = np.concatenate([blocks[:, 1:] & 15, blocks[:, 1:] >> 4], axis=1)
        want = d * np.asarray(fp4.KVALUES, np.float32)[codes]  # code 8: +0, not -0
    np.testing.assert_array_equal(want.reshape(-1), defined)
    permuted = want.reshape(256, 2, 8, 2).transpose(0, 1, 3, 2).reshape(-1)  # evens, odds
    np.testing.assert_array_equal(out.view(np.uint32), permuted.view(np.uint32))


def _rows(rows: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, row bytes]`` of MXFP4 blocks: every code byte, scales from the subnormal
    0 and 1 up to 2**3 (finite products: an infinite weight makes NaN sums)."""
    blocks = rng.integers(0, 256, (rows * n_in // 32, 17), dtype=np.uint8)
    blocks[:, 0] = rng.choice(np.r_[0, 1, 2, 100:131], len(blocks))
    return blocks.reshape(rows, -1)


def _product(form: int) -> Any:
    k = matrix.kernels()
    return k._serial_product(MXFP4, MXFP4, MXFP4, form, k.ANY_ROWS)  # 1 and k rows


@pytest.mark.parametrize("n_in", [64, 288, 512, 2880])
def test_products_are_the_sixteen_lane_tiles_bits(n_in: int) -> None:
    """Parts of 70, 9 and 6 weight rows (passes of four, and short last ones), for 1 ..
    MAX_KERNEL_ROWS activation rows with lanes of very different sizes (an order
    change shows); n_in below a tile block (64), not a multiple of it (288, 2880)."""
    assert narrow.fp4_shuffled(*_literals(MXFP4, 8))  # the path under test runs
    rng = np.random.default_rng(n_in)
    parts = [_rows(n, n_in, rng) for n in (70, 9, 6)]
    sixteen, eight = _product(16), _product(8)
    n_out = sum(p.shape[0] for p in parts)
    for k in (*range(1, 6), 8, 9, MAX_KERNEL_ROWS):
        x = rng.standard_normal(k * n_in).astype(np.float32)
        x[::97] *= 1e6
        x[5::89] *= 1e-6
        want, got = np.empty((k, n_out), np.float32), np.empty((k, n_out), np.float32)
        sixteen(*parts, x, want)
        eight(*parts, x, got)
        differ = np.count_nonzero(want.view(np.uint32) != got.view(np.uint32))
        assert differ == 0, f"{k} rows: {differ} of {want.size} values differ"
        alone = np.empty((1, n_out), np.float32)
        for r in {0, k - 1}:
            eight(*parts, x[r * n_in : (r + 1) * n_in], alone)
            np.testing.assert_array_equal(alone[0].view(np.uint32), got[r].view(np.uint32))


def _literals(*values: int) -> tuple[Any, ...]:
    from numba import types

    return tuple(types.IntegerLiteral(v) for v in values)


def test_only_mxfp4_on_eight_lanes_takes_the_shuffles() -> None:
    assert narrow.fp4_shuffled(*_literals(MXFP4, 8))
    assert not narrow.fp4_shuffled(*_literals(MXFP4, 16))
    assert not narrow.fp4_shuffled(*_literals(FORMATS["Q4_0"].kernel_id, 8))
