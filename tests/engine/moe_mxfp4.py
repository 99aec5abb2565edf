"""MXFP4 twins of the tiny gpt-oss reference (``tests/golden/moe/gpt-oss-tiny``).

:func:`write_mxfp4_twins` quantizes the reference's expert matrices to MXFP4 (OCP
microscaling: a power-of-two scale per 32 values, E2M1 codes) and writes the same model
three ways:

- ``float``: a Hugging Face folder in the reference's float32 layout whose experts hold
  the MXFP4 values decoded (every E2M1 value times a power of two is exact in float32);
- ``hf``: a folder in gpt-oss's real checkpoint layout, ``*_blocks``/``*_scales`` uint8
  tensors and ``quantization_config`` ``mxfp4``;
- ``gguf``: a GGUF as llama.cpp's converter writes gpt-oss, ``ffn_{gate,up,down}_exps``
  of GGML type MXFP4 (the rest float32).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from meshnode_packaging.sources import mxfp4_from_hf
from safetensors.numpy import load_file, save_file

from tests.engine.moe_models import MOE_DIR, _config, _layer, _metadata

__all__ = ["decode_hf_mxfp4", "quantize_mxfp4", "write_mxfp4_twins"]

MODEL = "gpt-oss-tiny"
# E2M1 magnitudes by code (OCP MX spec, table of FP4 E2M1); code | 8 is the negative
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hugging Face MXFP4 ``(blocks [..., out, in / 32, 16], scales [..., out, in / 32])``
    of float ``w`` ``[..., out, in]``: the OCP rule (scale ``2**(floor(log2 amax) - 2)``,
    each value to its nearest E2M1 magnitude, clamped at 6)."""
    groups = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)  # [..., out, in / 32, 32]
    amax = np.abs(groups).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, 0)
    exp = np.clip(exp, -127, 127)  # E8M0 holds 2**-127 .. 2**127
    scaled = np.abs(groups) / np.exp2(exp)[..., None]
    code = np.abs(scaled[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    code |= (groups < 0).astype(np.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # value 2 j low, 2 j + 1 high
    # C order: safetensors writes an array's memory as it lies
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exp + 127, np.uint8)


def decode_hf_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., out, in]`` of a Hugging Face MXFP4 pair, from the definition."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*scales.shape, 32)
    values = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    out = values * np.exp2(scales.astype(np.float64) - 127)[..., None]
    decoded: np.ndarray = out.reshape(*scales.shape[:-1], -1).astype(np.float32)
    return decoded


def _quantized(t: dict[str, np.ndarray], p: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Layer ``p``'s expert matrices as HF MXFP4 pairs, ``[n, out, in]`` (gate_up's rows
    interleaved, as gpt-oss stores them)."""
    gate_up = t[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [n, 2 I, E]
    down = t[p + "mlp.experts.down_proj"].transpose(0, 2, 1)  # [n, E, I]
    return {"gate_up_proj": quantize_mxfp4(gate_up), "down_proj": quantize_mxfp4(down)}


def write_mxfp4_twins(folder: Path) -> dict[str, Path]:
    """The three twins (``float``, ``hf``, ``gguf``) under ``folder``; returns their paths."""
    ref = MOE_DIR / MODEL
    c = _config(ref)
    t = load_file(str(ref / "model.safetensors"))
    floats, hf = dict(t), dict(t)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, (blocks, scales) in _quantized(t, p).items():
            floats[p + f"mlp.experts.{name}"] = np.ascontiguousarray(
                decode_hf_mxfp4(blocks, scales).transpose(0, 2, 1)
            )
            del hf[p + f"mlp.experts.{name}"]
            hf[p + f"mlp.experts.{name}_blocks"] = blocks
            hf[p + f"mlp.experts.{name}_scales"] = scales
    paths = {"float": folder / "float", "hf": folder / "hf", "gguf": folder / "mxfp4.gguf"}
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    for kind, tensors, extra in (("float", floats, {}), ("hf", hf, quantization)):
        paths[kind].mkdir()
        save_file(tensors, str(paths[kind] / "model.safetensors"))
        config = c | ({"quantization_config": extra} if extra else {})
        (paths[kind] / "config.json").write_text(json.dumps(config))
        shutil.copy(ref / "generation_config.json", paths[kind])
    _write_gguf(floats, hf, c, paths["gguf"])
    return paths


def _write_gguf(
    floats: dict[str, np.ndarray], hf: dict[str, np.ndarray], c: dict[str, Any], path: Path
) -> None:
    w = gguf.GGUFWriter(path, "gpt-oss")
    _metadata(w, "gpt-oss", c)
    w.add_tensor("token_embd.weight", floats["model.embed_tokens.weight"])
    w.add_tensor("output.weight", floats["lm_head.weight"])
    w.add_tensor("output_norm.weight", floats["model.norm.weight"])
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = hf[p + "gate_up_proj_blocks"], hf[p + "gate_up_proj_scales"]
        experts = {  # convert_hf_to_gguf's GptOssModel: even rows the gate, odd rows up
            "ffn_gate_exps": (gate_up[0][:, 0::2], gate_up[1][:, 0::2]),
            "ffn_up_exps": (gate_up[0][:, 1::2], gate_up[1][:, 1::2]),
            "ffn_down_exps": (hf[p + "down_proj_blocks"], hf[p + "down_proj_scales"]),
        }
        for name, data in _layer(floats, c, "gpt-oss", i).items():
            key = name.removesuffix(".weight")
            if key in experts:
                rows = mxfp4_from_hf(*experts[key])  # [n, out, in / 32 * 17]
                w.add_tensor(f"blk.{i}.{name}", rows, raw_dtype=mxfp4)
            else:
                w.add_tensor(f"blk.{i}.{name}", np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
