"""Where each tensor lies in a GGUF or safetensors file, read from the file's first bytes.

A stage that fetches only its own tensors must know their byte ranges before it has the file,
so the headers are parsed from a prefix: each parser returns ``None`` while the prefix is too
short, and the caller fetches more. Nothing here trusts the remote bytes: counts, lengths and
offsets are bounded and checked against the file size, and a bad header raises
:class:`~meshnode_packaging.errors.FetchError` naming the file, not echoing its content.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import gguf

from meshnode_packaging.errors import FetchError
from meshnode_packaging.ranged import ByteRange

# Headers larger than this are garbage or an attack. Real ones: a 262k-token vocabulary (Gemma
# 3) makes a GGUF header of about 6 MB; safetensors caps its JSON header at 100 MB.
MAX_HEADER_BYTES = 128 << 20
# Counts above these are not a model's: they would only make us allocate.
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
_GGUF_MAGIC = b"GGUF"
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorSpan:
    """A tensor of file ``file``: its name in that file and its bytes."""

    file: str
    name: str
    bytes: ByteRange


@dataclass(frozen=True)
class FileLayout:
    """A weight file's header length and its tensors."""

    header: ByteRange
    tensors: tuple[TensorSpan, ...]


class _Short(Exception):
    """The prefix ends before the header does."""


class _Cursor:
    def __init__(self, buf: bytes, file: str) -> None:
        self.buf, self.pos, self.file = buf, 0, file

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise _Short
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> bytes:
        n = self.u64()
        if n > MAX_HEADER_BYTES:
            raise FetchError(f"{self.file}: GGUF string of {n} bytes")
        return self.take(n)

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[kind])
        elif kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            inner, count = self.u32(), self.u64()
            if count > MAX_HEADER_BYTES:
                raise FetchError(f"{self.file}: GGUF array of {count} items")
            if inner in _SCALAR_BYTES:
                self.take(_SCALAR_BYTES[inner] * count)
            else:
                for _ in range(count):
                    self.skip_value(inner)
        else:
            raise FetchError(f"{self.file}: GGUF value of unknown type {kind}")


def gguf_layout(buf: bytes, file: str, size: int) -> FileLayout | None:
    """The layout of GGUF file ``file`` (``size`` bytes) from its prefix ``buf``, or None."""
    c = _Cursor(buf, file)
    try:
        if c.take(4) != _GGUF_MAGIC:
            raise FetchError(f"{file}: not a GGUF file")
        if c.u32() < 2:
            raise FetchError(f"{file}: GGUF version 1 is not supported")
        n_tensors, n_kv = c.u64(), c.u64()
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise FetchError(f"{file}: implausible GGUF counts")
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key, kind = c.string(), c.u32()
            if key == b"general.alignment" and kind == _UINT32:
                alignment = c.u32()
            else:
                c.skip_value(kind)
        infos = [_tensor_info(c) for _ in range(n_tensors)]
    except _Short:
        return None
    if alignment <= 0 or alignment & (alignment - 1):
        raise FetchError(f"{file}: GGUF alignment {alignment} is not a power of two")
    data = c.pos + (-c.pos % alignment)
    spans = tuple(_gguf_span(file, data, size, *info) for info in infos)
    return FileLayout(ByteRange(0, data), spans)


def _tensor_info(c: _Cursor) -> tuple[str, int, int, int]:
    name = c.string().decode("utf-8", "replace")
    n_dims = c.u32()
    if n_dims > 8:
        raise FetchError(f"{c.file}: tensor with {n_dims} dimensions")
    dims = [c.u64() for _ in range(n_dims)]
    kind, offset = c.u32(), c.u64()
    return name, math.prod(dims), kind, offset


def _gguf_span(
    file: str, data: int, size: int, name: str, n: int, kind: int, offset: int
) -> TensorSpan:
    try:
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except ValueError:
        raise FetchError(f"{file}: tensor {name!r} has unknown GGML type {kind}") from None
    start = data + offset
    end = start + n // block * type_bytes
    if n % block or end > size:
        raise FetchError(f"{file}: tensor {name!r} lies outside the file")
    return TensorSpan(file, name, ByteRange(start, end))


def safetensors_layout(buf: bytes, file: str, size: int) -> FileLayout | None:
    """The layout of safetensors file ``file`` from its prefix ``buf``, or None."""
    if len(buf) < 8:
        return None
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise FetchError(f"{file}: safetensors header of {n} bytes")
    if len(buf) < 8 + n:
        return None
    try:
        header = json.loads(buf[8 : 8 + n])
    except (UnicodeDecodeError, ValueError):
        raise FetchError(f"{file}: safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise FetchError(f"{file}: safetensors header is not a JSON object")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (8 + n + int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise FetchError(f"{file}: safetensors entry without data_offsets") from None
        if not 8 + n <= begin <= end <= size:
            raise FetchError(f"{file}: a tensor lies outside the file")
        spans.append(TensorSpan(file, str(name), ByteRange(begin, end)))
    return FileLayout(ByteRange(0, 8 + n), tuple(spans))
