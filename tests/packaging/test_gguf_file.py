"""meshnode's GGUF reader agrees with ``gguf.GGUFReader`` (the reference implementation)
on every metadata value and every tensor's bytes, and refuses damaged headers with one
line instead of reading past the file or allocating what a header claims."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from meshnode_packaging.errors import FetchError
from meshnode_packaging.gguf_file import GGUFFile, GGUFFormatError
from meshnode_packaging.remote_headers import gguf_layout
from meshnode_packaging.sources import GGUFSource, SourceError

from tests.conftest import smollm2_gguf_path


def _reference_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    # GGUFReader adds the header (GGUF.version, GGUF.tensor_count, ...) as pseudo-fields.
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_fields_and_tensors_equal_the_reference_reader(which: str, tiny_gguf: Path) -> None:
    path = tiny_gguf if which == "tiny" else smollm2_gguf_path()
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = _reference_fields(theirs)
    assert set(ours.fields) == set(expected)
    for key, value in expected.items():
        if isinstance(value, float):  # the reference widens float32 scalars to float
            assert np.float32(ours.fields[key]) == np.float32(value), key
        else:
            assert ours.fields[key] == value, key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.name == ref.name
        assert mine.shape == tuple(ref.shape.tolist())
        assert mine.tensor_type == ref.tensor_type
        assert mine.data.tobytes() == ref.data.view(np.uint8).tobytes(), mine.name


def _header(*, n_tensors: int = 0, n_kv: int = 1, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _strings(elements: bytes) -> bytes:
    """A header whose one key holds an array of two strings, ``elements`` their bytes."""
    return _header() + _string(b"k") + struct.pack("<IIQ", 9, 8, 2) + elements


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("magic", b"GGML" + bytes(20), "no GGUF magic"),
        ("version", _header(version=9), "GGUF version 9"),
        ("counts", _header(n_tensors=1 << 40), "tensors and"),
        ("truncated", _header() + _string(b"general.name")[:6], "past the end"),
        ("long string", _header() + struct.pack("<Q", 1 << 60), "a string of"),
        ("short string", _header() + struct.pack("<Q", 9) + b"abc", "past the end"),
        ("bad type", _header() + _string(b"k") + struct.pack("<I", 77), "unknown metadata type"),
        (
            "huge array",
            _header() + _string(b"k") + struct.pack("<IIQ", 9, 4, 1 << 50),
            "an array of",
        ),
        ("not utf-8", _header() + _string(b"k") + struct.pack("<I", 8) + _string(b"\xff"), "UTF-8"),
        # arrays of strings (read in one loop): the damaged element is named as alone
        ("array: not utf-8", _strings(_string(b"ok") + _string(b"\xff")), "byte 68 is not UTF-8"),
        ("array: short string", _strings(_string(b"ok") + struct.pack("<Q", 9) + b"abc"), "end"),
        ("array: long string", _strings(_string(b"ok") + struct.pack("<Q", 1 << 60)), "string of"),
        ("array: cut length", _strings(_string(b"ok") + b"\x01\x00"), "file at byte 59"),
        (
            "tensor past the end",
            _header(n_tensors=1, n_kv=0)
            + _string(b"w")
            + struct.pack("<IQQIQ", 2, 32, 4, 0, 0),  # 2 dims 32x4 F32 at offset 0
            "runs past the end",
        ),
    ],
)
def test_damaged_headers_are_refused_in_one_line(
    tmp_path: Path, name: str, content: bytes, reason: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=reason):
        GGUFFile(path)
    with pytest.raises(SourceError, match="not a readable GGUF file"):
        GGUFSource(path)


def test_gemma_vocabulary_reads_whole(gemma3_gguf: Path) -> None:
    """Gemma 3's 262k-token vocabulary: every token string comes back, in order."""
    f = GGUFFile(gemma3_gguf)
    tokens = f.get("tokenizer.ggml.tokens")
    assert isinstance(tokens, list)
    assert len(tokens) == len(f.get("tokenizer.ggml.scores")) == 262144
    assert tokens[2] == "<bos>"


def test_a_fetched_prefix_gives_the_same_ranges_or_asks_for_more(tiny_gguf: Path) -> None:
    """The fetcher's prefix parser is the same reader: every prefix shorter than the header
    asks for more (None), and a long enough one gives each tensor's bytes as the file has them."""
    whole = tiny_gguf.read_bytes()
    tensors = GGUFFile(tiny_gguf).tensors
    layout = gguf_layout(whole, "tiny.gguf", len(whole))
    assert layout is not None
    header_end = layout.header.end
    # (the last 32 bytes may be padding, which the reader does not need)
    for n in sorted({0, 3, 4, 24, header_end // 2, header_end - 32}):
        assert gguf_layout(whole[:n], "tiny.gguf", len(whole)) is None, n
    assert gguf_layout(whole[:header_end], "tiny.gguf", len(whole)) == layout
    assert [s.name for s in layout.tensors] == [t.name for t in tensors]
    for span, tensor in zip(layout.tensors, tensors, strict=True):
        assert whole[span.bytes.start : span.bytes.end] == tensor.data.tobytes()


def test_a_damaged_prefix_is_a_fetch_error_that_does_not_echo_it() -> None:
    bad = _header() + _string(b"general.alignment") + struct.pack("<I", 8) + _string(b"x" * 5000)
    with pytest.raises(FetchError, match="not a power of two") as caught:
        gguf_layout(bad, "model.gguf", 1 << 20)
    assert "xxxx" not in str(caught.value)
    with pytest.raises(FetchError, match="version 9"):
        gguf_layout(_header(version=9), "model.gguf", 1 << 20)
