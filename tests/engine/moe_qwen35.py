"""The Qwen3.5 references' GGUF twins: what ``convert_hf_to_gguf``'s
``Qwen3_5MoeTextModel`` / ``Qwen3_5TextModel`` (``Qwen3NextModel``,
``_LinearAttentionVReorderBase``) writes for a layer's norms, token mixer and shared
expert or dense MLP, and its metadata (the routed experts are written as Qwen3-MoE's, by
:mod:`tests.engine.moe_models`).

Written here independently of the reader (``meshnode_packaging.gguf_qwen35``): every
RMSNorm weight but DeltaNet's plus one, ``ssm_a = -exp(A_log)``, the conv squeezed to
``[C, K]``, and the value heads (more of them than key heads) reordered from grouped by
key head to llama.cpp's tiled order.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

# the converter's default where config.json has no full_attention_interval (Qwen3NextModel)
FULL_ATTENTION_INTERVAL = 4


def _tiled(a: np.ndarray, axis: int, c: dict[str, Any], size: int) -> np.ndarray:
    """The converter's ``_reorder_v_heads``: ``[Hk, r, size]`` -> ``[r, Hk, size]``."""
    hk = c["linear_num_key_heads"]
    r = c["linear_num_value_heads"] // hk
    shape = a.shape
    split = (*shape[:axis], hk, r, size, *shape[axis + 1 :])
    return np.swapaxes(a.reshape(split), axis, axis + 1).reshape(shape)


def _deltanet(t: dict[str, np.ndarray], c: dict[str, Any], p: str) -> dict[str, Any]:
    p += "linear_attn."
    dv = c["linear_value_head_dim"]
    keys = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
    qkv, conv = t[p + "in_proj_qkv.weight"], t[p + "conv1d.weight"][:, 0, :]
    return {
        "attn_qkv.weight": np.concatenate([qkv[:keys], _tiled(qkv[keys:], 0, c, dv)]),
        "attn_gate.weight": _tiled(t[p + "in_proj_z.weight"], 0, c, dv),
        "ssm_beta.weight": _tiled(t[p + "in_proj_b.weight"], 0, c, 1),
        "ssm_alpha.weight": _tiled(t[p + "in_proj_a.weight"], 0, c, 1),
        "ssm_conv1d.weight": np.concatenate([conv[:keys], _tiled(conv[keys:], 0, c, dv)]),
        "ssm_a": _tiled(-np.exp(t[p + "A_log"]), 0, c, 1),
        "ssm_dt.bias": _tiled(t[p + "dt_bias"], 0, c, 1),
        "ssm_norm.weight": t[p + "norm.weight"],  # DeltaNet's own norm: not shifted
        "ssm_out.weight": _tiled(t[p + "out_proj.weight"], 1, c, dv),
    }


def qwen35_layer(t: dict[str, np.ndarray], c: dict[str, Any], i: int) -> dict[str, Any]:
    """Layer ``i``'s tensors but the router and routed experts, GGUF names and layout
    (the dense model's SwiGLU MLP as ``ffn_{gate,up,down}``, the MoE one's shared
    expert as ``ffn_*_shexp``)."""
    p, one = f"model.layers.{i}.", np.float32(1.0)
    out: dict[str, Any] = {
        "attn_norm.weight": t[p + "input_layernorm.weight"] + one,
        "post_attention_norm.weight": t[p + "post_attention_layernorm.weight"] + one,
    }
    if p + "mlp.shared_expert_gate.weight" in t:
        out["ffn_gate_inp_shexp.weight"] = t[p + "mlp.shared_expert_gate.weight"]
    for g in ("gate", "up", "down"):
        if p + "mlp.shared_expert_gate.weight" in t:
            out[f"ffn_{g}_shexp.weight"] = t[f"{p}mlp.shared_expert.{g}_proj.weight"]
        elif f"{p}mlp.{g}_proj.weight" in t:
            out[f"ffn_{g}.weight"] = t[f"{p}mlp.{g}_proj.weight"]
    if c["layer_types"][i] == "linear_attention":
        return out | _deltanet(t, c, p)
    a = p + "self_attn."
    return out | {
        "attn_q.weight": t[a + "q_proj.weight"],  # queries and their gates, per head
        "attn_k.weight": t[a + "k_proj.weight"],
        "attn_v.weight": t[a + "v_proj.weight"],
        "attn_output.weight": t[a + "o_proj.weight"],
        "attn_q_norm.weight": t[a + "q_norm.weight"] + one,
        "attn_k_norm.weight": t[a + "k_norm.weight"] + one,
    }


def qwen35_mtp(t: dict[str, np.ndarray], c: dict[str, Any]) -> dict[str, Any]:
    """The MTP module as ``_QwenMtpMixin`` writes it, at block L (the model's layer
    count): its decoder layer's tensors under a full-attention layer's names, and
    ``fc`` / ``pre_fc_norm_*`` / ``norm`` as ``nextn.eh_proj`` / ``enorm`` / ``hnorm`` /
    ``shared_head_norm``, every norm plus one."""
    last = c["num_hidden_layers"]
    layer = {f"model.layers.{last}.{k[len('mtp.layers.0.') :]}": v for k, v in t.items()}
    full = {**c, "layer_types": [*c["layer_types"], "full_attention"]}
    one = np.float32(1.0)
    return qwen35_layer(layer, full, last) | {
        "nextn.eh_proj.weight": t["mtp.fc.weight"],
        "nextn.enorm.weight": t["mtp.pre_fc_norm_embedding.weight"] + one,
        "nextn.hnorm.weight": t["mtp.pre_fc_norm_hidden.weight"] + one,
        "nextn.shared_head_norm.weight": t["mtp.norm.weight"] + one,
    }


def qwen35_metadata(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    """The keys ``Qwen3NextModel.set_gguf_parameters`` adds to Qwen2-MoE's."""
    types = c["layer_types"]
    want = [(i + 1) % FULL_ATTENTION_INTERVAL == 0 for i in range(len(types))]
    assert want == [x == "full_attention" for x in types], "layers not every 4th full"
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    w.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
    partial = c["rope_parameters"]["partial_rotary_factor"]
    w.add_rope_dimension_count(int(c["head_dim"] * partial))
    if "shared_expert_intermediate_size" in c:  # Qwen3.5-MoE
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
