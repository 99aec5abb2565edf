"""Weight formats on the device, and the NumPy reference of their block math.

A linear weight lives on the device as ``[out, in]`` rows (the GGML/Hugging Face layout),
each row a whole number of 32-value units, in one of:

- ``f32``, ``f16``: plain arrays;
- ``bf16``: the raw 16-bit patterns in a ``uint16`` array (CuPy has no bfloat16);
- ``q8_0``, ``q4_k``: the GGML blocks exactly as the GGUF file stores them, so a GPU holds
  about 2x (Q8_0) or 3.5x (Q4_K) the layers it would in float16. The kernels decode a
  block where they read it (``kernels.SOURCE``, ``FmtQ8_0`` / ``FmtQ4_K``).

:func:`decode_units` is the same block math in NumPy, unit for unit; it is tested against
``meshnode_packaging.sources.dequantize`` and the kernels against it.
"""

from __future__ import annotations

from typing import Literal, cast

import numpy as np

from meshnode.engine.cpu.formats import FORMATS

__all__ = [
    "CPP_NAME",
    "QUANT_FORMATS",
    "Format",
    "bf16_bits",
    "decode_units",
    "encode_dense",
    "row_bytes",
]

Format = Literal["f32", "f16", "bf16", "q8_0", "q4_k"]

# The CPU's format rows that name a CUDA struct (their ``cuda``): every table below is
# derived from them, under the lower-case names of Format.
_ON_DEVICE = {cast(Format, f.name.lower()): f for f in FORMATS.values() if f.cuda is not None}

#: The C++ format struct of each format in ``kernels.SOURCE``.
CPP_NAME: dict[Format, str] = {name: str(f.cuda) for name, f in _ON_DEVICE.items()}

#: GGML quant types kept quantized on the device, by their GGML name.
QUANT_FORMATS: dict[str, Format] = {
    f.name: name for name, f in _ON_DEVICE.items() if f.block_size > 1
}

# (values per block, bytes per block) of each format.
_BLOCKS: dict[Format, tuple[int, int]] = {
    name: (f.block_size, f.type_size) for name, f in _ON_DEVICE.items()
}


def row_bytes(fmt: Format, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values; raises ``ValueError`` if not whole units."""
    block, size = _BLOCKS[fmt]
    if in_features % 32 or in_features % block:
        raise ValueError(f"{fmt}: a row of {in_features} is not whole blocks of {max(block, 32)}")
    return in_features // block * size


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (``uint16``), rounding to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def encode_dense(w: np.ndarray, fmt: Format) -> np.ndarray:
    """A float32 ``[out, in]`` matrix in the dense format ``fmt`` (``f32``, ``f16``, ``bf16``)."""
    if fmt == "f32":
        return np.ascontiguousarray(w, dtype=np.float32)
    if fmt == "f16":
        return np.ascontiguousarray(w, dtype=np.float16)
    if fmt == "bf16":
        return bf16_bits(w)
    raise ValueError(f"{fmt} is not a dense format")


def decode_units(raw: np.ndarray, fmt: Format, in_features: int) -> np.ndarray:
    """float32 ``[out, in]`` from rows ``raw`` (``[out, row_bytes]`` uint8) of format ``fmt``.

    The NumPy twin of ``F::unit`` in the kernels, with the same float32 operations.
    """
    out = raw.shape[0]
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out, row_bytes(fmt, in_features))
    if fmt == "f32":
        return raw.view(np.float32).copy()
    if fmt == "f16":
        return raw.view(np.float16).astype(np.float32)
    if fmt == "bf16":
        return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    if fmt == "q8_0":
        return _decode_q8_0(raw.reshape(out, -1, 34)).reshape(out, in_features)
    return _decode_q4_k(raw.reshape(out, -1, 144)).reshape(out, in_features)


def _f16(b: np.ndarray) -> np.ndarray:
    """float32 of the little-endian float16 in the last axis' 2 bytes."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _decode_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[..., 0:2])  # [out, nb, 1]
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).astype(np.float32)
    return d * q  # [out, nb, 32]


def _decode_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [out, nsb, 1]
    s = blocks[..., 4:16].astype(np.int32)  # [out, nsb, 12]
    qs = blocks[..., 16:144]  # [out, nsb, 128]
    units = []
    for j in range(8):  # ggml get_scale_min_k4(j)
        if j < 4:
            sc, m = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc = (s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4)
            m = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
        dl = d * sc[..., None].astype(np.float32)
        ml = dmin * m[..., None].astype(np.float32)
        q = (qs[..., (j // 2) * 32 : (j // 2) * 32 + 32] >> (4 * (j % 2))) & 0xF
        units.append(dl * q.astype(np.float32) - ml)  # [out, nsb, 32]
    return np.stack(units, axis=-2)  # [out, nsb, 8, 32]
