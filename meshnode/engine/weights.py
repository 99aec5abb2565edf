"""Stage weights: remapped from canonical names, laid out for the matmuls.

Every linear weight is the right-hand side of ``x @ w`` (logically ``[in_features,
out_features]``); Q/K/V and gate/up are fused into one matrix each so a block makes four
products. This is the CPU backend's loader (``CpuBackend.load_weights``); how it holds
them depends on ``blocks`` (the backend's ``weights_dtype``):

- ``auto``/``float32`` (default): dequantized at load and stored transposed, ``[in, out]``
  C-contiguous (on OpenBLAS the one-row product is then a streaming ``gemv``);
- ``native``: in the file's own GGUF block formats, as
  :class:`~meshnode.engine.cpu.BlockMatrix` views of the memory-mapped file, multiplied by
  compiled kernels; a stage holds about its tensors' bytes in the file.

The token embedding is kept once: the head is ``x @ embed_t`` and the lookup a row
gather, so a tied model holds a single copy.

On a CUDA backend the same dataclasses hold device matrices in the GGML ``[out, in]``
layout instead (``meshnode.engine.cuda.weights``, which imports them from here;
``embed_t``/``head_t`` are then ``[vocab, hidden]`` rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from meshnode_packaging.sources import ModelSource, RawTensor, dequantize

from meshnode.engine.config import ModelConfig
from meshnode.engine.cpu import BlockMatrix, supported
from meshnode.engine.moe_weights import MoeWeights, expert_slice, load_moe

__all__ = [
    "HeldBytes",
    "LayerWeights",
    "StageWeights",
    "held_bytes",
    "load_stage_weights",
    "norm_weight",
]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block; linear weights are ``[in, out]``."""

    attn_norm: Any  # [E]
    wqkv: Any  # [E, (H + 2 Hkv) D]
    bqkv: Any | None  # [(H + 2 Hkv) D]
    wo: Any  # [H D, E]
    ffn_norm: Any  # [E]
    w_gate_up: Any  # [E, 2 I] (None in a mixture-of-experts layer)
    w_down: Any  # [I, E] (None in a mixture-of-experts layer)
    q_norm: Any | None = None  # [D], QK-norm (Qwen 3, Gemma 3)
    k_norm: Any | None = None  # [D]
    post_attn_norm: Any | None = None  # [E], on the attention output (Gemma 3)
    post_ffn_norm: Any | None = None  # [E], on the MLP output (Gemma 3)
    bo: Any | None = None  # [E], the attention output's bias (gpt-oss)
    sinks: Any | None = None  # [H], learned per-head sink logits (gpt-oss)
    moe: MoeWeights | None = None  # routed experts, in place of the dense MLP

    def nbytes(self) -> int:
        """Bytes of weight this block holds (a MoE layer: every expert's)."""
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
            self.bo,
            self.sinks,
        )
        experts = self.moe.nbytes() if self.moe is not None else 0
        return experts + sum(int(a.nbytes) for a in arrays if a is not None)


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


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _linear(source: ModelSource, blocks: bool, *names: str) -> Any:
    """Weights ``[out_i, in]`` stacked along ``out``, as the ``[in, out]`` of ``x @ w``:
    kept in their blocks where asked for and the kernels allow, else float32."""
    tensors = [source.tensor(n) for n in names]
    if blocks and all(supported(t) for t in tensors):
        return BlockMatrix(tensors)
    return _f32(_linear_t(source, *names))


