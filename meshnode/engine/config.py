"""Model configuration: the Hugging Face ``config.json`` keys the decoder needs, checked.

Every model family meshnode runs is one row of :data:`ARCHITECTURES`: what its decoder
block does beyond the Llama baseline (QK-norm, norms after attention and MLP, the gated
MLP's activation, scaled embeddings, Gemma's ``1 + weight`` RMSNorm). A new family that
only recombines these pieces is one new row; the stage reads the row, never the name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from meshnode.engine.hybrid_config import (
    HYBRID_MODEL_TYPES,
    QWEN35_MOE,
    HybridConfig,
    HybridConfigError,
)
from meshnode.engine.moe_config import MoeConfig, MoeFamily, moe_from_hf
from meshnode.errors import ModelError

__all__ = ["ARCHITECTURES", "Architecture", "ModelConfig", "ModelConfigError"]

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

Activation = Literal["silu", "gelu_tanh"]
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = frozenset({FULL_ATTENTION, SLIDING_ATTENTION})


@dataclass(frozen=True)
class Architecture:
    """What one family's decoder does beyond Llama's (RMSNorm, RoPE, GQA, SwiGLU)."""

    # Canonical (Hugging Face) name of the norm before the MLP.
    ffn_norm: str = "post_attention_layernorm"
    qk_norm: bool = False  # RMSNorm over each head's q and k, before RoPE
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs too
    activation: Activation = "silu"  # of the gated MLP: SwiGLU or GeGLU (tanh GELU)
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    # RMSNorm multiplies by (norm_offset + weight): Gemma's checkpoints store weight - 1.
    norm_offset: float = 0.0
    attention_bias: bool = False  # QKV bias when config.json does not say
    tied_embeddings: bool = False  # tie_word_embeddings when config.json does not say
    # Learned per-head sink logits: one more softmax column per head, with no value (gpt-oss)
    attention_sinks: bool = False
    # Routed experts in the feed-forward part of (some) layers; None: a dense MLP
    moe: MoeFamily | None = None
    # config.json keys transformers fills in when a checkpoint leaves them out (saved
    # configs hold only what differs from the config class's defaults).
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


# transformers' Gemma3TextConfig defaults: Gemma 3 4B+ checkpoints nest a text_config
# that states only what differs from them.
_GEMMA3_DEFAULTS = MappingProxyType(
    {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }
)

_GEMMA3 = Architecture(
    ffn_norm="pre_feedforward_layernorm",
    qk_norm=True,
    sandwich_norms=True,
    activation="gelu_tanh",
    scaled_embeddings=True,
    norm_offset=1.0,
    tied_embeddings=True,
    defaults=_GEMMA3_DEFAULTS,
)

#: model_type -> architecture. Gemma 3's multimodal config ("gemma3") nests the text
#: model's keys under "text_config"; :meth:`ModelConfig.from_hf` reads them from there.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),
    "mistral": Architecture(),
    "qwen2": Architecture(attention_bias=True),
    "qwen3": Architecture(qk_norm=True),
    "gemma3_text": _GEMMA3,
    "gemma3": _GEMMA3,
    # Gated DeltaNet + gated attention layers (meshnode.engine.hybrid's token mixers)
    "qwen3_5_text": Architecture(),
    # Mixtures of experts (meshnode.engine.moe); the CUDA backend refuses them for now
    "qwen3_moe": Architecture(qk_norm=True, moe=MoeFamily()),
    "mixtral": Architecture(moe=MoeFamily(norm_topk_prob=True)),
    "gpt_oss": Architecture(
        attention_bias=True,
        attention_sinks=True,
        moe=MoeFamily(routing="topk_softmax", glu="clamped_swiglu", biases=True),
    ),
    # the hybrid block with routed experts and a sigmoid-gated shared expert
    "qwen3_5_moe_text": Architecture(moe=QWEN35_MOE),
    "qwen3_5_moe": Architecture(moe=QWEN35_MOE),
}
SUPPORTED_MODEL_TYPES = frozenset(ARCHITECTURES)


class ModelConfigError(ModelError):
    """The model configuration is incomplete or describes an unsupported model."""


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def _factors(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of a decoder; derived sizes are set in __post_init__."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # llama.cpp's per-pair RoPE divisors (GGUF ``rope_freqs.weight``), applied after scaling
    rope_freq_factors: tuple[float, ...] | None = None
    # "full_attention" or "sliding_attention" per layer (empty: every layer full)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    # RoPE base of the sliding layers, unscaled (Gemma 3); None: the same RoPE as the others
    rope_local_theta: float | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim
    query_pre_attn_scalar: float | None = None
    # The Gated DeltaNet sizes and layer kinds of a hybrid model (None: a plain decoder)
    hybrid: HybridConfig | None = None
    # The routed experts and which layers have them (None: every layer's MLP is dense)
    moe: MoeConfig | None = None
    # derived
    q_size: int = field(init=False)
    kv_size: int = field(init=False)
    group_size: int = field(init=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            known = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
            raise ModelConfigError(
                f"unsupported model type {self.model_type!r} (supported: {known})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ModelConfigError("head_dim must be even for RoPE")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(f"unsupported rope scaling {rope_type!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelConfigError("rope_freq_factors must have head_dim / 2 entries")
        self._check_layer_types()
        object.__setattr__(self, "q_size", self.num_heads * self.head_dim)
        object.__setattr__(self, "kv_size", self.num_kv_heads * self.head_dim)
        object.__setattr__(self, "group_size", self.num_heads // self.num_kv_heads)

    def _check_layer_types(self) -> None:
        if not self.layer_types:
            return
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(
                f"layer_types has {len(self.layer_types)} entries, not num_layers"
            )
        unknown = sorted(set(self.layer_types) - LAYER_TYPES)
        if unknown:
            raise ModelConfigError(f"unsupported layer type {unknown[0]!r}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ModelConfigError("sliding_attention layers need a sliding_window")

    @property
    def arch(self) -> Architecture:
        """The row of :data:`ARCHITECTURES` for this model type."""
        return ARCHITECTURES[self.model_type]

    @property
    def rope_type(self) -> str:
        """``default``, ``linear`` or ``llama3`` (``rope_scaling.rope_type`` or ``.type``)."""
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def attention_scale(self) -> float:
        """The factor of the attention scores: ``1 / sqrt(query_pre_attn_scalar or head_dim)``."""
        return float(1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim))

    def layer_params(self, layer: int) -> int:
        """Parameters of layer ``layer`` (model numbering): its projections, MLP and the two
        block norms (a hybrid model's from its :class:`HybridConfig`). The planner places
        layers by them where the stored bytes are not known."""
        if self.hybrid is not None:
            return self.hybrid.layer_params(layer)
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        attention = h * (q + 2 * kv) + q * h + 2 * h
        if self.moe is not None and self.moe.is_sparse(layer):
            # a MoE layer holds every expert, though a token runs only k of them
            return attention + self.moe.layer_params(h)[0]
        return attention + 3 * h * self.intermediate_size

    @property
    def embed_params(self) -> int:
        """Parameters of the embedding table ``[V, E]``."""
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Parameters of the head: the final norm, and the output table when untied."""
        h = self.hidden_size
        return h + (0 if self.tie_word_embeddings else self.vocab_size * h)

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (model numbering), None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; raises :class:`ModelConfigError`."""
        try:
            return cls(**_hf_fields(config))
        except HybridConfigError as exc:
            raise ModelConfigError(str(exc)) from exc
        except KeyError as exc:
            raise ModelConfigError(f"model config lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"invalid model config: {exc}") from exc

    def rope_inv_freq(self, layer: int | None = None) -> list[float]:
        """RoPE inverse frequencies per rotary pair, with the model's scaling applied.

        Follows transformers' ``modeling_rope_utils`` (``_compute_default_rope_parameters``,
        ``_compute_linear_scaling_rope_parameters``, ``_compute_llama3_parameters``).
        A sliding layer of a model with a local RoPE base (Gemma 3) gets the unscaled
        frequencies of that base instead.
        """
        dim = self.head_dim
        if layer is not None and self.window(layer) and self.rope_local_theta is not None:
            return [1.0 / self.rope_local_theta ** (i / dim) for i in range(0, dim, 2)]
        inv = [1.0 / self.rope_theta ** (i / dim) for i in range(0, dim, 2)]
        scaling = self.rope_scaling or {}
        if self.rope_type == "linear":
            inv = [f / float(scaling["factor"]) for f in inv]
        elif self.rope_type == "llama3":
            inv = _llama3_inv_freq(inv, scaling)
        elif self.rope_type == "yarn":
            old_ctx = scaling.get("original_max_position_embeddings")
            old_ctx = float(old_ctx or self.max_position_embeddings)
            inv = _yarn_inv_freq(inv, scaling, self.rope_theta, dim, old_ctx)
        if self.rope_freq_factors:
            inv = [f / d for f, d in zip(inv, self.rope_freq_factors, strict=True)]
        return inv

    @property
    def rope_attention_factor(self) -> float:
        """The factor RoPE's cos and sin are multiplied by: YaRN's ``attention_factor``
        (default ``0.1 ln(factor) + 1``, transformers' ``get_mscale``), else 1."""
        scaling = self.rope_scaling or {}
        if self.rope_type != "yarn":
            return 1.0
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = float(scaling["factor"])
        return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _hf_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a ``config.json``; raises KeyError, ValueError."""
    model_type = str(config.get("model_type", "llama"))
    if isinstance(config.get("text_config"), dict):  # a multimodal wrapper: its text model
        config = {"model_type": model_type, **config["text_config"]}
    arch = ARCHITECTURES.get(model_type, Architecture())
    config = {**arch.defaults, **config}
    _refuse_unsupported(config, arch)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    rope, local_rope = _rope_blocks(config)
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type") else None)
    local_theta = local_rope.get("rope_theta", config.get("rope_local_base_freq"))
    scalar = config.get("query_pre_attn_scalar")
    hybrid = model_type in HYBRID_MODEL_TYPES
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        # Qwen3.5-MoE has no dense MLP, hence no intermediate_size
        "intermediate_size": int(
            config.get("intermediate_size") or config["moe_intermediate_size"]
        ),
        "vocab_size": int(config["vocab_size"]),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "rope_scaling": dict(scaling) if scaling else None,
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", arch.tied_embeddings)),
        "attention_bias": bool(config.get("attention_bias", arch.attention_bias)),
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_ids": _ids(config.get("eos_token_id")),
        "rope_freq_factors": _factors(config.get("rope_freq_factors")),
        # a hybrid model's layer kinds live in its HybridConfig
        "layer_types": () if hybrid else _layer_types(config, model_type, layers),
        "sliding_window": _int_or_none(config.get("sliding_window")),
        "rope_local_theta": None if local_theta is None else float(local_theta),
        "query_pre_attn_scalar": None if scalar is None else float(scalar),
        "hybrid": HybridConfig.from_hf(config) if hybrid else None,
        "moe": moe_from_hf(config, arch.moe, layers),
    }


# config.json activation names -> the gated MLP activation they mean.
_ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
}


def _refuse_unsupported(config: dict[str, Any], arch: Architecture) -> None:
    """Features that change the math and that the stage does not implement."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise ModelConfigError(f"{key} is not supported")
    act = config.get("hidden_activation") or config.get("hidden_act") or arch.activation
    if _ACTIVATIONS.get(str(act), act) != arch.activation:
        raise ModelConfigError(f"unsupported activation {act!r} for this model type")


def _rope_blocks(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """RoPE settings of the full and of the sliding layers (transformers 5 nests them under
    ``rope_parameters``, per layer type where the two differ)."""
    rope = config.get("rope_parameters") or config.get("rope") or {}
    if FULL_ATTENTION in rope or SLIDING_ATTENTION in rope:
        return dict(rope.get(FULL_ATTENTION) or {}), dict(rope.get(SLIDING_ATTENTION) or {})
    return dict(rope), {}


def _layer_types(config: dict[str, Any], model_type: str, layers: int) -> tuple[str, ...]:
    if config.get("layer_types"):
        return tuple(str(t) for t in config["layer_types"])
    pattern = config.get("sliding_window_pattern")
    if pattern:  # transformers' older form: every pattern-th layer is global
        return tuple(
            SLIDING_ATTENTION if (i + 1) % int(pattern) else FULL_ATTENTION for i in range(layers)
        )
    if model_type == "mistral" and config.get("sliding_window"):
        return (SLIDING_ATTENTION,) * layers  # Mistral 7B v0.1 slides on every layer
    return ()


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _llama3_inv_freq(inv: list[float], scaling: dict[str, Any]) -> list[float]:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:  # high frequency: unchanged
            out.append(f)
        elif wavelen > low_wavelen:  # low frequency: scaled down by the factor
            out.append(f / factor)
        else:  # in between: interpolate smoothly
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def _yarn_inv_freq(
    inv: list[float], scaling: dict[str, Any], base: float, dim: int, old_ctx: float
) -> list[float]:
    """YaRN (transformers' ``_compute_yarn_parameters``) for a model trained on
    ``old_ctx`` positions: frequencies above the ``beta_fast`` correction dimension kept,
    below ``beta_slow`` divided by the factor, a linear ramp between (``truncate``,
    default true, rounds the ramp's ends outward)."""
    factor = float(scaling["factor"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(inv):
        extrapolate = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * (1 - extrapolate) + f * extrapolate)
    return out
