"""A stage's weights uploaded to the device in their device formats.

Linear weights are :class:`~meshnode.engine.cuda.device.DeviceMatrix` ``[out, in]`` rows
(Q/K/V and gate/up fused, as on the CPU). With float16/bfloat16 weights, tensors stored
as Q8_0 or Q4_K stay in their GGML blocks; every other tensor is dequantized on the host
and stored in the dense dtype. Norms (with the family's ``norm_offset`` added, as on the
CPU), biases and RoPE frequencies are float32.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Literal

import numpy as np
from meshnode_packaging.sources import ModelSource, RawTensor, dequantize

from meshnode.engine.config import ModelConfig
from meshnode.engine.cuda.device import DeviceMatrix
from meshnode.engine.cuda.formats import QUANT_FORMATS, Format, encode_dense, row_bytes
from meshnode.engine.weights import LayerWeights, StageWeights, norm_weight

__all__ = ["DeviceDtype", "device_dtype", "load_cuda_stage_weights"]

DeviceDtype = Literal["float32", "float16", "bfloat16"]

_DENSE: dict[DeviceDtype, Format] = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def device_dtype(requested: str, source: ModelSource) -> DeviceDtype:
    """The weight dtype for ``source``: ``requested``, or for ``auto`` bfloat16 where the
    model was trained in it (``torch_dtype``/``dtype`` in its config) and float16 otherwise."""
    if requested in ("float32", "float16", "bfloat16"):
        return requested  # type: ignore[return-value]
    trained = source.config.get("torch_dtype") or source.config.get("dtype")
    return "bfloat16" if str(trained) == "bfloat16" else "float16"


def _matrix(cp: ModuleType, tensors: list[RawTensor], dtype: DeviceDtype) -> DeviceMatrix:
    """Tensors ``[out_i, in]`` stacked along ``out`` as one device matrix."""
    inp = tensors[0].shape[1]
    out = sum(t.shape[0] for t in tensors)
    kinds = {t.dtype for t in tensors}
    if dtype != "float32" and len(kinds) == 1 and (kind := kinds.pop()) in QUANT_FORMATS:
        fmt = QUANT_FORMATS[kind]
        rows = [np.asarray(t.data).reshape(t.shape[0], row_bytes(fmt, inp)) for t in tensors]
        return DeviceMatrix(cp.asarray(np.concatenate(rows)), fmt, out, inp)
    fmt = _DENSE[dtype]
    row_bytes(fmt, inp)  # the kernels decode whole units of 32: refuse other widths now
    w = np.concatenate([dequantize(t) for t in tensors])
    return DeviceMatrix(cp.asarray(encode_dense(w, fmt)), fmt, out, inp)


def _f32(cp: ModuleType, source: ModelSource, *names: str) -> Any:
    host = np.concatenate([dequantize(source.tensor(n)).reshape(-1) for n in names])
    return cp.asarray(host, dtype=cp.float32)


def _norm(cp: ModuleType, source: ModelSource, config: ModelConfig, name: str) -> Any:
    """An RMSNorm weight as the stage multiplies by it (``weights.norm_weight``)."""
    return cp.asarray(norm_weight(source, config, name), dtype=cp.float32)


def _layer(
    source: ModelSource, config: ModelConfig, i: int, cp: ModuleType, dtype: DeviceDtype
) -> LayerWeights:
    p = f"layers.{i}."
    qkv = [f"{p}self_attn.{x}_proj" for x in "qkv"]
    arch = config.arch

    def matrix(*names: str) -> DeviceMatrix:
        return _matrix(cp, [source.tensor(n) for n in names], dtype)

    def norm(name: str, present: bool = True) -> Any:
        return _norm(cp, source, config, p + name + ".weight") if present else None

    return LayerWeights(
        attn_norm=norm("input_layernorm"),
        wqkv=matrix(*(n + ".weight" for n in qkv)),
        bqkv=_f32(cp, source, *(n + ".bias" for n in qkv)) if config.attention_bias else None,
        wo=matrix(p + "self_attn.o_proj.weight"),
        ffn_norm=norm(arch.ffn_norm),
        w_gate_up=matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        w_down=matrix(p + "mlp.down_proj.weight"),
        q_norm=norm("self_attn.q_norm", arch.qk_norm),
        k_norm=norm("self_attn.k_norm", arch.qk_norm),
        post_attn_norm=norm("post_attention_layernorm", arch.sandwich_norms),
        post_ffn_norm=norm("post_feedforward_layernorm", arch.sandwich_norms),
    )


def load_cuda_stage_weights(
    source: ModelSource,
    config: ModelConfig,
    start: int,
    end: int,
    *,
    embed: bool,
    head: bool,
    cp: ModuleType,
    dtype: DeviceDtype,
) -> StageWeights:
    """Upload what stage ``[start, end)`` needs through ``cp`` (CuPy) in ``dtype`` (see
    :func:`device_dtype`); ``embed_t``/``head_t`` hold ``[V, E]`` rows.

    Raises ``KeyError`` naming a missing tensor, ``ValueError`` for a width the kernels
    cannot decode (not a multiple of 32).
    """
    layers = [_layer(source, config, i, cp, dtype) for i in range(start, end)]
    tied = config.tie_word_embeddings or "lm_head.weight" not in source.tensor_names()
    table = None
    if embed or (head and tied):
        table = _matrix(cp, [source.tensor("embed_tokens.weight")], dtype)
    head_t = None
    if head and not tied:
        head_t = _matrix(cp, [source.tensor("lm_head.weight")], dtype)
    norm = _norm(cp, source, config, "norm.weight") if head else None
    return StageWeights(start, end, layers, table, norm, head_t)
