"""Mixture-of-experts names and metadata, for :mod:`meshnode_packaging.sources`.

The canonical names of a MoE layer's tensors (``meshnode.engine.moe_weights`` documents
them) are Qwen3-MoE's checkpoint names: router ``mlp.gate``, experts
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert`` and its
``mlp.shared_expert_gate``. Here:

- :data:`HF_MOE_RENAMES`: the other checkpoints' names for the same roles (Mixtral's
  ``block_sparse_moe`` with ``w1``/``w3``/``w2``, gpt-oss's ``mlp.router``);
- :data:`GGUF_MOE_NAMES`: llama.cpp's (``ffn_gate_inp``, the 3-D ``ffn_*_exps`` stacking
  every expert, ``ffn_*_shexp``, ``ffn_gate_inp_shexp``, ``exp_probs_b``, ``attn_sinks``),
  and :func:`gguf_expert_name` its older one tensor per expert (the first Mixtral GGUFs'
  ``blk.N.ffn_{gate,up,down}.E.weight``, which llama.cpp still reads);
- :func:`gguf_moe_config`: the ``config.json`` keys of a GGUF's ``{arch}.expert_count``,
  ``expert_used_count``, ``expert_feed_forward_length``... and gpt-oss's attention.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "GGUF_MOE_NAMES",
    "GPT_OSS_NAMES",
    "HF_MOE_RENAMES",
    "gguf_expert_name",
    "gguf_moe_config",
    "gguf_yarn_scaling",
    "hf_moe_name",
]

# (pattern, replacement) over a checkpoint's name, prefix already stripped.
HF_MOE_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
    (re.compile(r"\.mlp\.router\."), ".mlp.gate."),
)


def hf_moe_name(name: str) -> str:
    """``name`` with a MoE role's checkpoint spelling replaced by the canonical one."""
    if "block_sparse_moe" in name or ".mlp.router." in name:
        for pattern, canonical in HF_MOE_RENAMES:
            name = pattern.sub(canonical, name)
    return name


# GGUF (llama.cpp, gguf-py's tensor_mapping.py) -> canonical, per layer.
GGUF_MOE_NAMES: dict[str, str] = {
    "blk.{i}.ffn_gate_inp.weight": "layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_inp.bias": "layers.{i}.mlp.gate.bias",
    "blk.{i}.exp_probs_b.bias": "layers.{i}.mlp.gate.e_score_correction_bias",
    "blk.{i}.ffn_gate_exps.weight": "layers.{i}.mlp.experts.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "layers.{i}.mlp.experts.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "layers.{i}.mlp.experts.down_proj.weight",
    "blk.{i}.ffn_gate_up_exps.weight": "layers.{i}.mlp.experts.gate_up_proj.weight",
    "blk.{i}.ffn_gate_exps.bias": "layers.{i}.mlp.experts.gate_proj.bias",
    "blk.{i}.ffn_up_exps.bias": "layers.{i}.mlp.experts.up_proj.bias",
    "blk.{i}.ffn_down_exps.bias": "layers.{i}.mlp.experts.down_proj.bias",
    "blk.{i}.ffn_gate_up_exps.bias": "layers.{i}.mlp.experts.gate_up_proj.bias",
    "blk.{i}.ffn_gate_shexp.weight": "layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "layers.{i}.mlp.shared_expert.down_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "layers.{i}.mlp.shared_expert_gate.weight",
    "blk.{i}.attn_sinks.weight": "layers.{i}.self_attn.sinks",
    "blk.{i}.attn_output.bias": "layers.{i}.self_attn.o_proj.bias",
}
# llama.cpp's first MoE GGUFs (Mixtral, before the 3-D tensors): one 2-D tensor per expert
_GGUF_PER_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")


def gguf_expert_name(rest: str, layer: str) -> str | None:
    """The canonical name of layer ``layer``'s GGUF tensor ``blk.{layer}.{rest}`` where
    ``rest`` is one expert's matrix in the per-expert naming (``ffn_gate.3.weight``:
    ``layers.{layer}.mlp.experts.3.gate_proj.weight``); None for any other name."""
    match = _GGUF_PER_EXPERT.fullmatch(rest)
    if match is None:
        return None
    role, expert = match.groups()
    return f"layers.{layer}.mlp.experts.{int(expert)}.{role}_proj.weight"


# gpt-oss's converter calls the norm before the MLP "post_attention_norm" (ATTN_POST_NORM).
GPT_OSS_NAMES = {
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attention_layernorm.weight",
}

# llama.cpp's gpt-oss constants (llama-model.cpp, LLM_ARCH_OPENAI_MOE): every other layer
# slides, starting with the first; the experts' clamped SwiGLU.
GPT_OSS_SWA_PATTERN = 2
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def gguf_moe_config(meta: Callable[..., Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The MoE (and gpt-oss attention) keys of a GGUF of architecture ``arch`` whose
    other keys are ``config``; empty for a model without experts."""
    experts = int(meta("expert_count", 0) or 0)
    if not experts:
        return {}
    out: dict[str, Any] = {
        "num_local_experts": experts,
        "num_experts_per_tok": int(meta("expert_used_count")),
        "moe_intermediate_size": int(
            meta("expert_feed_forward_length", config["intermediate_size"])
        ),
    }
    if arch != "gpt-oss":  # llama.cpp renormalises the chosen weights (build_moe_ffn's norm_w)
        out["norm_topk_prob"] = bool(meta("expert_weights_norm", True))
    if arch == "llama":  # Mixtral is a Llama GGUF with experts
        out.update(model_type="mixtral", architectures=["MixtralForCausalLM"])
    if arch == "gpt-oss":
        layers = int(config["num_hidden_layers"])
        out.update(GPT_OSS_SWIGLU)
        if config.get("rope_scaling"):  # gpt-oss's YaRN ramp is not rounded (truncate false)
            out["rope_scaling"] = {**config["rope_scaling"], "truncate": False}
        out["intermediate_size"] = out["moe_intermediate_size"]
        out["sliding_window"] = int(meta("attention.sliding_window"))
        out["layer_types"] = [
            "full_attention" if (i + 1) % GPT_OSS_SWA_PATTERN == 0 else "sliding_attention"
            for i in range(layers)
        ]
    return out


def gguf_yarn_scaling(meta: Callable[..., Any]) -> dict[str, Any]:
    """``rope_scaling`` of a GGUF whose ``rope.scaling.type`` is ``yarn`` (llama.cpp's
    ``rope.scaling.*`` keys; its defaults: beta_fast 32, beta_slow 1)."""
    return {
        "rope_type": "yarn",
        "factor": float(meta("rope.scaling.factor", 1.0)),
        "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
        "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0)),
    }
