"""The tiny mixture-of-experts references (``tests/golden/moe``) and their GGUF twins.

The references are Hugging Face folders made by transformers 5.24 (float32, random
weights); ``golden.json`` holds each prompt's greedy continuation. :func:`write_gguf_twin`
writes the same float32 weights as llama.cpp's converter names and lays them out (3-D
``ffn_*_exps`` stacks, ``ffn_gate_inp``, gpt-oss's de-interleaved gate/up, sinks and
``post_attention_norm``, Mixtral as a ``llama`` GGUF with Q/K rows permuted, Qwen3.5-MoE
as ``qwen35moe``: :mod:`tests.engine.moe_qwen35`), with the metadata keys llama.cpp
writes, so that a correct GGUF reader gives the folder's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.conftest import GOLDEN_DIR
from tests.engine.moe_qwen35 import qwen35_layer, qwen35_metadata, qwen35_mtp
from tests.engine.tiny import MERGES, SPECIALS, llama_permute, vocabulary

MOE_DIR = GOLDEN_DIR / "moe"
MODELS = ("qwen3-moe-tiny", "mixtral-tiny", "gpt-oss-tiny", "qwen35-moe-tiny")
# model_type -> GGUF architecture
GGUF_ARCH = {
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "gpt_oss": "gpt-oss",
    "qwen3_5_moe_text": "qwen35moe",
}

# the dense references write_gguf_twin also takes (tests/golden/tiny): model_type -> arch
DENSE_ARCH = {"qwen3_5_text": "qwen35"}
QWEN35 = ("qwen35", "qwen35moe")  # llama.cpp's Qwen3.5 architectures


def golden(model: str) -> dict[str, Any]:
    """The reference's ``golden.json``."""
    data: dict[str, Any] = json.loads((MOE_DIR / model / "golden.json").read_text())
    return data


