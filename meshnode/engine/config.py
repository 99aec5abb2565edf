"""Model configuration: the Hugging Face ``config.json`` keys the decoder needs, checked."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from meshnode.engine.hybrid_config import HYBRID_MODEL_TYPES, HybridConfig, HybridConfigError
from meshnode.errors import ModelError

__all__ = ["ModelConfig", "ModelConfigError"]

# model_type values that are the Llama-family decoder meshnode implements.
# qwen3_5_text is the hybrid (Gated DeltaNet) decoder of ``meshnode.engine.hybrid``.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3_5_text"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


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
    """Sizes and constants of a Llama-family decoder; derived sizes are set in __post_init__."""

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
    # The Gated DeltaNet sizes and layer kinds of a hybrid model (None: a plain decoder)
    hybrid: HybridConfig | None = None
    # derived
    q_size: int = field(init=False)
    kv_size: int = field(init=False)
    group_size: int = field(init=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(f"unsupported model type {self.model_type!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ModelConfigError("head_dim must be even for RoPE")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(f"unsupported rope scaling {rope_type!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelConfigError("rope_freq_factors must have head_dim / 2 entries")
        object.__setattr__(self, "q_size", self.num_heads * self.head_dim)
        object.__setattr__(self, "kv_size", self.num_kv_heads * self.head_dim)
        object.__setattr__(self, "group_size", self.num_heads // self.num_kv_heads)

    @property
    def rope_type(self) -> str:
        """``default``, ``linear`` or ``llama3`` (``rope_scaling.rope_type`` or ``.type``)."""
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; raises :class:`ModelConfigError`."""
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            # transformers 5 nests rope settings under "rope_parameters"/"rope".
            rope = config.get("rope_parameters") or config.get("rope") or {}
            scaling = config.get("rope_scaling") or (rope if rope.get("rope_type") else None)
            return cls(
                model_type=str(config.get("model_type", "llama")),
                hidden_size=hidden,
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=dict(scaling) if scaling else None,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(
                    config.get("attention_bias", config.get("model_type") == "qwen2")
                ),
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=_ids(config.get("eos_token_id")),
                rope_freq_factors=_factors(config.get("rope_freq_factors")),
                hybrid=_hybrid(config),
            )
        except HybridConfigError as exc:
            raise ModelConfigError(str(exc)) from exc
        except KeyError as exc:
            raise ModelConfigError(f"model config lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"invalid model config: {exc}") from exc

    def rope_inv_freq(self) -> list[float]:
        """RoPE inverse frequencies per rotary pair, with the model's scaling applied.

        Follows transformers' ``modeling_rope_utils`` (``_compute_default_rope_parameters``,
        ``_compute_linear_scaling_rope_parameters``, ``_compute_llama3_parameters``).
        """
        dim = self.head_dim
        inv = [1.0 / self.rope_theta ** (i / dim) for i in range(0, dim, 2)]
        scaling = self.rope_scaling or {}
        if self.rope_type == "linear":
            inv = [f / float(scaling["factor"]) for f in inv]
        elif self.rope_type == "llama3":
            inv = _llama3_inv_freq(inv, scaling)
        if self.rope_freq_factors:
            inv = [f / d for f, d in zip(inv, self.rope_freq_factors, strict=True)]
        return inv


def _hybrid(config: dict[str, Any]) -> HybridConfig | None:
    if config.get("model_type") in HYBRID_MODEL_TYPES:
        return HybridConfig.from_hf(config)
    return None


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
