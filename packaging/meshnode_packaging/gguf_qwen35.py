"""Qwen3.5's hybrid (Gated DeltaNet + gated attention) GGUFs, as llama.cpp writes them.

llama.cpp's architectures ``qwen35`` (dense) and ``qwen35moe`` (routed experts plus a
sigmoid-gated shared expert), written by ``convert_hf_to_gguf``'s ``Qwen3_5TextModel`` /
``Qwen3_5MoeTextModel`` (``Qwen3NextModel`` underneath). Here:

- :data:`QWEN35_NAMES`: the DeltaNet layer's tensors (``attn_qkv`` = ``in_proj_qkv``,
  ``attn_gate`` = ``in_proj_z``, ``ssm_beta``/``ssm_alpha`` = ``in_proj_b``/``in_proj_a``,
  ``ssm_conv1d``, ``ssm_a``, ``ssm_dt.bias``, ``ssm_norm``, ``ssm_out``) and the norm before
  the MLP, ``post_attention_norm``; the attention and expert names are the common ones;
- :func:`qwen35_config`: the ``config.json`` keys of its metadata (``ssm.*``,
  ``full_attention_interval``, ``rope.dimension_count``, the shared expert's size);
- the MTP module (:func:`mtp_name`): the converter (``_QwenMtpMixin``) writes it as
  ``nextn_predict_layers`` more blocks after the model's (``block_count`` counts them):
  the decoder layer's tensors under their usual names at block ``L``, and ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``/``_hidden`` and ``mtp.norm`` as
  ``nextn.eh_proj``/``enorm``/``hnorm``/``shared_head_norm`` (norms plus one, as every
  other); they go back to the checkpoint's ``mtp.*`` names, and the layer count to L;
- :func:`qwen35_tensor`: a tensor back in the checkpoint's layout. The converter stores
  ``ssm_a`` as ``-exp(A_log)`` (canonical name ``linear_attn.A``, which the engine takes
  as it is: a logarithm would not give the bits back), squeezes the conv to ``[C, K]``,
  adds one to every RMSNorm weight but DeltaNet's own (taken off again by the source, as
  for Gemma), and, where there are more value heads than key heads, stores the value heads
  "tiled" (``[k0v0, k1v0, ..., k0v1, k1v1, ...]``) rather than grouped by key head as the
  checkpoint does (``_LinearAttentionVReorderBase``): undone here, exactly (a permutation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from meshnode_packaging.quants import dequantize
from meshnode_packaging.source_types import RawTensor

__all__ = ["QWEN35_ARCHS", "QWEN35_NAMES", "mtp_name", "qwen35_config", "qwen35_tensor"]

QWEN35_ARCHS = frozenset({"qwen35", "qwen35moe"})
# llama.cpp's default when the GGUF has no full_attention_interval (Qwen3NextModel)
DEFAULT_FULL_ATTENTION_INTERVAL = 4

_L = "layers.{i}.linear_attn."
QWEN35_NAMES: dict[str, str] = {
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_qkv.weight": _L + "in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": _L + "in_proj_z.weight",
    "blk.{i}.ssm_beta.weight": _L + "in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": _L + "in_proj_a.weight",
    "blk.{i}.ssm_conv1d.weight": _L + "conv1d.weight",
    "blk.{i}.ssm_a": _L + "A",  # -exp(A_log)
    "blk.{i}.ssm_dt.bias": _L + "dt_bias",
    "blk.{i}.ssm_norm.weight": _L + "norm.weight",
    "blk.{i}.ssm_out.weight": _L + "out_proj.weight",
    # the MTP module's own tensors, at its first block (mtp_name moves them to mtp.*)
    "blk.{i}.nextn.eh_proj.weight": "layers.{i}.mtp.fc.weight",
    "blk.{i}.nextn.enorm.weight": "layers.{i}.mtp.pre_fc_norm_embedding.weight",
    "blk.{i}.nextn.hnorm.weight": "layers.{i}.mtp.pre_fc_norm_hidden.weight",
    "blk.{i}.nextn.shared_head_norm.weight": "layers.{i}.mtp.norm.weight",
}


def mtp_name(canonical: str, layers: int) -> str:
    """``canonical`` (a tensor of a block of the file) under the checkpoint's name: a
    block from ``layers`` on (the MTP module's, ``nextn_predict_layers`` of them) as
    ``mtp.layers.{j}.*``, or the module's own ``mtp.*``; any other as it is."""
    if not canonical.startswith("layers."):
        return canonical
    _, block, rest = canonical.split(".", 2)
    if int(block) < layers:
        return canonical
    return rest if rest.startswith("mtp.") else f"mtp.layers.{int(block) - layers}.{rest}"


def qwen35_config(meta: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """The hybrid's ``config.json`` keys from a ``qwen35``/``qwen35moe`` GGUF's metadata
    (``meta(key)`` reads ``{arch}.key``) whose common keys are ``config`` (its
    ``num_hidden_layers``, ``block_count``, less the MTP module's blocks)."""
    mtp = int(meta("nextn_predict_layers", 0))
    layers = int(config["num_hidden_layers"]) - mtp
    interval = int(meta("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
    value_heads = int(meta("ssm.time_step_rank"))
    head_dim = int(config["head_dim"])
    out: dict[str, Any] = {
        "num_hidden_layers": layers,
        # llama.cpp: layer i is recurrent unless (i + 1) % interval == 0
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        "linear_conv_kernel_dim": int(meta("ssm.conv_kernel")),
        "linear_key_head_dim": int(meta("ssm.state_size")),
        "linear_num_key_heads": int(meta("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(meta("ssm.inner_size")) // value_heads,
        "partial_rotary_factor": int(meta("rope.dimension_count", head_dim)) / head_dim,
    }
    if mtp:
        out["mtp_num_hidden_layers"] = mtp
    shared = meta("expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _grouped(a: np.ndarray, axis: int, key_heads: int, per_key: int, size: int) -> np.ndarray:
    """``a`` with the value heads along ``axis`` (``size`` entries each) put back from
    llama.cpp's tiled order into the checkpoint's grouped-by-key-head order."""
    shape = a.shape
    split = (*shape[:axis], per_key, key_heads, size, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(a.reshape(split), axis, axis + 1).reshape(shape))


def _f32(raw: RawTensor, data: np.ndarray, shape: tuple[int, ...]) -> RawTensor:
    flat = np.ascontiguousarray(data, dtype="<f4").reshape(-1).view(np.uint8)
    return RawTensor(raw.name, "F32", shape, flat)


def qwen35_tensor(raw: RawTensor, config: dict[str, Any]) -> RawTensor:
    """``raw`` (canonical name, GGUF layout) in the checkpoint's layout: the conv as
    ``[C, 1, K]``, the shared expert's gate as ``[1, E]``, value heads grouped by key head."""
    name = raw.name
    if name.endswith("mlp.shared_expert_gate.weight") and len(raw.shape) == 1:
        return RawTensor(name, raw.dtype, (1, raw.shape[0]), raw.data)
    if ".linear_attn." not in name or name.endswith("norm.weight"):
        return raw
    key_heads = int(config["linear_num_key_heads"])
    value_heads = int(config["linear_num_value_heads"])
    per_key, dv = value_heads // key_heads, int(config["linear_value_head_dim"])
    keys = 2 * key_heads * int(config["linear_key_head_dim"])  # q and k rows or channels
    shape = tuple(raw.shape)
    if name.endswith("conv1d.weight"):
        shape = (shape[0], 1, shape[-1])  # [C, K] -> the checkpoint's [C, 1, K]
    if per_key == 1:
        return raw if shape == tuple(raw.shape) else RawTensor(name, raw.dtype, shape, raw.data)
    a = np.asarray(dequantize(raw), dtype=np.float32).reshape(raw.shape)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # the value part only
        a = np.concatenate([a[:keys], _grouped(a[keys:], 0, key_heads, per_key, dv)])
    elif name.endswith("in_proj_z.weight"):
        a = _grouped(a, 0, key_heads, per_key, dv)
    elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A", "dt_bias")):
        a = _grouped(a, 0, key_heads, per_key, 1)
    elif name.endswith("out_proj.weight"):
        a = _grouped(a, 1, key_heads, per_key, dv)
    return _f32(raw, a, shape)
