"""The sizes of a hybrid (Gated DeltaNet + gated attention) model, from its ``config.json``.

Qwen3.5's text model (``model_type`` ``qwen3_5_text``, or ``qwen3_5`` with the keys under
``text_config``): ``layer_types`` says which layers are ``linear_attention`` (Gated
DeltaNet) and which ``full_attention``; the ``linear_*`` keys size the DeltaNet layers;
``rope_parameters.partial_rotary_factor`` the rotary part of the attention heads. The
mixture-of-experts variant (Qwen3.5-MoE, ``qwen3_5_moe_text``) replaces the SwiGLU MLP by
routed experts plus a sigmoid-gated shared expert (:mod:`meshnode.engine.moe_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshnode.engine.moe_config import MoeConfig, MoeFamily, moe_from_hf
from meshnode.engine.recurrent import RecurrentShape
from meshnode.errors import ModelError

__all__ = [
    "HYBRID_MODEL_TYPES",
    "LINEAR_ATTENTION",
    "QWEN35_MOE",
    "HybridConfig",
    "HybridConfigError",
]

HYBRID_MODEL_TYPES = frozenset({"qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"})
# Qwen3.5-MoE's router: softmax over all experts, the top k renormalised (its config has
# no norm_topk_prob: transformers' Qwen3_5MoeTopKRouter always divides by their sum).
QWEN35_MOE = MoeFamily(norm_topk_prob=True)
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class HybridConfigError(ModelError):
    """The configuration is not a hybrid model meshnode implements."""


@dataclass(frozen=True)
class HybridConfig:
    """What the hybrid stage needs beyond a decoder's usual sizes; derived in __post_init__."""

    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    moe: MoeConfig | None = None  # routed experts (Qwen3.5-MoE) instead of the dense MLP
    # layers of the checkpoint's MTP module (``mtp_num_hidden_layers``; the last stage holds
    # it): counted in the head's footprint
    mtp_layers: int = 0
    key_size: int = field(init=False)  # Hk Dk: the q (and the k) part of the conv input
    value_size: int = field(init=False)  # Hv Dv
    conv_channels: int = field(init=False)  # 2 Hk Dk + Hv Dv

    def __post_init__(self) -> None:
        unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise HybridConfigError(f"unsupported layer type {sorted(unknown)[0]!r}")
        if self.linear_value_heads % self.linear_key_heads:
            raise HybridConfigError("linear_num_value_heads must be a multiple of key heads")
        if self.num_heads % self.num_kv_heads:
            raise HybridConfigError("num_attention_heads must be a multiple of KV heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise HybridConfigError(f"bad rotary dimension {self.rotary_dim}")
        if self.conv_kernel < 1:
            raise HybridConfigError("linear_conv_kernel_dim must be at least 1")
        key_size = self.linear_key_heads * self.linear_key_dim
        value_size = self.linear_value_heads * self.linear_value_dim
        object.__setattr__(self, "key_size", key_size)
        object.__setattr__(self, "value_size", value_size)
        object.__setattr__(self, "conv_channels", 2 * key_size + value_size)

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model."""
        return len(self.layer_types)

    def is_linear(self, layer: int) -> bool:
        """Whether layer ``layer`` (model numbering) is a Gated DeltaNet layer."""
        return self.layer_types[layer] == LINEAR_ATTENTION

    def recurrent_shape(self) -> RecurrentShape:
        """The state one DeltaNet layer keeps per sequence."""
        return RecurrentShape(
            conv_taps=self.conv_kernel - 1,
            conv_channels=self.conv_channels,
            value_heads=self.linear_value_heads,
            key_dim=self.linear_key_dim,
            value_dim=self.linear_value_dim,
        )

    def recurrent_bytes(self, start: int, end: int, ring_slots: int) -> int:
        """float32 bytes of recurrent state plus ring per sequence for layers [start, end)."""
        layers = sum(self.is_linear(i) for i in range(start, end))
        return layers * self.recurrent_shape().nbytes() * (1 + ring_slots)

    def layer_params(self, layer: int) -> int:
        """Weights (parameters) of layer ``layer``: its token mixer, MLP and two norms."""
        e = self.hidden_size
        common = 3 * e * self.intermediate_size + 2 * e
        if self.moe is not None and self.moe.is_sparse(layer):
            common = self.moe.layer_params(e)[0] + 2 * e
        if self.is_linear(layer):
            c, heads = self.conv_channels, self.linear_value_heads
            mixer = e * c + 2 * e * self.value_size + 2 * e * heads + c * self.conv_kernel
            return common + mixer + 2 * heads + self.linear_value_dim
        return common + self._attention_params()

    def _attention_params(self) -> int:
        """A gated full-attention mixer's weights: q (with its gate), k, v, o, QK-norms."""
        e = self.hidden_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return e * (2 * q + 2 * kv) + q * e + 2 * self.head_dim

    def mtp_params(self) -> int:
        """Weights of the MTP module (``mtp.*``): per layer a gated full-attention decoder
        layer (routed experts when the model has them), the projection ``fc`` of the
        concatenated normed embedding and hidden state, and three norms."""
        e = self.hidden_size
        mlp = 3 * e * self.intermediate_size
        if self.moe is not None:
            mlp = self.moe.layer_params(e)[0]
        layer = mlp + 2 * e + self._attention_params()
        return self.mtp_layers * (layer + 2 * e * e + 3 * e)

    def rope_inv_freq(self) -> list[float]:
        """RoPE inverse frequencies of the rotary dims (transformers' default rope over
        ``head_dim * partial_rotary_factor`` dims)."""
        dim = self.rotary_dim
        return [1.0 / self.rope_theta ** (i / dim) for i in range(0, dim, 2)]

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> HybridConfig:
        """Build from a Hugging Face ``config.json`` dict; raises :class:`HybridConfigError`."""
        model_type = config.get("model_type")
        if model_type not in HYBRID_MODEL_TYPES:
            raise HybridConfigError(f"{model_type!r} is not a hybrid model type")
        if isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        try:
            return cls(**_fields(config))
        except KeyError as exc:
            raise HybridConfigError(f"hybrid model config lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, HybridConfigError):
                raise
            raise HybridConfigError(f"invalid hybrid model config: {exc}") from exc


def _fields(config: dict[str, Any]) -> dict[str, Any]:
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise HybridConfigError(f"unsupported activation {act!r}")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise HybridConfigError(f"unsupported rope type {rope.get('rope_type')!r}")
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    layers = int(config["num_hidden_layers"])
    types = tuple(str(t) for t in config["layer_types"])
    if len(types) != layers:
        raise HybridConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    return {
        "hidden_size": hidden,
        "layer_types": types,
        "num_heads": heads,
        "num_kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "rotary_dim": int(head_dim * partial),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        # a MoE model's dense MLP size, if it has one (its experts' size otherwise)
        "intermediate_size": int(
            config.get("intermediate_size") or config["moe_intermediate_size"]
        ),
        "vocab_size": int(config["vocab_size"]),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "linear_key_heads": int(config["linear_num_key_heads"]),
        "linear_value_heads": int(config["linear_num_value_heads"]),
        "linear_key_dim": int(config["linear_key_head_dim"]),
        "linear_value_dim": int(config["linear_value_head_dim"]),
        "conv_kernel": int(config.get("linear_conv_kernel_dim", 4)),
        "moe": moe_from_hf(config, QWEN35_MOE, layers),
        "mtp_layers": int(config.get("mtp_num_hidden_layers") or 0),
    }
