"""Hugging Face MXFP4 (gpt-oss's ``*_blocks``/``*_scales``) repacked into GGML blocks.

The reference decodes the checkpoint's pair as transformers does
(``convert_moe_packed_tensors``): value ``2 j`` of a block from the low nibble of byte
``j``, ``2 j + 1`` from its high nibble, through the E2M1 table, times ``2**(s - 127)``.
"""

from __future__ import annotations

import numpy as np
import pytest
from meshnode_packaging.sources import RawTensor, SourceError, dequantize, mxfp4_from_hf

FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def hf_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 ``[..., out, in]`` of a Hugging Face MXFP4 pair."""
    values = np.empty((*blocks.shape[:-1], 32))
    values[..., 0::2] = FP4_VALUES[blocks & 15]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values *= np.exp2(scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*scales.shape[:-1], -1)


def test_a_repacked_checkpoint_decodes_to_the_checkpoints_values() -> None:
    rng = np.random.default_rng(9)
    experts, out, n_in = 3, 5, 96
    blocks = rng.integers(0, 256, (experts, out, n_in // 32, 16), dtype=np.uint8)
    blocks[0, 0, 0] = np.arange(0, 256, 16, dtype=np.uint8) | np.arange(16, dtype=np.uint8)
    scales = rng.integers(110, 140, (experts, out, n_in // 32), dtype=np.uint8)
    raw = mxfp4_from_hf(blocks, scales)
    assert raw.shape == (experts, out, n_in // 32 * 17)
    assert raw.dtype == np.uint8
    t = RawTensor("experts", "MXFP4", (experts, out, n_in), raw.reshape(-1))
    want = hf_reference(blocks, scales).astype(np.float32)
    np.testing.assert_array_equal(dequantize(t), want)


def test_pairs_that_do_not_match_are_refused() -> None:
    blocks = np.zeros((4, 2, 16), np.uint8)
    with pytest.raises(SourceError, match="do not pair"):
        mxfp4_from_hf(blocks, np.zeros((4, 3), np.uint8))
    with pytest.raises(SourceError, match="uint8"):
        mxfp4_from_hf(blocks.astype(np.int8), np.zeros((4, 2), np.uint8))
