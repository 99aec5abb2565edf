"""Canonical tensor names: the one remap table from GGUF and Hugging Face names.

Canonical names are Hugging Face Llama names without the ``model.`` prefix; every
consumer (the engine, the package writer) sees these, whichever file the weights came
from.
"""

from __future__ import annotations

from meshnode_packaging import sources_moe as moe
from meshnode_packaging.gguf_qwen35 import QWEN35_NAMES

__all__ = [
    "GGUF_ARCH_NAMES",
    "GGUF_TO_CANONICAL",
    "HF_PREFIX",
    "ROPE_FREQS",
    "gguf_to_canonical",
    "hf_to_canonical",
]

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
GGUF_ARCH_NAMES: dict[str, dict[str, str]] = {
    "gemma3": _GEMMA_NORMS,
    "gpt-oss": moe.GPT_OSS_NAMES,
    "qwen35": QWEN35_NAMES,  # the dense one: Gated DeltaNet tensors, a SwiGLU MLP
    "qwen35moe": QWEN35_NAMES,  # Gated DeltaNet tensors, "post_attention_norm" before the MLP
}
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
        if canonical is None:  # an expert's own tensor in the older MoE naming, or none
            return moe.gguf_expert_name(rest, layer)
        return canonical.replace("{i}", layer)
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
