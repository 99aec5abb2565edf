"""Tensors as stored, decoded: :func:`dequantize` (every GGML type that gguf decodes, and the
plain floats), and the repacking of Hugging Face MXFP4 checkpoints into GGML blocks.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from meshnode_packaging.source_types import RawTensor, SourceError

__all__ = ["dequantize"]


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
