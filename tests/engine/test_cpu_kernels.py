"""The CPU block kernels against ``dequantize`` (gguf's decoders), format by format.

Decoding must be bit-identical to ``dequantize``; products must equal "dequantize, then
multiply in float32" up to summation order, for the kernel's 1..16 rows and for the
decode-then-BLAS path above that.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from meshnode_packaging.sources import RawTensor, dequantize

from meshnode.engine.cpu import MAX_KERNEL_ROWS, BlockMatrix, matrix, supported
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.pool import KernelPool

N_IN = 512  # two K-quant blocks per row, sixteen of the 32-value formats

# Byte offsets of the float16 scales in one block, per format that has them: random
# blocks get finite scales there (random bytes would make some of them inf or NaN).
_F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip
# Byte offsets of the E8M0 scales (a power of two each): random ones near 1, not up to
# 2**127, whose products overflow float32.
_E8M0_FIELDS = {"MXFP4": (0,)}


def random_tensor(
    dtype: str, n_out: int, rng: np.random.Generator, name: str = "w", n_in: int = N_IN
) -> RawTensor:
    """A ``[n_out, n_in]`` tensor of ``dtype``: every bit pattern of the quants is reachable."""
    values = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if dtype == "F32":
        data = values.view(np.uint8)
    elif dtype == "F16":
        data = values.astype(np.float16).view(np.uint8)
    elif dtype == "BF16":
        data = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        fmt = FORMATS[dtype]
        shape = (n_out * n_in // fmt.block_size, fmt.type_size)
        blocks = rng.integers(0, 256, shape, dtype=np.uint8)
        for off in _F16_FIELDS.get(dtype, ()):
            scale = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
            blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
        for off in _E8M0_FIELDS.get(dtype, ()):
            blocks[:, off] = rng.integers(118, 130, len(blocks), dtype=np.uint8)
        data = blocks
    return RawTensor(name, dtype, (n_out, n_in), np.ascontiguousarray(data).reshape(-1))


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_decoding_is_bit_identical_to_dequantize(dtype: str, rng: np.random.Generator) -> None:
    t = random_tensor(dtype, 24, rng)
    m = BlockMatrix([t])
    want = dequantize(t)
    np.testing.assert_array_equal(m.dense(), want)
    ids = [0, 23, 5, 5]
    np.testing.assert_array_equal(m.rows(ids), want[ids])


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("k", [1, 2, 3, 7, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_products_equal_dequantize_then_multiply(
    dtype: str,
    k: int,
    parallel: bool,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    idle_threads: KernelPool,
) -> None:
    # Small matrices run serially; the kernel threads are made to take this one too.
    monkeypatch.setattr(matrix, "PARALLEL_MIN_BYTES", 0 if parallel else 1 << 62)
    monkeypatch.setattr(matrix, "_threads", 2)
    monkeypatch.setattr(matrix, "_pool", lambda: idle_threads)
    before = idle_threads.posted
    t = random_tensor(dtype, 70, rng)  # 70 rows: three chunks, the last partial
    x = rng.standard_normal((k, N_IN)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(t).T.astype(np.float64)
    got = x @ BlockMatrix([t])
    assert got.shape == (k, 70)
    assert got.dtype == np.float32
    # float32 sums of 512 products, in another order: a few ulp of the terms' magnitude
    scale = np.abs(x).astype(np.float64) @ np.abs(dequantize(t)).T.astype(np.float64)
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    # more rows go through the tiles (BLAS's, or the compiled GEMM's where this BLAS
    # rounds a row by its batch), not through the kernel threads
    assert idle_threads.posted - before == (parallel and k <= MAX_KERNEL_ROWS)


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_a_row_alone_is_the_same_bits_as_in_a_batch(
    dtype: str,
    parallel: bool,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    idle_threads: KernelPool,
) -> None:
    """One activation row takes its own loop (four weight rows decoded in registers), a
    batch another (rows decoded into a buffer, then register tiles): both sum each output
    in the one order of :mod:`.kernels`, so each row of a batch of eight is the same bits
    as that row alone (issue 35), whatever the format."""
    monkeypatch.setattr(matrix, "PARALLEL_MIN_BYTES", 0 if parallel else 1 << 62)
    monkeypatch.setattr(matrix, "_threads", 2)
    monkeypatch.setattr(matrix, "_pool", lambda: idle_threads)
    m = BlockMatrix([random_tensor(dtype, 70, rng)])  # whole passes of four, then two rows
    x = rng.standard_normal((8, N_IN)).astype(np.float32)
    batch = x @ m
    for r in range(len(x)):
        alone = x[r : r + 1] @ m
        differ = int(np.count_nonzero(alone[0] != batch[r]))
        assert differ == 0, f"row {r} alone differs from the batch's in {differ} values"


def test_gguf_quantized_weights_multiply_like_their_float32(rng: np.random.Generator) -> None:
    """Blocks written by gguf's own quantizer (the Q4_K_M mix's Q8_0 and Q5_0 among them)."""
    values = rng.standard_normal((48, N_IN)).astype(np.float32)
    x = rng.standard_normal((2, N_IN)).astype(np.float32)
    for dtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        qtype = gguf.GGMLQuantizationType[dtype]
        blocks = gguf.quants.quantize(values, qtype)
        t = RawTensor("w", dtype, values.shape, blocks.reshape(-1))
        ref = dequantize(t)
        np.testing.assert_allclose(x @ BlockMatrix([t]), x @ ref.T, rtol=1e-4, atol=1e-4)


def test_parts_of_different_formats_stack_along_out(rng: np.random.Generator) -> None:
    """A fused Q/K/V whose parts are stored in different formats (as in Q4_K_M files)."""
    parts = [random_tensor("Q4_K", 16, rng), random_tensor("Q6_K", 8, rng)]
    parts.append(random_tensor("Q8_0", 8, rng))
    m = BlockMatrix(parts)
    assert m.shape == (N_IN, 32)
    assert m.nbytes == sum(p.data.nbytes for p in parts)
    ref = np.concatenate([dequantize(p) for p in parts])
    for k in (1, MAX_KERNEL_ROWS + 4):
        x = rng.standard_normal((k, N_IN)).astype(np.float32)
        np.testing.assert_allclose(x @ m, x @ ref.T, rtol=1e-4, atol=1e-4)
    one = rng.standard_normal(N_IN).astype(np.float32)
    np.testing.assert_allclose(one @ m, one @ ref.T, rtol=1e-4, atol=1e-4)


def test_the_matrix_is_the_files_bytes_not_a_copy(rng: np.random.Generator) -> None:
    t = random_tensor("Q4_1", 8, rng)
    m = BlockMatrix([t])
    assert np.shares_memory(m.parts[0].raw, t.data)


def test_bad_input_is_refused(rng: np.random.Generator) -> None:
    q = random_tensor("Q8_0", 4, rng)
    with pytest.raises(ValueError, match="1 to 3 parts"):
        BlockMatrix([q] * 4)
    odd = RawTensor("odd", "Q8_0", (1, 48), np.zeros(51, np.uint8))
    with pytest.raises(ValueError, match="not a block matrix"):
        BlockMatrix([odd])
    with pytest.raises(ValueError, match="not a block matrix"):
        BlockMatrix([RawTensor("iq", "IQ2_XS", (1, 256), np.zeros(74, np.uint8))])
    # whole blocks of F16, but not whole 32-value chunks of the kernels: stays float32
    short = RawTensor("short", "F16", (2, 48), np.zeros(192, np.uint8))
    assert not supported(short)
    with pytest.raises(ValueError, match="not a block matrix"):
        BlockMatrix([short])
    m = BlockMatrix([q])
    with pytest.raises(IndexError, match="outside"):
        m.rows([4])
    with pytest.raises(ValueError, match="columns"):
        np.zeros((1, 8), np.float32) @ m


def test_sixteen_lane_sums_at_once_equal_one_at_a_time(rng: np.random.Generator) -> None:
    """``wsums`` (the 4 x 4 tiles' sums) adds each vector's lanes in ``wsum``'s order."""
    from numba import njit

    from meshnode.engine.cpu.simd import wlane, wload, wsum, wsums

    @njit
    def both(x):  # type: ignore[no-untyped-def]
        vs = (
            wload(x, 0), wload(x, 16), wload(x, 32), wload(x, 48),
            wload(x, 64), wload(x, 80), wload(x, 96), wload(x, 112),
            wload(x, 128), wload(x, 144), wload(x, 160), wload(x, 176),
            wload(x, 192), wload(x, 208), wload(x, 224), wload(x, 240),
        )  # fmt: skip
        at_once = wsums(vs)
        got, want = np.empty(16, np.float32), np.empty(16, np.float32)
        for i in range(16):
            got[i], want[i] = wlane(at_once, i), wsum(wload(x, 16 * i))
        return got, want

    x = (rng.standard_normal(256) * 10.0 ** rng.integers(-6, 6, 256)).astype(np.float32)
    got, want = both(x)
    np.testing.assert_array_equal(got, want)
    lanes = x.reshape(16, 16).astype(np.float64)
    assert np.all(np.abs(got - lanes.sum(1)) <= 1e-6 * np.abs(lanes).sum(1))


@pytest.mark.parametrize("dtype", [d for d in FORMATS if FORMATS[d].block_size > 1])
def test_extreme_blocks_decode_like_dequantize(dtype: str) -> None:
    """Every quant bit set, then none, then alternating bits, under the largest and the
    smallest-magnitude float16 scales of both signs: the sixteen-lane decoders' masks,
    shifts and scale products at their limits, bit for bit against ``dequantize``."""
    fmt = FORMATS[dtype]
    n_rows = 8
    blocks = np.zeros((n_rows, N_IN // fmt.block_size, fmt.type_size), np.uint8)
    for i, fill in enumerate((0xFF, 0x00, 0x55, 0xAA) * 2):
        blocks[i] = fill
    scales = np.array([65504.0, -65504.0, 6.1e-5, -6.1e-5] * 2, np.float16)
    for off in _F16_FIELDS.get(dtype, ()):
        blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(n_rows, 1, 2)
    t = RawTensor("w", dtype, (n_rows, N_IN), blocks.reshape(-1))
    with np.errstate(over="ignore", invalid="ignore"):
        want = dequantize(t)
    np.testing.assert_array_equal(BlockMatrix([t]).dense(), want)
