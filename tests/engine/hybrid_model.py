"""The tiny Qwen3.5 hybrid reference (tests/golden/tiny/qwen35-hybrid-tiny) as a source.

A plain reader of the folder's safetensors files (model and MTP module) under canonical
names, so the engine tests need nothing beyond the reference itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from meshnode_packaging.sources import RawTensor, hf_to_canonical
from safetensors.numpy import load_file

from tests.conftest import GOLDEN_DIR

HYBRID_DIR = GOLDEN_DIR / "tiny" / "qwen35-hybrid-tiny"


class HybridFolder:
    """The reference folder's config and tensors (a ``ModelSource``)."""

    def __init__(self, folder: Path = HYBRID_DIR) -> None:
        self.config: dict[str, Any] = json.loads((folder / "config.json").read_text())
        self.tokenizer_json = ""
        self.chat_template: str | None = None
        self._tensors: dict[str, np.ndarray] = {}
        for file in sorted(folder.glob("*.safetensors")):
            for name, array in load_file(file).items():
                self._tensors[hf_to_canonical(name)] = np.ascontiguousarray(array)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def array(self, name: str) -> np.ndarray:
        """The tensor ``name`` as stored (float32)."""
        return self._tensors[name]

    def tensor(self, name: str) -> RawTensor:
        a = self._tensors[name]
        return RawTensor(name, "F32", a.shape, a.view(np.uint8).reshape(-1))


def hybrid_golden() -> dict[str, Any]:
    """The reference's greedy continuations (golden.json)."""
    data: dict[str, Any] = json.loads((HYBRID_DIR / "golden.json").read_text())
    return data
