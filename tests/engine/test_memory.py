"""What a CPU stage keeps resident: its weights as the file's bytes, a KV cache only as
far as it is written, the GGUF's vocabulary once (issue #13: a single-node ``join`` in 400
MiB)."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from meshnode_packaging.gguf_file import forget_pages
from meshnode_packaging.sources import VOCABULARY_ARRAYS, GGUFSource, open_source

from meshnode.engine.cpu import BlockMatrix
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.loader import LoadedModel
from meshnode.engine.tokenizer import Tokenizer

SMAPS = Path("/proc/self/smaps")


def _mapping(address: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` entry of the mapping that holds ``address``."""
    found: dict[str, str] | None = None
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "lo-hi perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            if found is not None:
                break
            if lo <= address < hi:
                found = {}
        elif found is not None:
            key, value = line.split(":", 1)
            found[key] = value.strip()
    assert found is not None, f"no mapping holds {address:#x}"
    return found


def _kib(value: str) -> int:
    return int(value.split()[0])


@pytest.mark.skipif(not SMAPS.exists(), reason="reads the process's mappings from /proc")
def test_a_cpu_kv_cache_takes_memory_as_its_positions_are_written() -> None:
    """SmolLM2's cache at 2048 positions is 2 x 45 MiB. Eight positions written in every
    layer touch one 4 KiB page per layer and head: the cache holds ~0.7 MiB, where NumPy's
    huge pages made the whole of it resident (88 MiB in a ``join``)."""
    cache = KVCache(np, 30, 3, 64, 2048)
    kv = np.ones((3, 8, 64), np.float32)  # [Hkv, S, D]
    for layer in range(30):
        cache.write(layer, 0, kv, kv)
    for array in (cache.k, cache.v):
        held = _mapping(array.ctypes.data)
        assert _kib(held["Rss"]) < 4 << 10, held["Rss"]
        assert held["Anonymous"] == held["Rss"]  # the process's own pages, not shmem
        assert _kib(held.get("AnonHugePages", "0 kB")) == 0
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            assert "nh" in held["VmFlags"].split()
    assert float(cache.k[:, :, :8].sum()) == 30 * 3 * 8 * 64
    assert not cache.v[:, :, 8:].any()  # the rest reads as zeros


@pytest.mark.skipif(not SMAPS.exists(), reason="reads the process's mappings from /proc")
def test_a_released_kv_cache_hands_its_pages_back() -> None:
    """A stage keeps released caches for its next sequences: the pages a long sequence
    wrote go back to the system, and the cache reads as empty zeros, ready for reuse."""
    cache = KVCache(np, 30, 3, 64, 2048)
    kv = np.ones((3, 512, 64), np.float32)  # 512 positions: 11 MiB of K, 11 of V
    for layer in range(30):
        cache.write(layer, 0, kv, kv)
    cache.length = 512
    assert _kib(_mapping(cache.k.ctypes.data)["Rss"]) > 8 << 10
    cache.release_pages()
    assert cache.length == 0
    for array in (cache.k, cache.v):
        assert _kib(_mapping(array.ctypes.data)["Rss"]) < 1 << 10
        assert not array.any()
    cache.write(0, 0, kv[:, :1], kv[:, :1])
    assert float(cache.k[0, :, 0].sum()) == 3 * 64


def _file_backed(a: np.ndarray) -> bool:
    """Whether ``a`` is a view of a memory-mapped file (not memory of its own)."""
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer's base: the buffer's export
        base = base.obj
    return isinstance(base, mmap.mmap)


@pytest.mark.real_model
def test_a_block_stage_holds_its_weights_as_the_file_holds_them(smollm2: LoadedModel) -> None:
    """Every matrix of SmolLM2's ``native`` stage stays in its GGUF blocks (no float32
    copy), views of the memory-mapped file except Q and K, whose rows the loader puts back
    in Hugging Face's order (a copy of the same blocks); what the stage holds beside the
    file is under a tenth of its tensors' bytes in it (issue #13: <= 1.1x)."""
    weights = smollm2.stage.weights
    matrices = [w for layer in weights.layers for w in (layer.wqkv, layer.wo)]
    matrices += [w for layer in weights.layers for w in (layer.w_gate_up, layer.w_down)]
    matrices.append(weights.embed_t)
    assert weights.head_t is None  # tied: the head is the embedding
    assert all(isinstance(m, BlockMatrix) for m in matrices)
    in_file = sum(m.nbytes for m in matrices)
    copied = sum(p.raw.nbytes for m in matrices for p in m.parts if not _file_backed(p.raw))
    qk = sum(m.parts[0].raw.nbytes + m.parts[1].raw.nbytes for m in matrices[:60:2])
    assert copied == qk
    small = [layer.attn_norm for layer in weights.layers] + [weights.norm]
    copied += sum(int(a.nbytes) for a in small + [layer.ffn_norm for layer in weights.layers])
    assert copied < in_file / 10


def test_a_gguf_source_holds_its_vocabulary_once(tiny_gguf: Callable[[str], Path]) -> None:
    """Once ``tokenizer_json`` is built the reader forgets the vocabulary's arrays (Gemma
    3's held 32 MiB as Python objects), and the document is ASCII: one byte a character,
    where a single character above U+FFFF made Gemma 3's take four (52 MiB, now 19)."""
    source = open_source(tiny_gguf("Q8_0"))
    assert isinstance(source, GGUFSource)
    assert source.tokenizer_json is not None
    assert "\\u0120" in source.tokenizer_json  # byte-level BPE's "Ġ", escaped
    assert source.tokenizer_json.isascii()
    assert not any(k in source._reader.fields for k in VOCABULARY_ARRAYS)
    assert source._reader.get("tokenizer.ggml.bos_token_id") is not None  # scalars stay
    assert Tokenizer(source.tokenizer_json).encode("hello world")


@pytest.mark.skipif(not SMAPS.exists(), reason="reads the process's mappings from /proc")
def test_the_pages_of_copied_file_bytes_are_unmapped(tmp_path: Path) -> None:
    """Q/K rows are copied out of the map (put back in Hugging Face's order): the file's
    pages under them are unmapped, so the stage holds the copy alone; the bytes read the
    same afterwards, from the page cache."""
    path = tmp_path / "weights"
    path.write_bytes(bytes(range(256)) * (16 << 12))  # 16 MiB
    with path.open("rb") as f:
        held = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    everything = np.frombuffer(held, np.uint8)
    view = everything[1000 : (12 << 20) + 1000]  # 12 MiB, not page-aligned
    first = int(view.sum(dtype=np.int64))
    touched = _kib(_mapping(view.ctypes.data)["Rss"])
    assert touched >= 12 << 10
    forget_pages(view)
    # What stays: at most the large folios (up to 2 MiB) the kernel mapped at the edges.
    assert _kib(_mapping(view.ctypes.data)["Rss"]) <= touched - (8 << 10)
    assert int(view.sum(dtype=np.int64)) == first
    forget_pages(np.zeros(10, np.uint8))  # not a map: nothing happens
