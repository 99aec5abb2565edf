"""What every model source hands out: :class:`RawTensor`, the :class:`ModelSource`
protocol, and :class:`SourceError` for any problem with the input.

The bottom of the sources: the readers (:mod:`.gguf_source`, :mod:`.hf_source`), the
decoders (:mod:`.quants`) and :mod:`.sources`, which opens one, all build on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["ModelSource", "RawTensor", "SourceError"]


class SourceError(Exception):
    """The model input cannot be read: missing, malformed or unsupported."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored: raw bytes plus what is needed to decode them.

    ``shape`` is the logical numpy-order shape (weights are ``[out_features,
    in_features]``); ``data`` is a 1-D ``uint8`` array (GGML quant blocks as stored, or
    little-endian F32/F16/BF16 values), possibly a read-only memory map.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


class ModelSource(Protocol):
    """Anything that yields a model's config, tokenizer, chat template and tensors."""

    config: dict[str, Any]
    chat_template: str | None

    @property
    def tokenizer_json(self) -> str | None:
        """The ``tokenizer.json`` document; None when the model has none (token ids only)."""
        ...

    def tensor_names(self) -> list[str]:
        """Canonical names of every tensor in the source."""
        ...

    def tensor(self, name: str) -> RawTensor:
        """The tensor with canonical ``name``; raises ``KeyError`` if absent."""
        ...
