"""A GGUF file opened for reading: its metadata as Python values, its tensors as views of
the memory-mapped file.

``gguf.GGUFReader`` builds a NumPy view for every element of every metadata array, which
for a 262k-token vocabulary (Gemma 3) takes tens of seconds, on every open. This reader
walks the header once with ``struct`` and decodes arrays in bulk, so opening such a file
costs a fraction of a second; tensor data is never read here, only mapped.

Nothing in the file is trusted: counts, lengths, types and offsets are checked against the
file's size, and a bad header raises :class:`GGUFFormatError` (which the sources turn into
their ``GGUFFormatError``).
Layout (GGUF v2/v3): magic, version, tensor count, metadata count, metadata (key, type,
value), tensor infos (name, dims, type, offset), padding to ``general.alignment``, data.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = ["GGUFFile", "GGUFFormatError", "GGUFTensor"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
# Counts above these are not a model's: they would only make us allocate.
_MAX_TENSORS = 1 << 20
_MAX_KV = 1 << 20
_MAX_DIMS = 8
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# Scalar value types: struct format (little-endian) and NumPy dtype of an array of them.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),  # bool: one byte
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_BOOL = 7


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader accepts; the message says where and why."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in GGUF order (fastest-varying dimension first, as
    ``gguf.ReaderTensor``), its stored type, and ``data``, its bytes (a view of the map)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray[Any, np.dtype[np.uint8]]


class _Cursor:
    """Reads the header from the mapped bytes; every read is bounds-checked."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: not a readable GGUF file ({what})")

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"header runs past the end of the file at byte {self.pos}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        value = struct.unpack_from(fmt, self.take(size))[0]
        return value

    def u32(self) -> int:
        return int(self.unpack("<I"))

    def u64(self) -> int:
        return int(self.unpack("<Q"))

    def string(self) -> str:
        raw = self.take(self.u64())
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"a string at byte {self.pos} is not UTF-8") from exc

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALARS:
            raise self.fail(f"unknown metadata type {kind}")
        value = self.unpack(_SCALARS[kind][0])
        return bool(value) if kind == _BOOL else value

    def array(self) -> list[Any]:
        kind, count = self.u32(), self.u64()
        if count > len(self.buf):  # every element takes at least one byte
            raise self.fail(f"an array of {count} elements")
        if kind == _STRING:
            return [self.string() for _ in range(count)]
        if kind == _ARRAY:
            return [self.array() for _ in range(count)]
        if kind not in _SCALARS:
            raise self.fail(f"unknown array element type {kind}")
        dtype = np.dtype(_SCALARS[kind][1])
        values = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
        items: list[Any] = values.tolist()
        return [bool(v) for v in items] if kind == _BOOL else items


class GGUFFile:
    """The metadata (``fields``: key → value) and tensors of one GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GGUFFormatError(f"{path}: not a readable GGUF file ({exc})") from exc
        buf = memoryview(self._map)
        c = _Cursor(buf, path)
        if bytes(c.take(4)) != _MAGIC:
            raise c.fail("no GGUF magic")
        version = c.u32()
        if version not in _VERSIONS:
            raise c.fail(f"GGUF version {version}; supported: {_VERSIONS}")
        n_tensors, n_kv = c.u64(), c.u64()
        if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
            raise c.fail(f"{n_tensors} tensors and {n_kv} metadata keys")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            self.fields[key] = c.value(c.u32())
        infos = [_tensor_info(c) for _ in range(n_tensors)]
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1:
            raise c.fail(f"general.alignment {alignment!r}")
        start = -(-c.pos // alignment) * alignment
        everything = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [
            _tensor(c, everything, start, name, dims, kind, offset)
            for name, dims, kind, offset in infos
        ]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (a str, number, bool or list), or ``default``."""
        return self.fields.get(key, default)


def _tensor_info(c: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string()
    n_dims = c.u32()
    if n_dims > _MAX_DIMS:
        raise c.fail(f"tensor {name!r} has {n_dims} dimensions")
    dims = tuple(c.u64() for _ in range(n_dims))
    return name, dims, c.u32(), c.u64()


def _tensor(
    c: _Cursor,
    everything: np.ndarray[Any, np.dtype[np.uint8]],
    start: int,
    name: str,
    dims: tuple[int, ...],
    kind: int,
    offset: int,
) -> GGUFTensor:
    try:
        qtype = gguf.GGMLQuantizationType(kind)
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as exc:
        raise c.fail(f"tensor {name!r} has unknown type {kind}") from exc
    elements = math.prod(dims)
    if dims and dims[0] % block:
        raise c.fail(f"tensor {name!r}: rows of {dims[0]} are not whole blocks of {block}")
    size = elements // block * type_bytes
    begin = start + offset
    if begin + size > len(everything):
        raise c.fail(f"tensor {name!r} runs past the end of the file")
    return GGUFTensor(name, dims, qtype, everything[begin : begin + size])
