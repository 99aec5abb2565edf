"""A GGUF file as a model source: memory-mapped, tensors under canonical names.

GGUF files written by llama.cpp's converter store the Q and K projection rows of ``llama``
models permuted for llama.cpp's interleaved RoPE; they are un-permuted here, on the raw
quant blocks (the permutation moves whole rows, and a row is a whole number of blocks),
so that all sources share the Hugging Face "rotate half" convention.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshnode_packaging.gguf_config import GGUF_ARCHITECTURES, gguf_config
from meshnode_packaging.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor, forget_pages
from meshnode_packaging.gguf_qwen35 import QWEN35_ARCHS, mtp_name, qwen35_tensor
from meshnode_packaging.names import ROPE_FREQS, gguf_to_canonical
from meshnode_packaging.quants import dequantize
from meshnode_packaging.sampling import GGUF_SAMPLING_KEYS, sampling_numbers
from meshnode_packaging.source_types import RawTensor, SourceError
from meshnode_packaging.sources_tokenizer import UnsupportedTokenizerError, gguf_tokenizer_json

__all__ = ["VOCABULARY_ARRAYS", "GGUFSource", "open_gguf", "unpermute_rows"]


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``LlamaModel.permute`` in convert_hf_to_gguf).

    The converter reorders each head's rows from ``[2, D/2]`` (rotate-half halves) to
    ``[D/2, 2]`` (interleaved pairs); this swaps them back. ``rows`` is ``[out, ...]``.
    """
    out = rows.shape[0]
    rest = rows.shape[1:]
    heads = rows.reshape(n_head, out // n_head // 2, 2, *rest)  # [H, D/2, 2, ...]
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(rows.shape)


def open_gguf(path: Path) -> GGUFFile:
    """``path`` parsed as GGUF; raises :class:`SourceError` if it is not one."""
    try:
        return GGUFFile(path)
    except GGUFFormatError as exc:
        raise SourceError(str(exc)) from exc


# GGUF metadata read once, to build ``tokenizer_json``.
VOCABULARY_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
)


def arch_shifts_norm(shift: float, name: str) -> bool:
    """Whether canonical tensor ``name`` is a norm weight the converter shifted by
    ``shift`` (every RMSNorm's, the MTP module's too, but the Gated DeltaNet's own gated
    norm, which Qwen3.5's checkpoint and converter both keep as it is)."""
    norm = name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_")
    return bool(shift) and norm and ".linear_attn." not in name


class GGUFSource:
    """A GGUF file, memory-mapped; tensors are handed out under canonical names."""

    def __init__(self, path: Path) -> None:
        self._reader = open_gguf(path)
        self.path = path
        arch = str(self._reader.get("general.architecture", ""))
        self._tensors: dict[str, GGUFTensor] = {}
        layers = self._model_blocks(arch)
        for t in self._reader.tensors:
            canonical = gguf_to_canonical(t.name, arch)
            if canonical is not None and layers is not None:  # Qwen3.5: its MTP module
                canonical = mtp_name(canonical, layers)
            if canonical is not None:
                self._tensors[canonical] = t
        self.config = gguf_config(self._reader, set(self._tensors))
        freqs = next((t for t in self._reader.tensors if t.name == ROPE_FREQS), None)
        if freqs is not None:
            # llama.cpp stores Llama 3.1-style RoPE scaling as per-pair divisors of the
            # frequency (convert_hf_to_gguf computes them from rope_scaling); HF config
            # has no key for them, so they travel under this one extra key.
            if freqs.tensor_type.name != "F32":
                raise SourceError(f"{path}: {ROPE_FREQS} is {freqs.tensor_type.name}, not F32")
            factors = freqs.data.view("<f4")
            self.config["rope_freq_factors"] = [float(f) for f in factors]
        self.architecture = arch  # general.architecture
        self._arch = GGUF_ARCHITECTURES[arch]
        try:
            self.tokenizer_json = gguf_tokenizer_json(self._reader)
        except UnsupportedTokenizerError as exc:
            raise SourceError(f"{path}: {exc}") from exc
        template = self._reader.get("tokenizer.chat_template")
        self.chat_template: str | None = None if template is None else str(template)
        sampling = {name: self._reader.get(key) for key, name in GGUF_SAMPLING_KEYS.items()}
        self.sampling_defaults = sampling_numbers(sampling)
        # The vocabulary lives on in tokenizer_json; its arrays as Python objects held
        # 8.5 MiB (SmolLM2) to 32 MiB (Gemma 3) for as long as the source is open.
        self._reader.drop(VOCABULARY_ARRAYS)

    def _model_blocks(self, arch: str) -> int | None:
        """A Qwen3.5 file's model blocks, ``block_count`` less its MTP module's (None for
        another architecture)."""
        if arch not in QWEN35_ARCHS:
            return None
        blocks = int(self._reader.get(f"{arch}.block_count", 0))
        return blocks - int(self._reader.get(f"{arch}.nextn_predict_layers", 0))

    def tensor_names(self) -> list[str]:
        """Canonical names of every tensor meshnode uses from this file."""
        return list(self._tensors)

    def tensor(self, name: str) -> RawTensor:
        """The tensor ``name`` as stored, with Q/K rows in Hugging Face order (and norm
        weights in the checkpoint's convention, see :attr:`GGUFArchitecture.norm_shift`)."""
        t = self._tensors[name]
        shape = tuple(reversed(t.shape))
        data = t.data
        n_head = self._permuted_heads(name)
        if n_head is not None:
            data = unpermute_rows(data.reshape(shape[0], -1), n_head)
            forget_pages(t.data)  # the stage holds the copy
        raw = RawTensor(name, t.tensor_type.name, shape, data.view(np.uint8).reshape(-1))
        if arch_shifts_norm(self._arch.norm_shift, name):
            shifted = dequantize(raw) - np.float32(self._arch.norm_shift)
            raw = RawTensor(name, "F32", shape, shifted.astype("<f4").view(np.uint8).reshape(-1))
        if self.architecture in QWEN35_ARCHS:
            raw = qwen35_tensor(raw, self.config)
        return raw

    def _permuted_heads(self, name: str) -> int | None:
        if not self._arch.permuted_qk:
            return None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return int(self.config["num_attention_heads"])
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return int(self.config["num_key_value_heads"])
        return None
