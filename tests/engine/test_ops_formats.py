"""Device weight formats: the NumPy block math the kernels mirror equals ``dequantize``."""

from __future__ import annotations

import numpy as np
import pytest
from meshnode_packaging.sources import RawTensor, dequantize

from meshnode.engine.cuda import formats
from tests.engine.tiny import random_blocks

RNG = np.random.default_rng(3)


def _raw(qtype: str, shape: tuple[int, int]) -> RawTensor:
    blocks = random_blocks(RNG, shape, qtype)
    return RawTensor("w", qtype, shape, np.ascontiguousarray(blocks).view(np.uint8).reshape(-1))


@pytest.mark.parametrize(("qtype", "fmt"), [("Q8_0", "q8_0"), ("Q4_K", "q4_k"), ("F16", "f16")])
def test_decode_units_equals_dequantize(qtype: str, fmt: formats.Format) -> None:
    t = _raw(qtype, (12, 512))
    raw = t.data.reshape(12, -1)
    np.testing.assert_array_equal(formats.decode_units(raw, fmt, 512), dequantize(t))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_block_matvec_equals_dequantize_then_matmul(fmt: formats.Format) -> None:
    """What the gemv kernel computes, in NumPy on the raw blocks, for 1..16 rows."""
    t = _raw(fmt.upper(), (40, 768))
    w = dequantize(t)
    for rows in (1, 3, 16):
        x = RNG.standard_normal((rows, 768)).astype(np.float32)
        got = x @ formats.decode_units(t.data.reshape(40, -1), fmt, 768).T
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)


def test_bf16_bits_round_to_nearest_even_and_decode_back() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -3.5, -0.0, np.inf], dtype=np.float32)
    bits = formats.bf16_bits(x)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0);
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6.
    assert list(bits) == [0x3F80, 0x3F80, 0x3F82, 0xC060, 0x8000, 0x7F80]
    back = formats.decode_units(np.tile(bits, 32)[None].view(np.uint8), "bf16", 32 * 6)
    np.testing.assert_array_equal(back[0, :6], [1.0, 1.0, 1.015625, -3.5, -0.0, np.inf])
    t = RawTensor("w", "BF16", (1, 6), bits.view(np.uint8))
    np.testing.assert_array_equal(dequantize(t)[0], back[0, :6])


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_encode_dense_then_decode_is_within_the_format_precision(fmt: formats.Format) -> None:
    w = RNG.standard_normal((4, 64)).astype(np.float32)
    raw = formats.encode_dense(w, fmt).view(np.uint8).reshape(4, -1)
    assert raw.shape[1] == formats.row_bytes(fmt, 64)
    rtol = {"f32": 0.0, "f16": 2**-11, "bf16": 2**-8}[fmt]
    np.testing.assert_allclose(formats.decode_units(raw, fmt, 64), w, rtol=rtol, atol=1e-7)


def test_row_bytes_refuses_rows_that_are_not_whole_units() -> None:
    assert formats.row_bytes("q8_0", 64) == 68
    assert formats.row_bytes("q4_k", 512) == 288
    with pytest.raises(ValueError, match="not whole blocks"):
        formats.row_bytes("q4_k", 288)
    with pytest.raises(ValueError, match="not whole blocks"):
        formats.row_bytes("f16", 40)
