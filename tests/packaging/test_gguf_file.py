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
from meshnode_packaging.gguf_file import GGUFFile, GGUFFormatError
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


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("magic", b"GGML" + bytes(20), "no GGUF magic"),
        ("version", _header(version=9), "GGUF version 9"),
        ("counts", _header(n_tensors=1 << 40), "tensors and"),
        ("truncated", _header() + _string(b"general.name")[:6], "past the end"),
        ("long string", _header() + struct.pack("<Q", 1 << 60), "past the end"),
        ("bad type", _header() + _string(b"k") + struct.pack("<I", 77), "unknown metadata type"),
        (
            "huge array",
            _header() + _string(b"k") + struct.pack("<IIQ", 9, 4, 1 << 50),
            "an array of",
        ),
        ("not utf-8", _header() + _string(b"k") + struct.pack("<I", 8) + _string(b"\xff"), "UTF-8"),
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