def _config(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return data


def write_gguf_twin(model: str, path: Path, *, per_expert: bool = False, mtp: bool = False) -> Path:
    """The reference ``model``'s weights (one of :data:`MODELS`, or a dense reference of
    ``tests/golden/tiny`` in :data:`DENSE_ARCH`) as a float32 GGUF at ``path``; returns it. The
    experts as 3-D tensors (``ffn_*_exps``), or with ``per_expert`` one tensor each, as
    llama.cpp's first Mixtral GGUFs name them (``ffn_gate.E.weight``); with ``mtp`` the
    folder's MTP module (``mtp.safetensors``) as one more block (Qwen3.5)."""
    folder = MOE_DIR / model if model in MODELS else GOLDEN_DIR / "tiny" / model
    c = _config(folder)
    arch = {**GGUF_ARCH, **DENSE_ARCH}[c["model_type"]]
    t = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(path, arch)
    _metadata(w, arch, c, 1 if mtp else 0)
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    shift = np.float32(1.0 if arch in QWEN35 else 0.0)  # its converter adds one
    w.add_tensor("output_norm.weight", t["model.norm.weight"] + shift)
    for i in range(c["num_hidden_layers"]):
        if arch == "qwen35":  # the dense hybrid
            layer = qwen35_layer(t, c, i)
        elif arch == "qwen35moe":  # the hybrid's token mixers, experts as Qwen3-MoE's
            layer = qwen35_layer(t, c, i) | _experts(t, f"model.layers.{i}.", c, "mlp", False)
        else:
            layer = _layer(t, c, arch, i, per_expert)
        for name, data in layer.items():
            w.add_tensor(f"blk.{i}.{name}", np.ascontiguousarray(data, dtype=np.float32))
    if mtp:
        module = qwen35_mtp(load_file(str(folder / "mtp.safetensors")), c)
        for name, data in module.items():
            blk = f"blk.{c['num_hidden_layers']}.{name}"
            w.add_tensor(blk, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _layer(
    t: dict[str, np.ndarray], c: dict[str, Any], arch: str, i: int, per_expert: bool = False
) -> dict[str, Any]:
    p = f"model.layers.{i}."
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    q, k = t[p + "self_attn.q_proj.weight"], t[p + "self_attn.k_proj.weight"]
    if arch == "llama":  # llama.cpp's converter permutes Llama's Q/K rows
        q, k = llama_permute(q, heads), llama_permute(k, kv_heads)
    ffn_norm = "post_attention_norm" if arch == "gpt-oss" else "ffn_norm"
    out: dict[str, Any] = {
        "attn_norm.weight": t[p + "input_layernorm.weight"],
        f"{ffn_norm}.weight": t[p + "post_attention_layernorm.weight"],
        "attn_q.weight": q,
        "attn_k.weight": k,
        "attn_v.weight": t[p + "self_attn.v_proj.weight"],
        "attn_output.weight": t[p + "self_attn.o_proj.weight"],
    }
    if arch == "qwen3moe":
        out["attn_q_norm.weight"] = t[p + "self_attn.q_norm.weight"]
        out["attn_k_norm.weight"] = t[p + "self_attn.k_norm.weight"]
    if arch == "gpt-oss":
        for x, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
            out[f"attn_{g}.bias"] = t[p + f"self_attn.{x}_proj.bias"]
        out["attn_sinks.weight"] = t[p + "self_attn.sinks"]
        return out | _gpt_oss_experts(t, p)
    mlp = "block_sparse_moe" if arch == "llama" else "mlp"
    return out | _experts(t, p, c, mlp, per_expert)


def _experts(
    t: dict[str, np.ndarray], p: str, c: dict[str, Any], mlp: str, per_expert: bool
) -> dict[str, Any]:
    n = c.get("num_experts") or c["num_local_experts"]
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    if mlp == "block_sparse_moe":
        names = {"gate": "w1", "up": "w3", "down": "w2"}
    out = {"ffn_gate_inp.weight": t[f"{p}{mlp}.gate.weight"]}
    for g, h in names.items():
        if per_expert:
            for e in range(n):
                out[f"ffn_{g}.{e}.weight"] = t[f"{p}{mlp}.experts.{e}.{h}.weight"]
            continue
        out[f"ffn_{g}_exps.weight"] = np.stack(  # [n, out, in]: every expert's matrix
            [t[f"{p}{mlp}.experts.{e}.{h}.weight"] for e in range(n)]
        )
    return out


def _gpt_oss_experts(t: dict[str, np.ndarray], p: str) -> dict[str, Any]:
    """convert_hf_to_gguf's GptOssModel: gate and up de-interleaved, ``[n, out, in]``."""
    gate_up, bias = t[p + "mlp.experts.gate_up_proj"], t[p + "mlp.experts.gate_up_proj_bias"]
    return {
        "ffn_gate_inp.weight": t[p + "mlp.router.weight"],
        "ffn_gate_inp.bias": t[p + "mlp.router.bias"],
        "ffn_gate_exps.weight": gate_up[:, :, 0::2].transpose(0, 2, 1),
        "ffn_up_exps.weight": gate_up[:, :, 1::2].transpose(0, 2, 1),
        "ffn_down_exps.weight": t[p + "mlp.experts.down_proj"].transpose(0, 2, 1),
        "ffn_gate_exps.bias": bias[:, 0::2],
        "ffn_up_exps.bias": bias[:, 1::2],
        "ffn_down_exps.bias": t[p + "mlp.experts.down_proj_bias"],
    }


def _metadata(w: gguf.GGUFWriter, arch: str, c: dict[str, Any], mtp: int = 0) -> None:
    experts = c.get("num_experts") or c.get("num_local_experts")
    w.add_block_count(c["num_hidden_layers"] + mtp)  # the converter counts MTP blocks
    if mtp:
        w.add_nextn_predict_layers(mtp)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    if "intermediate_size" in c:  # a MoE config without a dense size writes none
        w.add_feed_forward_length(c["intermediate_size"])
    if experts:
        size = c.get("moe_intermediate_size") or c["intermediate_size"]
        w.add_expert_feed_forward_length(size)
        w.add_expert_count(experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    if arch == "gpt-oss":
        w.add_sliding_window(c["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch in QWEN35:
        qwen35_metadata(w, c)
    tokens = vocabulary()
    tokens += [f"<extra_{i}>" for i in range(c["vocab_size"] - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if tok in SPECIALS else 1 for tok in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
