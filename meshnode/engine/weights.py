"""Stage weights: dequantized, remapped from canonical names, laid out for the matmuls.

Layout (chosen by ``benchmarks/engine.py``): every linear weight is stored transposed,
``[in_features, out_features]`` C-contiguous, so a projection is ``x @ w``. On OpenBLAS
this makes the one-row decode product a streaming ``gemv`` that runs at memory bandwidth,
and Q/K/V and gate/up are fused into one matrix each so a block makes four matmul calls.
The token embedding is kept once, as ``[hidden, vocab]``: the head is ``x @ embed_t`` and
the embedding lookup is a column gather, so a tied model holds a single copy.

On a CUDA backend the same dataclasses hold device matrices in the GGML ``[out, in]``
layout instead (``meshnode.engine.cuda.weights``; ``embed_t``/``head_t`` are then
``[vocab, hidden]`` rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from meshnode_packaging.sources import ModelSource, dequantize

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig

__all__ = ["LayerWeights", "StageWeights", "load_stage_weights", "norm_weight"]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block; linear weights are ``[in, out]``."""

    attn_norm: Any  # [E]
    wqkv: Any  # [E, (H + 2 Hkv) D]
    bqkv: Any | None  # [(H + 2 Hkv) D]
    wo: Any  # [H D, E]
    ffn_norm: Any  # [E]
    w_gate_up: Any  # [E, 2 I]
    w_down: Any  # [I, E]
    q_norm: Any | None = None  # [D], QK-norm (Qwen 3, Gemma 3)
    k_norm: Any | None = None  # [D]
    post_attn_norm: Any | None = None  # [E], on the attention output (Gemma 3)
    post_ffn_norm: Any | None = None  # [E], on the MLP output (Gemma 3)

    def nbytes(self) -> int:
        """Bytes of weight this block reads per forward."""
        arrays = (
            self.attn_norm,
            self.wqkv,
            self.bqkv,
            self.wo,
            self.ffn_norm,
            self.w_gate_up,
            self.w_down,
            self.q_norm,
            self.k_norm,
            self.post_attn_norm,
            self.post_ffn_norm,
        )
        return sum(int(a.nbytes) for a in arrays if a is not None)


@dataclass(frozen=True)
class StageWeights:
    """The weights of layers ``[start, end)`` plus embedding and/or head when present."""

    start: int
    end: int
    layers: list[LayerWeights]
    embed_t: Any | None  # [E, V]: the embedding (first stage) and/or tied head (last)
    norm: Any | None  # [E] final norm, head stage only
    head_t: Any | None  # [E, V] untied output projection, head stage only

    def nbytes(self) -> int:
        """Bytes of all weights in this stage."""
        extra = (self.embed_t, self.norm, self.head_t)
        return sum(layer.nbytes() for layer in self.layers) + sum(
            int(a.nbytes) for a in extra if a is not None
        )


def _get(source: ModelSource, name: str) -> np.ndarray:
    return dequantize(source.tensor(name))


def norm_weight(source: ModelSource, config: ModelConfig, name: str) -> np.ndarray:
    """An RMSNorm weight as the stage multiplies by it: ``norm_offset + weight`` (Gemma's
    checkpoints store ``weight - 1``; the sum is float32, as transformers computes it)."""
    w = _get(source, name)
    offset = config.arch.norm_offset
    return w + np.float32(offset) if offset else w


def _linear_t(source: ModelSource, *names: str) -> np.ndarray:
    """Weights ``[out, in]`` concatenated along ``out`` and transposed to ``[in, out]``."""
    return np.ascontiguousarray(np.concatenate([_get(source, n) for n in names], axis=0).T)


def _layer(source: ModelSource, config: ModelConfig, i: int, be: Backend) -> LayerWeights:
    p = f"layers.{i}."
    qkv = [f"{p}self_attn.{x}_proj" for x in "qkv"]
    bias = None
    if config.attention_bias:
        bias = be.asarray(np.concatenate([_get(source, n + ".bias") for n in qkv]))
    arch = config.arch

    def norm(name: str, present: bool = True) -> Any:
        return be.asarray(norm_weight(source, config, p + name + ".weight")) if present else None

    return LayerWeights(
        attn_norm=norm("input_layernorm"),
        wqkv=be.asarray(_linear_t(source, *(n + ".weight" for n in qkv))),
        bqkv=bias,
        wo=be.asarray(_linear_t(source, p + "self_attn.o_proj.weight")),
        ffn_norm=norm(arch.ffn_norm),
        w_gate_up=be.asarray(
            _linear_t(source, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        ),
        w_down=be.asarray(_linear_t(source, p + "mlp.down_proj.weight")),
        q_norm=norm("self_attn.q_norm", arch.qk_norm),
        k_norm=norm("self_attn.k_norm", arch.qk_norm),
        post_attn_norm=norm("post_attention_layernorm", arch.sandwich_norms),
        post_ffn_norm=norm("post_feedforward_layernorm", arch.sandwich_norms),
    )


def load_stage_weights(
    source: ModelSource,
    config: ModelConfig,
    start: int,
    end: int,
    *,
    embed: bool,
    head: bool,
    backend: Backend,
) -> StageWeights:
    """Dequantize and lay out the tensors stage ``[start, end)`` needs from ``source``.

    Raises ``KeyError`` naming a missing tensor.
    """
    if backend.name == "cuda":
        from meshnode.engine.cuda.weights import load_cuda_stage_weights

        return load_cuda_stage_weights(
            source, config, start, end, embed=embed, head=head, backend=backend
        )
    layers = [_layer(source, config, i, backend) for i in range(start, end)]
    tied = config.tie_word_embeddings or "lm_head.weight" not in source.tensor_names()
    embed_t = None
    if embed or (head and tied):
        embed_t = backend.asarray(_linear_t(source, "embed_tokens.weight"))
    head_t = None
    if head and not tied:
        head_t = backend.asarray(_linear_t(source, "lm_head.weight"))
    norm = backend.asarray(norm_weight(source, config, "norm.weight")) if head else None
    return StageWeights(start, end, layers, embed_t, norm, head_t)
