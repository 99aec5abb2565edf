"""Where each tensor lies in a GGUF or safetensors file, read from the file's first bytes.

A stage that fetches only its own tensors must know their byte ranges before it has the file,
so the headers are parsed from a prefix: each parser returns ``None`` while the prefix is too
short, and the caller fetches more. Nothing here trusts the remote bytes: counts, lengths and
offsets are bounded and checked against the file size, and a bad header raises
:class:`~meshnode_packaging.errors.FetchError` naming the file, not echoing its content.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from meshnode_packaging.errors import FetchError
from meshnode_packaging.gguf_file import GGUFFormatError, GGUFTruncatedError, read_header
from meshnode_packaging.ranged import ByteRange

# Headers larger than this are garbage or an attack. Real ones: a 262k-token vocabulary (Gemma
# 3) makes a GGUF header of about 6 MB; safetensors caps its JSON header at 100 MB.
MAX_HEADER_BYTES = 128 << 20


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


def gguf_layout(buf: bytes, file: str, size: int) -> FileLayout | None:
    """The layout of GGUF file ``file`` (``size`` bytes) from its prefix ``buf``, or None
    while the prefix ends inside the header. Metadata values are skipped, not decoded."""
    try:
        header = read_header(buf, file, size, keys=())
    except GGUFTruncatedError:
        return None
    except GGUFFormatError as exc:
        raise FetchError(str(exc)) from None
    spans = tuple(TensorSpan(file, t.name, ByteRange(t.start, t.end)) for t in header.tensors)
    return FileLayout(ByteRange(0, header.data_start), spans)


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
