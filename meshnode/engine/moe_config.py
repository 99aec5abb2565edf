"""The mixture-of-experts part of a model's configuration: which layers route, and how.

A family's fixed choices are a :class:`MoeFamily` (a field of its architecture row:
how the router turns logits into the chosen experts' weights, the experts' activation,
whether the checkpoint's ``config.json`` may leave ``norm_topk_prob`` out); a model's
sizes are a :class:`MoeConfig`, read from ``config.json`` by :func:`moe_from_hf`:

- ``num_experts`` (``num_experts``, ``num_local_experts``), ``top_k``
  (``num_experts_per_tok``), ``expert_size`` (``moe_intermediate_size``, else
  ``intermediate_size``: Mixtral and gpt-oss size their experts with it);
- which layers are sparse: every layer, except those in ``mlp_only_layers`` and those
  that ``decoder_sparse_step`` skips (Qwen3-MoE: layer ``i`` routes when
  ``(i + 1) % step == 0``); the others run the dense MLP of ``intermediate_size``;
- a shared expert (``shared_expert_intermediate_size``, Qwen3-Next/Qwen3.5-MoE) that
  every token runs, scaled by ``sigmoid(x @ shared_expert_gate)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MoeConfig", "MoeFamily", "moe_from_hf"]

# How routing weights come from the router's logits:
# ``softmax_topk``: softmax over every expert's logit, the k largest kept (then divided
#   by their sum when ``norm_topk_prob``): Qwen3-MoE, Mixtral (always renormalised, which
#   is the softmax over the chosen logits), Qwen3.5-MoE;
# ``topk_softmax``: the k largest logits, then the softmax over those k: gpt-oss.
Routing = Literal["softmax_topk", "topk_softmax"]
# The experts' gated activation: SwiGLU, or gpt-oss's clamped one
# (``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, limit)``).
ExpertGlu = Literal["silu", "clamped_swiglu"]


@dataclass(frozen=True)
class MoeFamily:
    """What a mixture-of-experts family fixes, whatever the model's sizes."""

    routing: Routing = "softmax_topk"
    glu: ExpertGlu = "silu"
    # norm_topk_prob when config.json does not say (Mixtral and Qwen3.5-MoE have no such
    # key: their routers always renormalise)
    norm_topk_prob: bool = False
    biases: bool = False  # the router and the experts' matrices have biases (gpt-oss)


@dataclass(frozen=True)
class MoeConfig:
    """A model's experts: how many, how many per token, their size, which layers."""

    num_experts: int
    top_k: int
    expert_size: int  # I of one expert's gate, up [I, E] and down [E, I]
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP
    routing: Routing = "softmax_topk"
    norm_topk_prob: bool = False
    glu: ExpertGlu = "silu"
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU (config swiglu_alpha)
    swiglu_limit: float = 7.0  # (config swiglu_limit)
    shared_expert_size: int = 0  # 0: no shared expert
    biases: bool = False  # router and expert biases (gpt-oss)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} outside 1..{self.num_experts}")
        if self.expert_size <= 0:
            raise ValueError("the experts' intermediate size must be positive")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` (model numbering) routes its tokens to experts."""
        return self.sparse_layers[layer]

    def layer_params(self, hidden: int) -> tuple[int, int]:
        """(all, active per token) parameters of one sparse layer's feed-forward part."""
        one = 3 * hidden * self.expert_size + self.biases * (2 * self.expert_size + hidden)
        shared = 3 * hidden * self.shared_expert_size + (hidden if self.shared_expert_size else 0)
        router = (hidden + self.biases) * self.num_experts
        return router + self.num_experts * one + shared, router + self.top_k * one + shared


def moe_from_hf(
    config: Mapping[str, Any], family: MoeFamily | None, layers: int
) -> MoeConfig | None:
    """The experts of a ``config.json`` whose family is ``family`` (None: a dense
    family, or a config without experts). Raises ``KeyError``/``ValueError`` on a bad one."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if family is None or experts == 0:
        return None
    only = {int(i) for i in config.get("mlp_only_layers") or ()}
    step = int(config.get("decoder_sparse_step") or 1)
    sparse = tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    return MoeConfig(
        num_experts=experts,
        top_k=int(config["num_experts_per_tok"]),
        expert_size=int(size),
        sparse_layers=sparse,
        routing=family.routing,
        norm_topk_prob=bool(config.get("norm_topk_prob", family.norm_topk_prob)),
        glu=family.glu,
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0),
        biases=family.biases,
    )