def _layer(source: ModelSource, config: ModelConfig, i: int, blocks: bool) -> LayerWeights:
    p = f"layers.{i}."
    qkv = [f"{p}self_attn.{x}_proj" for x in "qkv"]
    bias = None
    if config.attention_bias:
        bias = _f32(np.concatenate([_get(source, n + ".bias") for n in qkv]))
    arch = config.arch

    def norm(name: str, present: bool = True) -> Any:
        return _f32(norm_weight(source, config, p + name + ".weight")) if present else None

    def linear(*names: str) -> Any:
        return _linear(source, blocks, *names)

    moe = None  # a mixture-of-experts layer: experts in place of the dense MLP
    if config.moe is not None and config.moe.is_sparse(i):
        moe = load_moe(source, config.moe, p, blocks=blocks)
    o_bias = p + "self_attn.o_proj.bias"
    return LayerWeights(
        attn_norm=norm("input_layernorm"),
        wqkv=linear(*(n + ".weight" for n in qkv)),
        bqkv=bias,
        wo=linear(p + "self_attn.o_proj.weight"),
        ffn_norm=norm(arch.ffn_norm),
        w_gate_up=None if moe else linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        w_down=None if moe else linear(p + "mlp.down_proj.weight"),
        q_norm=norm("self_attn.q_norm", arch.qk_norm),
        k_norm=norm("self_attn.k_norm", arch.qk_norm),
        post_attn_norm=norm("post_attention_layernorm", arch.sandwich_norms),
        post_ffn_norm=norm("post_feedforward_layernorm", arch.sandwich_norms),
        bo=_f32(_get(source, o_bias)) if o_bias in source.tensor_names() else None,
        sinks=_f32(_get(source, p + "self_attn.sinks")) if arch.attention_sinks else None,
        moe=moe,
    )


def load_stage_weights(
    source: ModelSource,
    config: ModelConfig,
    start: int,
    end: int,
    *,
    embed: bool,
    head: bool,
    blocks: bool = False,
) -> StageWeights:
    """Lay out the tensors stage ``[start, end)`` needs from ``source`` for the CPU, in
    GGUF blocks where ``blocks`` (module docstring).

    Raises ``KeyError`` naming a missing tensor.
    """
    layers = [_layer(source, config, i, blocks) for i in range(start, end)]
    tied = config.tie_word_embeddings or "lm_head.weight" not in source.tensor_names()
    embed_t = None
    if embed or (head and tied):
        embed_t = _linear(source, blocks, "embed_tokens.weight")
    head_t = None
    if head and not tied:
        head_t = _linear(source, blocks, "lm_head.weight")
    norm = _f32(norm_weight(source, config, "norm.weight")) if head else None
    return StageWeights(start, end, layers, embed_t, norm, head_t)


@dataclass(frozen=True)
class HeldBytes:
    """Bytes a CPU stage holds for each layer, the embedding and the head (final norm plus
    an untied output matrix), as :func:`load_stage_weights` would lay them out."""

    layers: tuple[int, ...]
    embed: int
    head: int


def _held(t: RawTensor, blocks: bool) -> int:
    # a 3-D tensor stacks every expert's matrix: held as blocks where one expert's is
    if blocks and supported(t if len(t.shape) != 3 else expert_slice(t, 0)):
        return int(t.data.nbytes)  # the file's bytes, memory-mapped
    return 4 * int(np.prod(t.shape))  # dequantized to float32


def held_bytes(source: ModelSource, config: ModelConfig, *, blocks: bool) -> HeldBytes | None:
    """What a CPU stage holds of ``source`` (in GGUF blocks where ``blocks``), from the
    tensors' stored sizes; ``Backend.held_bytes`` asks it.

    None for hybrid models (their own footprint), or when the source lacks a layer's
    tensors (a stage-0 source fetched by byte ranges holds only its own part): the caller
    then estimates.
    """
    if config.hybrid is not None:
        return None
    names = source.tensor_names()
    per_layer = [0] * config.num_layers
    for name in names:
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            if i < config.num_layers:
                per_layer[i] += _held(source.tensor(name), blocks)
    if "embed_tokens.weight" not in names or not all(per_layer):
        return None
    embed = _held(source.tensor("embed_tokens.weight"), blocks)
    head = 4 * config.hidden_size
    if "lm_head.weight" in names and not config.tie_word_embeddings:
        head += _held(source.tensor("lm_head.weight"), blocks)
    return HeldBytes(tuple(per_layer), embed, head)
