"""A Hugging Face checkpoint folder as a model source: ``config.json``, ``tokenizer.json``,
the chat template and memory-mapped ``*.safetensors`` tensors under canonical names
(gpt-oss's MXFP4 experts repacked as GGUF's, :mod:`.hf_mxfp4`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshnode_packaging.hf_mxfp4 import derive, mxfp4_plan
from meshnode_packaging.names import hf_to_canonical
from meshnode_packaging.sampling import sampling_numbers
from meshnode_packaging.source_types import RawTensor, SourceError

__all__ = ["HFFolderSource"]


# U8: MXFP4 blocks and scales (gpt-oss), which the reader hands out repacked
_SAFETENSORS_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "U8": "U8"}


@dataclass(frozen=True)
class _SafetensorsEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _safetensors_index(file: Path) -> dict[str, _SafetensorsEntry]:
    """Parse a safetensors header: ``u64 length | JSON | data`` (offsets relative to data)."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise SourceError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries[name] = _SafetensorsEntry(
            file, info["dtype"], tuple(info["shape"]), base + begin, base + end
        )
    return entries


class HFFolderSource:
    """A Hugging Face checkpoint folder: config.json, tokenizer.json, *.safetensors."""

    def __init__(self, folder: Path) -> None:
        self.path = folder
        self.config = _read_json(folder / "config.json")
        tokenizer = folder / "tokenizer.json"
        # A checkpoint without tokenizer.json (a test model, a research export) still runs
        # on token ids; whoever needs text refuses it then.
        self.tokenizer_json: str | None = None
        if tokenizer.is_file():
            self.tokenizer_json = tokenizer.read_text(encoding="utf-8")
        self.chat_template = _hf_chat_template(folder)
        generation = folder / "generation_config.json"
        self.sampling_defaults = (
            sampling_numbers(_read_json(generation)) if generation.is_file() else {}
        )
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SourceError(f"{folder}: no *.safetensors weights")
        self._entries: dict[str, _SafetensorsEntry] = {}
        for file in files:
            for name, entry in _safetensors_index(file).items():
                self._entries[hf_to_canonical(name)] = entry
        self._maps: dict[Path, np.memmap[Any, np.dtype[np.uint8]]] = {}
        self._derived = mxfp4_plan(self._entries)
        stored = {s for d in self._derived.values() for s in d.stored}
        self._names = [n for n in self._entries if n not in stored] + list(self._derived)

    def tensor_names(self) -> list[str]:
        """Canonical names of every tensor in the checkpoint (MXFP4 experts as GGUF's)."""
        return list(self._names)

    def tensor(self, name: str) -> RawTensor:
        """The tensor ``name``: a read-only view into the memory-mapped file, or a
        repacked copy of MXFP4 experts (made anew at each call: the caller keeps it)."""
        if name in self._derived:
            return derive(name, self._derived[name], self._stored)
        return self._stored(name)

    def _stored(self, name: str) -> RawTensor:
        e = self._entries[name]
        if e.file not in self._maps:
            self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        return RawTensor(name, e.dtype, e.shape, self._maps[e.file][e.begin : e.end])


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SourceError(f"{path} not found") from None
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise SourceError(f"{path}: expected a JSON object")
    return data


def _hf_chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    template = _read_json(config_path).get("chat_template")
    if isinstance(template, list):
        # Named templates (transformers' multi-template form): use the "default" one.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
