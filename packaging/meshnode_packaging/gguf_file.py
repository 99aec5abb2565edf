"""A GGUF file's header, read from its bytes: metadata as Python values, tensors as byte
ranges; and a GGUF file opened for reading, its tensors as views of the memory-mapped file.

``gguf.GGUFReader`` builds a NumPy view for every element of every metadata array, which
for a 262k-token vocabulary (Gemma 3) takes tens of seconds, on every open. This reader
walks the header once with ``struct`` and decodes arrays in bulk, so opening such a file
costs a fraction of a second; tensor data is never read here, only mapped.

One reader serves a whole local file (:class:`GGUFFile`) and a prefix fetched from a hub
(:func:`~meshnode_packaging.remote_headers.gguf_layout`): when the bytes end before the
header does it raises :class:`GGUFTruncatedError`, which for a prefix means "fetch more".

Nothing in the bytes is trusted: counts, lengths, types and offsets are checked against the
file's size, and a bad header raises :class:`GGUFFormatError` (which the sources turn into
their ``SourceError`` and the fetcher into its ``FetchError``).
Layout (GGUF v2/v3): magic, version, tensor count, metadata count, metadata (key, type,
value), tensor infos (name, dims, type, offset), padding to ``general.alignment``, data.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Container, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = [
    "GGUFFile",
    "GGUFFormatError",
    "GGUFHeader",
    "GGUFTensor",
    "GGUFTensorInfo",
    "GGUFTruncatedError",
    "Paged",
    "forget_pages",
    "populate",
    "read_header",
]

_MAGIC = b"GGUF"
# Linux's MADV_POPULATE_READ (5.14): fault a range's pages into this process's page tables
# now, as reading each one would, without a trap per fault. Python's mmap has no name for
# it (3.11-3.13): the kernel's value, include/uapi/asm-generic/mman-common.h.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_VERSIONS = (2, 3)
# Counts and sizes above these are not a model's: they would only make us allocate.
_MAX_TENSORS = 1 << 20
_MAX_KV = 1 << 20
_MAX_DIMS = 8
_MAX_NAME = 64
_MAX_STRING = 128 << 20
_MAX_ARRAY = 1 << 28
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
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
    """The bytes are not a GGUF header this reader accepts; the message says where and why."""


class GGUFTruncatedError(GGUFFormatError):
    """The bytes end before the header does (for a fetched prefix: fetch more)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the header: ``shape`` in GGUF order (fastest-varying dimension
    first, as ``gguf.ReaderTensor``), its stored type, and where its bytes lie in the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    start: int  # absolute file offset
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class GGUFHeader:
    """What the header says: metadata (key → value; only the keys asked for) and tensors."""

    fields: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_start: int  # where tensor data begins: the header's length with its padding


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in GGUF order, its stored type, and ``data``, its bytes (a view
    of the map)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray[Any, np.dtype[np.uint8]]


