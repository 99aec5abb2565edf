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


def _every_byte_block() -> np.ndarray:
    """Sixteen blocks of 17 bytes whose code bytes are the 256 byte values (every pair of
    codes), scale bytes 0, 1, 2, 100, 127, 128, 129, 200, 254 and 255 among them."""
    blocks = np.zeros((16, 17), np.uint8)
    blocks[:, 0] = [0, 1, 2, 3, 100, 120, 126, 127, 128, 129, 130, 140, 200, 253, 254, 255]
    blocks[:, 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    return blocks.reshape(-1)


@pytest.mark.parametrize("shuffle", [False, True], ids=["selects", "vpshufb"])
def test_q8_codes_on_either_path(shuffle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfp4 by one byte shuffle (where the CPU has it) and by the portable compares and
    selects: both the unsigned bytes KVALUES[code] + 16 of the low, then high nibbles."""
    from numba import njit

    from meshnode.engine.cpu import fp4
    from meshnode.engine.cpu.simd_q8 import bstore

    if shuffle and not fp4.shuffles_bytes():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(fp4, "shuffles_bytes", lambda: shuffle)  # read when it compiles

    @njit(cache=False)
    def codes(raw, out):  # type: ignore[no-untyped-def]
        for b in range(16):
            bstore(out, 32 * b, fp4.bfp4(raw, 17 * b + 1))

    raw = _every_byte_block()
    out = np.zeros(16 * 32, np.uint8)
    codes(raw, out)
    qs = raw.reshape(16, 17)[:, 1:]
    nibbles = np.concatenate([qs & 15, qs >> 4], axis=1)  # [block, 32]
    want = np.asarray(fp4.KVALUES)[nibbles] + fp4.Q8_OFFSET
    np.testing.assert_array_equal(out.reshape(16, 32), want)


@pytest.mark.parametrize(
    ("how", "shuffle"),
    [("_converted", False), ("_converted", True), ("_looked_up", False)],
    ids=["converted-selects", "converted-pshufb", "looked-up"],
)
def test_exact_values_either_way(how: str, shuffle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's values by conversion (the codes' values by compares and selects, or by
    one byte shuffle where the CPU has it) and by table lookup (the decoder where the CPU
    permutes sixteen lanes in one instruction; elsewhere sixteen picks): all the
    definition's values, bit for bit, subnormal scales and infinities included."""
    from numba import njit

    from meshnode.engine.cpu import fp4
    from meshnode.engine.cpu.simd import wstore

    if shuffle and not fp4.shuffles_bytes():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(fp4, "shuffles_bytes", lambda: shuffle)  # read when it compiles
    block_values = njit(getattr(fp4, how))

    @njit(cache=False)
    def values(raw, out):  # type: ignore[no-untyped-def]
        for b in range(16):
            low, high = block_values(raw, 17 * b)
            wstore(out, 32 * b, low)
            wstore(out, 32 * b + 16, high)

    raw = _every_byte_block()
    out = np.zeros(16 * 32, np.float32)
    values(raw, out)
    with np.errstate(over="ignore"):
        want = reference(raw, 1, 512).astype(np.float32)  # e = 255: 12 * 2**127 is inf
        blocks = raw.reshape(16, 17)
        d = np.ldexp(np.float32(1), blocks[:, :1].astype(np.int32) - 128).astype(np.float32)
        codes = np.concatenate([blocks[:, 1:] & 15, blocks[:, 1:] >> 4], axis=1)
        products = d * np.asarray(fp4.KVALUES, np.float32)[codes]  # float32: d * KVALUES
    np.testing.assert_array_equal(out, want.reshape(-1))  # code 8: +0 where the sign gives -0
    np.testing.assert_array_equal(out.view(np.uint32), products.reshape(-1).view(np.uint32))


def test_eight_rows_scale_bytes_at_once() -> None:
    """e8m0_half8 (the one-row 8-bit kernel's eight scales) is e8m0_half lane by lane:
    ``2**(e - 128)`` for every byte, the subnormal scales of 0 and 1 included."""
    from numba import njit

    from meshnode.engine.cpu import fp4
    from meshnode.engine.cpu.simd import vstore

    @njit(cache=False)
    def scales(raw, out, one):  # type: ignore[no-untyped-def]
        for g in range(32):
            at = (g, 40 + g, 80 + g, 120 + g, 160 + g, 200 + g, 240 + g, 280 + g)
            vstore(out, 8 * g, fp4.e8m0_half8(raw, at, 3))
            for i in range(8):
                one[8 * g + i] = fp4.e8m0_half(raw, at[i] + 3)

    raw = np.zeros(320, np.uint8)
    codes = np.arange(256).reshape(32, 8)  # [g, i]: the byte of lane i of group g
    raw[(np.arange(8) * 40)[None, :] + np.arange(32)[:, None] + 3] = codes
    out, one = np.zeros(256, np.float32), np.zeros(256, np.float32)
    scales(raw, out, one)
    want = np.ldexp(np.float32(1), codes.reshape(-1) - 128).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(one.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("k", [2, 3, 4, 5, 9])
def test_q8_rows_are_the_same_bits_alone_and_together(k: int) -> None:
    """A q8 product of k rows gives each row the bits it gets alone: two rows a pass of
    the weights up to MXFP4_PAIRED_ROWS (.q8_fp4.two_mxfp4, an odd last one alone), the
    few-row groups above. 50 weight rows: six passes of eight and a short last one;
    every code byte under scales from the subnormal 0 and 1 up (finite products)."""
    from meshnode.engine.cpu import q8_kernels

    t = every_code_under_every_scale()
    raws = t.data.reshape(256, -1)
    raw = np.ascontiguousarray(np.concatenate([raws[:10], raws[120:160]]))  # [50, bytes]
    kernel = q8_kernels.product_kernel(*(FORMATS["MXFP4"].kernel_id,) * 3)
    empty = np.zeros((0, raw.shape[1]), np.uint8)
    x = np.random.default_rng(k).standard_normal((k, 512)).astype(np.float32)
    x[-1] *= 1e-3  # a row of other activation scales beside the first
    together = np.empty((k, 50), np.float32)
    kernel(raw, empty, empty, x.reshape(-1), together)
    for i in range(k):
        alone = np.empty((1, 50), np.float32)
        kernel(raw, empty, empty, x[i], alone)
        np.testing.assert_array_equal(together[i].view(np.uint32), alone[0].view(np.uint32))
