"""MXFP4 blocks (``engine/cpu/fp4.py``) against the format's definition and gguf.

The reference is written from the OCP MX definition, not from gguf: an E2M1 value (sign,
two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6) times ``2**(e - 127)``;
GGML's block puts the scale byte first and value ``j`` in the low nibble of byte ``j``,
value ``j + 16`` in its high nibble. ggml (and so meshnode) reads the scale 255 as
``2**128``, not as the NaN of the OCP specification.
"""

from __future__ import annotations

import numpy as np
import pytest
from meshnode_packaging.sources import RawTensor, dequantize

from meshnode.engine.cpu import BlockMatrix, q8
from meshnode.engine.cpu.formats import FORMATS

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def reference(raw: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """float64 ``[n_out, n_in]`` of GGML MXFP4 rows ``raw``, from the definition."""
    blocks = raw.reshape(n_out, n_in // 32, 17)
    scale = np.exp2(blocks[..., :1].astype(np.float64) - 127)  # [out, nb, 1]
    codes = np.concatenate([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], axis=-1)
    sign = np.where(codes & 8, -1.0, 1.0)
    values: np.ndarray = (scale * sign * E2M1[codes & 7]).reshape(n_out, n_in)
    return values


def every_code_under_every_scale() -> RawTensor:
    """256 rows, one per scale byte; each row's 16 blocks hold the 256 byte values (every
    pair of codes) in turn."""
    n_in = 512
    blocks = np.zeros((256, n_in // 32, 17), np.uint8)
    blocks[..., 0] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[..., 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    return RawTensor("w", "MXFP4", (256, n_in), blocks.reshape(-1))


def test_the_row_is_ggml_geometry() -> None:
    fmt = FORMATS["MXFP4"]
    assert (fmt.block_size, fmt.type_size, fmt.lanes) == (32, 17, 16)
    assert fmt.q8 is not None
    assert fmt.kernel_id in q8.Q8_FORMATS


def test_every_code_and_scale_decodes_as_defined_and_as_gguf() -> None:
    t = every_code_under_every_scale()
    with np.errstate(over="ignore"):
        want = reference(t.data, 256, 512).astype(np.float32)  # e = 255: 12 * 2**127 is inf
        from_gguf = dequantize(t)
    got = BlockMatrix([t]).dense()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, from_gguf)
    assert got[0, 1] == np.float32(2.0**-128)  # e = 0: a subnormal scale, kept exactly
    assert got[0, 1].view(np.uint32) == 0x00200000


@pytest.mark.parametrize("k", [1, 3, 20])
def test_products_equal_the_definition_then_multiply(k: int) -> None:
    t = every_code_under_every_scale()
    rows = slice(100, 150)  # scales 2**-27 .. 2**22: finite products
    sub = RawTensor("w", "MXFP4", (50, 512), t.data.reshape(256, -1)[rows].reshape(-1))
    w = reference(sub.data, 50, 512)
    x = np.random.default_rng(5).standard_normal((k, 512)).astype(np.float32)
    got = x @ BlockMatrix([sub])
    exact = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T  # float32 sums: ulps of this
    assert np.all(np.abs(got - exact) <= 1e-5 * scale)