def read_header(
    buf: bytes | memoryview, where: str, size: int, keys: Container[str] | None = None
) -> GGUFHeader:
    """The header of GGUF file ``where`` (``size`` bytes), read from its first bytes ``buf``.

    ``keys`` limits which metadata values are decoded (the rest are skipped; None: all).
    Raises :class:`GGUFTruncatedError` when ``buf`` ends inside the header and
    :class:`GGUFFormatError` when the header is damaged or implausible.
    """
    c = _Cursor(memoryview(buf), where)
    if bytes(c.take(4)) != _MAGIC:
        raise c.fail("no GGUF magic")
    version = c.u32()
    if version not in _VERSIONS:
        raise c.fail(f"GGUF version {version}; supported: {_VERSIONS}")
    n_tensors, n_kv = c.u64(), c.u64()
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
        raise c.fail(f"{n_tensors} tensors and {n_kv} metadata keys")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        kind = c.u32()
        if keys is None or key in keys or key == "general.alignment":
            fields[key] = c.value(kind)
        else:
            c.skip(kind)
    entries = [_tensor_entry(c) for _ in range(n_tensors)]
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise c.fail("general.alignment is not a power of two")
    if keys is not None and "general.alignment" not in keys:
        fields.pop("general.alignment", None)
    data_start = -(-c.pos // alignment) * alignment
    tensors = tuple(_tensor_info(c, data_start, size, *entry) for entry in entries)
    return GGUFHeader(fields, tensors, data_start)


class _Cursor:
    """Reads the header from bytes; every read is bounds-checked."""

    def __init__(self, buf: memoryview, where: str) -> None:
        self.buf, self.pos, self.where = buf, 0, where

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.where}: not a readable GGUF file ({what})")

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFTruncatedError(
                f"{self.where}: not a readable GGUF file "
                f"(header runs past the end of the file at byte {self.pos})"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return int(self.unpack("<I"))

    def u64(self) -> int:
        return int(self.unpack("<Q"))

    def raw_string(self) -> memoryview:
        n = self.u64()
        if n > _MAX_STRING:
            raise self.fail(f"a string of {n} bytes")
        return self.take(n)

    def string(self) -> str:
        raw = self.raw_string()
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"a string at byte {self.pos} is not UTF-8") from exc

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row, in one loop over the bytes: a vocabulary's (Gemma
        3's 262k tokens) in a tenth of the time of a :meth:`string` call each. A string
        that is damaged or runs past the end is read again by :meth:`string`, which says
        what is wrong."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        out: list[str] = []
        append, length = out.append, _U64.unpack_from
        for _ in range(count):
            start = pos + 8
            if start > end:
                break
            (n,) = length(buf, pos)
            if n > _MAX_STRING or start + n > end:
                break
            try:
                append(str(buf[start : start + n], "utf-8"))
            except UnicodeDecodeError:
                break
            pos = start + n
        self.pos = pos
        out.extend(self.string() for _ in range(count - len(out)))  # raises, if any
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        value = self.unpack(self.scalar(kind)[0])
        return bool(value) if kind == _BOOL else value

    def array(self) -> list[Any]:
        kind, count = self.array_head()
        if kind == _STRING:
            return self.strings(count)
        if kind == _ARRAY:
            return [self.array() for _ in range(count)]
        dtype = np.dtype(self.scalar(kind)[1])
        values = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
        items: list[Any] = values.tolist()
        return [bool(v) for v in items] if kind == _BOOL else items

    def skip(self, kind: int) -> None:
        """Steps over a value of type ``kind`` without decoding it."""
        if kind == _STRING:
            self.raw_string()
        elif kind == _ARRAY:
            inner, count = self.array_head()
            if inner in _SCALARS:
                self.take(count * np.dtype(_SCALARS[inner][1]).itemsize)
            else:
                for _ in range(count):
                    self.skip(inner)
        else:
            self.take(np.dtype(self.scalar(kind)[1]).itemsize)

    def array_head(self) -> tuple[int, int]:
        kind, count = self.u32(), self.u64()
        if count > _MAX_ARRAY:
            raise self.fail(f"an array of {count} elements")
        if kind not in (_STRING, _ARRAY):
            self.scalar(kind)
        return kind, count

    def scalar(self, kind: int) -> tuple[str, str]:
        if kind not in _SCALARS:
            raise self.fail(f"unknown metadata type {kind}")
        return _SCALARS[kind]


