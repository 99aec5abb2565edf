"""A GGUF file's metadata as a Hugging Face ``config.json``: one :class:`GGUFArchitecture`
row per supported ``general.architecture`` and the key mapping (:func:`gguf_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshnode_packaging import sources_moe as moe
from meshnode_packaging.gguf_file import GGUFFile
from meshnode_packaging.gguf_qwen35 import QWEN35_ARCHS, qwen35_config
from meshnode_packaging.source_types import SourceError

__all__ = [
    "GEMMA3_27B_LAYERS",
    "GEMMA3_LOCAL_ROPE_BASE",
    "GEMMA3_SWA_PATTERN",
    "GGUF_ARCHITECTURES",
    "GGUFArchitecture",
    "gguf_config",
    "tensor_config",
]


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
    # the converter adds one to Qwen3.5's RMSNorm weights but DeltaNet's (gguf_source)
    "qwen35": GGUFArchitecture("qwen3_5_text", "Qwen3_5ForCausalLM", norm_shift=1.0),
    "qwen35moe": GGUFArchitecture("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", norm_shift=1.0),
    "gemma3": GGUFArchitecture(
        "gemma3_text", "Gemma3ForCausalLM", norm_shift=1.0, hidden_act="gelu_pytorch_tanh"
    ),
}


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.get(key, default)


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
    if arch in QWEN35_ARCHS:
        config.update(qwen35_config(meta, config))
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
