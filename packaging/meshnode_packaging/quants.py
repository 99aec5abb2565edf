"""Tensors as stored, decoded: :func:`dequantize` (every GGML type that gguf decodes, and the
plain floats), and Hugging Face MXFP4 checkpoints repacked into GGML blocks
(:func:`mxfp4_from_hf`).
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from meshnode_packaging.source_types import RawTensor, SourceError

__all__ = ["dequantize", "mxfp4_from_hf"]


_FLOAT_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
}


def dequantize(t: RawTensor) -> np.ndarray:
    """Decode ``t`` to a float32 array of ``t.shape``.

    Supports F32, F16, BF16 and every GGML quant type that ``gguf.quants`` can decode
    (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K … Q6_K, IQ types). Raises :class:`SourceError`
    for a type name it does not know.
    """
    if t.dtype in _FLOAT_DTYPES:
        return t.data.view(_FLOAT_DTYPES[t.dtype]).astype(np.float32).reshape(t.shape)
    if t.dtype == "BF16":
        # bfloat16 is the top half of a float32: widen by shifting into the high 16 bits.
        wide = t.data.view("<u2").astype(np.uint32) << 16
        return wide.view(np.float32).reshape(t.shape)
    try:
        qtype = gguf.GGMLQuantizationType[t.dtype]
    except KeyError:
        raise SourceError(f"tensor {t.name}: unknown dtype {t.dtype!r}") from None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row = t.shape[-1]
    if row % block_size:
        raise SourceError(f"tensor {t.name}: row of {row} is not whole {t.dtype} blocks")
    blocks = t.data.reshape(-1, row // block_size * type_size)
    out = gguf.quants.dequantize(blocks, qtype)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(t.shape)


def mxfp4_from_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GGML ``MXFP4`` rows from a Hugging Face MXFP4 pair (gpt-oss's ``*_blocks`` and
    ``*_scales``), the same values in GGML's block layout.

    ``blocks`` is ``uint8`` ``[..., out, in / 32, 16]``: two E2M1 codes a byte, value
    ``2 j`` of a block in the low nibble of byte ``j`` and ``2 j + 1`` in the high one;
    ``scales`` is ``uint8`` ``[..., out, in / 32]``, E8M0 (``2**(s - 127)``). Returns
    ``uint8`` ``[..., out, in / 32 * 17]``: each block its scale byte, then 16 bytes with
    value ``j`` in the low nibble of byte ``j`` and ``j + 16`` in its high one (as llama.cpp's
    converter repacks them; ggml reads the doubled E2M1 value times ``2**(s - 128)``,
    the same number). Raises :class:`SourceError` if the shapes do not pair."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise SourceError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise SourceError(f"MXFP4 blocks {blocks.shape} do not pair with scales {scales.shape}")
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*scales.shape, 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [..., out, in / 32, 16]
    rows = np.concatenate([scales[..., None], packed], axis=-1)  # [..., out, in / 32, 17]
    return np.ascontiguousarray(rows.reshape(*scales.shape[:-1], -1))