def _tensor_entry(c: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string()
    if len(name) > _MAX_NAME:  # ggml's own limit (GGML_MAX_NAME)
        raise c.fail(f"a tensor name of {len(name)} characters")
    n_dims = c.u32()
    if n_dims > _MAX_DIMS:
        raise c.fail(f"tensor {name!r} has {n_dims} dimensions")
    dims = tuple(c.u64() for _ in range(n_dims))
    return name, dims, c.u32(), c.u64()


def _tensor_info(
    c: _Cursor, data_start: int, size: int, name: str, dims: tuple[int, ...], kind: int, offset: int
) -> GGUFTensorInfo:
    try:
        qtype = gguf.GGMLQuantizationType(kind)
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as exc:
        raise c.fail(f"tensor {name!r} has unknown type {kind}") from exc
    if dims and dims[0] % block:
        raise c.fail(f"tensor {name!r}: rows of {dims[0]} are not whole blocks of {block}")
    nbytes = math.prod(dims) // block * type_bytes
    start = data_start + offset
    if start + nbytes > size:
        raise c.fail(f"tensor {name!r} runs past the end of the file")
    return GGUFTensorInfo(name, dims, qtype, start, nbytes)


class GGUFFile:
    """The metadata (``fields``: key → value) and tensors of one GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GGUFFormatError(f"{path}: not a readable GGUF file ({exc})") from exc
        header = read_header(memoryview(self._map), str(path), len(self._map))
        self.fields = header.fields
        everything = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [
            GGUFTensor(t.name, t.shape, t.tensor_type, everything[t.start : t.end])
            for t in header.tensors
        ]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (a str, number, bool or list), or ``default``."""
        return self.fields.get(key, default)

    def drop(self, keys: Iterable[str]) -> None:
        """Forget the values of metadata ``keys`` (read and no longer needed here)."""
        for key in keys:
            self.fields.pop(key, None)


def forget_pages(view: np.ndarray[Any, Any]) -> None:
    """Unmap the whole pages under ``view``, a view of a file's map whose bytes were just
    copied and are not read again: the copy is what is kept, and the file's pages would
    stay resident beside it (SmolLM2's Q/K rows, put back in order: 7.9 MiB). A later
    read maps them again from the page cache. Nothing happens for any other array.
    """
    mapped = _mapped(view)
    if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    held, start = mapped
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only: the neighbours'
    last = (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE  # bytes stay mapped
    if last > first:
        held.madvise(mmap.MADV_DONTNEED, first, last - first)


def will_need(view: np.ndarray[Any, Any]) -> bool:
    """Start reading the pages under ``view``, a view of a file's map, into memory ahead of
    their use (``MADV_WILLNEED``: the kernel's read-ahead, asynchronous; it returns at
    once). False, doing nothing, for any other array or where the call is missing."""
    mapped = _mapped(view)
    if mapped is None or not hasattr(mmap, "MADV_WILLNEED"):
        return False
    held, start = mapped
    first = start // mmap.PAGESIZE * mmap.PAGESIZE  # madvise wants a page-aligned start
    held.madvise(mmap.MADV_WILLNEED, first, start + view.nbytes - first)
    return True


@dataclass(frozen=True)
class Paged:
    """What :func:`populate` did: ``nbytes`` of whole pages advised, and with which advice
    (``populate``: faulted in; ``willneed``: only read ahead into the page cache, where the
    kernel refused the first; empty: nothing, no file map or no madvise)."""

    nbytes: int
    advice: str


def populate(views: Iterable[np.ndarray[Any, Any]]) -> Paged:
    """Fault the pages under ``views`` (views of files' maps; other arrays are skipped)
    into this process now (``MADV_POPULATE_READ``, synchronous), so that no first use of
    a page costs a fault later. Overlapping and touching views are advised once, a run
    of whole pages at a time. Where the kernel refuses it (before Linux 5.14:
    ``EINVAL``), the rest are only read ahead (``MADV_WILLNEED``); where that fails too,
    or madvise is missing, nothing more happens: the pages then fault in on first use,
    as without this call. Reads the file where its pages are not cached: call it only
    for what fits in memory.
    """
    done, advice = 0, _ADVICES[0]
    for held, start, length in _page_spans(views):
        taken = _advise(held, start, length, advice)
        if not taken:
            break
        done, advice = done + length, taken
    return Paged(done, advice if done else "")


# The advices populate tries, in order, by name; a refused one is not asked again.
_ADVICES = ("populate", "willneed")
_ADVICE_VALUES = {"populate": MADV_POPULATE_READ, "willneed": getattr(mmap, "MADV_WILLNEED", None)}


def _advise(held: mmap.mmap, start: int, length: int, advice: str) -> str:
    """Give pages ``[start, start + length)`` of ``held`` ``advice`` or, refused, the next
    of :data:`_ADVICES`: the name of the one taken (empty: none)."""
    for name in _ADVICES[_ADVICES.index(advice) :]:
        value = _ADVICE_VALUES[name]
        if value is None:
            continue
        try:
            _madvise(held, value, start, length)
        except (OSError, ValueError, AttributeError):  # refused; no madvise (not POSIX)
            continue
        return name
    return ""


def _madvise(held: mmap.mmap, advice: int, start: int, length: int) -> None:
    held.madvise(advice, start, length)  # apart, for the tests to refuse


def _page_spans(views: Iterable[np.ndarray[Any, Any]]) -> list[tuple[mmap.mmap, int, int]]:
    """The maps under ``views`` and the runs of whole pages they cover there, merged where
    they overlap or touch: (map, page-aligned start, length), in order of start."""
    page = mmap.PAGESIZE
    ranges: dict[int, tuple[mmap.mmap, list[tuple[int, int]]]] = {}
    for view in views:
        mapped = _mapped(view) if view.nbytes else None
        if mapped is not None:
            held, start = mapped
            end = min(len(held), -(-(start + view.nbytes) // page) * page)  # the map's end
            ranges.setdefault(id(held), (held, []))[1].append((start // page * page, end))
    spans = []
    for held, pairs in ranges.values():
        pairs.sort()
        lo, hi = pairs[0]
        for start, end in pairs[1:]:
            if start > hi:
                spans.append((held, lo, hi - lo))
                lo = start
            hi = max(hi, end)
        spans.append((held, lo, hi - lo))
    return spans


def _mapped(view: np.ndarray[Any, Any]) -> tuple[mmap.mmap, int] | None:
    """The file map under ``view`` and the offset of its first byte there, or None."""
    base: Any = view
    while isinstance(base, np.ndarray):
        base = base.base
    held = base.obj if isinstance(base, memoryview) else base
    if not isinstance(held, mmap.mmap) or held.closed:
        return None
    return held, view.ctypes.data - np.frombuffer(held, np.uint8).ctypes.data
