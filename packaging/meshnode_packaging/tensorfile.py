"""Safetensors files that also carry GGML-quantized tensors, written and memory-mapped here.

The layout is plain safetensors (``u64 header length | JSON header | data``), so any safetensors
reader opens our files. Float tensors use their native safetensors dtype (``F32``, ``F16``,
``BF16``) and logical shape. A GGML-quantized tensor is stored as its raw blocks with dtype
``U8`` and shape ``[nbytes]``; the header's ``__metadata__["meshnode.ggml"]`` (a JSON string,
since safetensors metadata values must be strings) maps its name to ``{"type", "shape"}``, the
GGML type name and the logical numpy shape, so the loader dequantizes it.

We write the format ourselves rather than through ``safetensors.numpy`` because NumPy has no
bfloat16 and because writing streams each tensor once while hashing it. We read through a NumPy
memmap so that opening a file costs only its header and a tensor's pages are read on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from meshnode_packaging.errors import InvalidPackage, Problem
from meshnode_packaging.sources import RawTensor

FLOAT_DTYPES = ("F32", "F16", "BF16")
GGML_METADATA_KEY = "meshnode.ggml"
# A header larger than this is not a tensor index but garbage (or an attack); the safetensors
# reference implementation caps it at 100 MB as well.
MAX_HEADER_BYTES = 100_000_000
_ALIGN = 8  # safetensors pads the header so that the data section starts 8-byte aligned
_WRITE_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class FileDigest:
    """Size in bytes and hex sha256 of a file that was just written."""

    size: int
    sha256: str


def _header(tensors: list[RawTensor]) -> bytes:
    entries: dict[str, Any] = {}
    ggml: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        nbytes = int(t.data.nbytes)
        if t.dtype in FLOAT_DTYPES:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape)}
        else:
            entries[t.name] = {"dtype": "U8", "shape": [nbytes]}
            ggml[t.name] = {"type": t.dtype, "shape": list(t.shape)}
        entries[t.name]["data_offsets"] = [offset, offset + nbytes]
        offset += nbytes
    metadata = {"format": "meshnode"}
    if ggml:
        metadata[GGML_METADATA_KEY] = json.dumps(ggml, separators=(",", ":"), sort_keys=True)
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % _ALIGN)


def _write_hashed(f: BinaryIO, h: Any, data: bytes | memoryview) -> None:
    f.write(data)
    h.update(data)


def write_tensor_file(path: Path, tensors: Iterable[RawTensor]) -> FileDigest:
    """Write ``tensors`` to ``path`` atomically (temp file + rename); return its size and sha256."""
    items = list(tensors)
    header = _header(items)
    h = hashlib.sha256()
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as f:
        _write_hashed(f, h, struct.pack("<Q", len(header)))
        _write_hashed(f, h, header)
        for t in items:
            flat = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
            for i in range(0, flat.nbytes, _WRITE_CHUNK_BYTES):
                _write_hashed(f, h, flat[i : i + _WRITE_CHUNK_BYTES].data)
        size = f.tell()
    os.replace(tmp, path)
    return FileDigest(size=size, sha256=h.hexdigest())


class TensorFile:
    """A memory-mapped tensor file; :meth:`raw` returns one tensor without reading the others."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise self._invalid("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise self._invalid(f"header length {n} exceeds {MAX_HEADER_BYTES}")
            raw_header = f.read(n)
        try:
            header: dict[str, Any] = json.loads(raw_header)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._invalid(f"header is not JSON: {exc}") from exc
        metadata = header.pop("__metadata__", None) or {}
        self._ggml: dict[str, Any] = json.loads(metadata.get(GGML_METADATA_KEY, "{}"))
        self._entries: dict[str, Any] = header
        self._data_start = 8 + n
        self._map: np.memmap[Any, np.dtype[np.uint8]] | None = None

    def _invalid(self, message: str) -> InvalidPackage:
        return InvalidPackage([Problem(self.path.name, "header", message)])

    def names(self) -> list[str]:
        """The tensor names in file order."""
        return sorted(self._entries, key=lambda k: int(self._entries[k]["data_offsets"][0]))

    def _data(self) -> np.memmap[Any, np.dtype[np.uint8]]:
        if self._map is None:
            size = self.path.stat().st_size - self._data_start
            self._map = np.memmap(
                self.path, dtype=np.uint8, mode="r", offset=self._data_start, shape=(size,)
            )
        return self._map

    def raw(self, name: str) -> RawTensor:
        """Tensor ``name`` as a :class:`RawTensor` whose ``data`` is a view of the mapped file."""
        entry = self._entries[name]
        start, end = (int(x) for x in entry["data_offsets"])
        data = self._data()[start:end] if end > start else np.zeros(0, np.uint8)
        if entry["dtype"] == "U8" and name in self._ggml:
            tag = self._ggml[name]
            return RawTensor(name, str(tag["type"]), tuple(int(d) for d in tag["shape"]), data)
        dtype = str(entry["dtype"])
        if dtype not in FLOAT_DTYPES:
            raise self._invalid(f"tensor {name!r} has unsupported dtype {dtype}")
        return RawTensor(name, dtype, tuple(int(d) for d in entry["shape"]), data)

    def close(self) -> None:
        """Drop the memory map (views handed out keep their own reference to it)."""
        self._map = None
