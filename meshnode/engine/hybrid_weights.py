"""Weights of a hybrid stage, laid out as ``meshnode.engine.weights`` lays out a Llama's.

Linear weights are ``[in, out]`` (a projection is ``x @ w``); the DeltaNet layer's ``b`` and
``a`` projections are fused into one matrix, the attention layer's q (with its gate), k and
v into another, gate and up of the MLP into a third. Qwen3.5's RMSNorms multiply by
``1 + weight`` (the checkpoint stores ``weight - 1``): the one is added here, at load, so
the forward uses plain RMSNorms. The gated RMSNorm inside DeltaNet multiplies by its
weight as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from meshnode_packaging.sources import ModelSource, dequantize

from meshnode.engine.backend import Backend
from meshnode.engine.moe_config import MoeConfig
from meshnode.engine.moe_weights import MoeWeights, load_moe

__all__ = ["DeltaNetWeights", "GatedAttentionWeights", "HybridLayerWeights", "load_layer"]


@dataclass(frozen=True)
class DeltaNetWeights:
    """The Gated DeltaNet token mixer of one layer."""

    in_qkv: Any  # [E, C]: q, k, v before the conv
    in_z: Any  # [E, Hv Dv]: the output gate
    in_ba: Any  # [E, 2 Hv]: beta's and the decay's inputs
    conv: Any  # [K, C]: depthwise taps, oldest first
    neg_a: Any  # [Hv]: -exp(A_log), the decay rate's scale
    dt_bias: Any  # [Hv]
    norm: Any  # [Dv]: the gated RMSNorm's weight (as stored)
    out: Any  # [Hv Dv, E]


@dataclass(frozen=True)
class GatedAttentionWeights:
    """The gated full-attention token mixer of one layer."""

    wqkv: Any  # [E, 2 H D + 2 Hkv D]: per head [query; gate], then k, then v
    q_norm: Any  # [D] (1 + weight)
    k_norm: Any  # [D] (1 + weight)
    wo: Any  # [H D, E]


@dataclass(frozen=True)
class HybridLayerWeights:
    """One decoder layer: a token mixer (exactly one of the two) and the SwiGLU MLP (or,
    in a mixture-of-experts layer, the routed experts)."""

    attn_norm: Any  # [E] (1 + weight)
    linear: DeltaNetWeights | None
    attention: GatedAttentionWeights | None
    ffn_norm: Any  # [E] (1 + weight)
    w_gate_up: Any  # [E, 2 I] (None with experts)
    w_down: Any  # [I, E] (None with experts)
    moe: MoeWeights | None = None  # routed and shared experts (Qwen3.5-MoE)
    # (the block's sandwich norms, which Qwen3.5 has not: see ``weights.LayerWeights``)
    post_attn_norm: None = None
    post_ffn_norm: None = None

    def nbytes(self) -> int:
        """Bytes of weight this layer holds (with experts: every expert's)."""
        parts: list[Any] = [self.attn_norm, self.ffn_norm, self.w_gate_up, self.w_down]
        for mixer in (self.linear, self.attention):
            if mixer is not None:
                parts.extend(vars(mixer).values())
        experts = self.moe.nbytes() if self.moe is not None else 0
        return experts + sum(int(a.nbytes) for a in parts if a is not None)


def _get(source: ModelSource, name: str) -> np.ndarray:
    return np.asarray(dequantize(source.tensor(name)), dtype=np.float32)


def linear_t(source: ModelSource, *names: str) -> np.ndarray:
    """Weights ``[out, in]`` concatenated along ``out`` and transposed to ``[in, out]``."""
    return np.ascontiguousarray(np.concatenate([_get(source, n) for n in names], axis=0).T)


def offset_norm(source: ModelSource, name: str) -> np.ndarray:
    """A ``1 + weight`` RMSNorm's effective weight (float32, as torch adds it)."""
    return np.float32(1.0) + _get(source, name)


def _neg_a(source: ModelSource, p: str) -> np.ndarray:
    """``-exp(A_log)``: a GGUF stores it so (``A``), a checkpoint stores ``A_log``."""
    if p + "A" in source.tensor_names():
        return _get(source, p + "A")
    neg_a: np.ndarray = -np.exp(_get(source, p + "A_log"))
    return neg_a


def _deltanet(source: ModelSource, p: str, be: Backend) -> DeltaNetWeights:
    p += "linear_attn."
    conv = _get(source, p + "conv1d.weight")  # [C, 1, K]
    return DeltaNetWeights(
        in_qkv=be.asarray(linear_t(source, p + "in_proj_qkv.weight")),
        in_z=be.asarray(linear_t(source, p + "in_proj_z.weight")),
        in_ba=be.asarray(linear_t(source, p + "in_proj_b.weight", p + "in_proj_a.weight")),
        conv=be.asarray(np.ascontiguousarray(conv[:, 0, :].T)),
        neg_a=be.asarray(_neg_a(source, p)),
        dt_bias=be.asarray(_get(source, p + "dt_bias")),
        norm=be.asarray(_get(source, p + "norm.weight")),
        out=be.asarray(linear_t(source, p + "out_proj.weight")),
    )


def _attention(source: ModelSource, p: str, be: Backend) -> GatedAttentionWeights:
    p += "self_attn."
    return GatedAttentionWeights(
        wqkv=be.asarray(linear_t(source, *(f"{p}{x}_proj.weight" for x in "qkv"))),
        q_norm=be.asarray(offset_norm(source, p + "q_norm.weight")),
        k_norm=be.asarray(offset_norm(source, p + "k_norm.weight")),
        wo=be.asarray(linear_t(source, p + "o_proj.weight")),
    )


def load_layer(
    source: ModelSource, prefix: str, linear: bool, be: Backend, moe: MoeConfig | None = None
) -> HybridLayerWeights:
    """The layer whose tensors are named ``prefix`` + ``input_layernorm.weight`` etc.

    ``prefix`` is ``layers.{i}.`` for the model's layers (``mtp.layers.0.`` for the MTP
    module's); ``moe``: the model's experts when this layer routes to them (in the file's
    blocks where the backend keeps blocks). Raises ``KeyError`` naming a missing tensor.
    """
    if moe is not None:
        return HybridLayerWeights(
            attn_norm=be.asarray(offset_norm(source, prefix + "input_layernorm.weight")),
            linear=_deltanet(source, prefix, be) if linear else None,
            attention=None if linear else _attention(source, prefix, be),
            ffn_norm=be.asarray(offset_norm(source, prefix + "post_attention_layernorm.weight")),
            w_gate_up=None,
            w_down=None,
            moe=load_moe(source, moe, prefix, blocks=be.cpu_blocks),
        )
    return HybridLayerWeights(
        attn_norm=be.asarray(offset_norm(source, prefix + "input_layernorm.weight")),
        linear=_deltanet(source, prefix, be) if linear else None,
        attention=None if linear else _attention(source, prefix, be),
        ffn_norm=be.asarray(offset_norm(source, prefix + "post_attention_layernorm.weight")),
        w_gate_up=be.asarray(
            linear_t(source, prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight")
        ),
        w_down=be.asarray(linear_t(source, prefix + "mlp.down_proj.weight")),
    )
