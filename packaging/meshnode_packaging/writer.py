"""Write a layer package from any ``ModelSource`` (a GGUF file, a Hugging Face folder, ...).

Tensors keep the source's storage type unless a target ``dtype`` is asked for: a Q4_1 layer of
a GGUF stays Q4_1 blocks, so a package is never bigger than its source by more than the
tokenizer and the manifest. With ``dtype`` (``f16``, ``bf16``, ``f32``) every matrix is
dequantized and converted; 1-D tensors (norms, biases) become F32, as llama.cpp keeps them,
because they are tiny and precision-sensitive.

The manifest is written last, atomically: a folder without ``model-package.json`` is not a
package, so an interrupted write can never be mistaken for a finished one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from meshnode_packaging.errors import InvalidPackage
from meshnode_packaging.manifest import (
    EMBED_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEAD_FILE,
    MANIFEST_NAME,
    TOKENIZER_FILE,
    Manifest,
    layer_file,
)
from meshnode_packaging.sources import (
    ModelSource,
    RawTensor,
    dequantize,
    open_source,
    sampling_defaults,
)
from meshnode_packaging.tensorfile import FileDigest, write_tensor_file
from meshnode_packaging.transfer import ProgressFn
from meshnode_packaging.validate import manifest_problems, sha256_file

TargetDType = Literal["f16", "bf16", "f32"]
"""``progress(done, total)`` in tensors written (reading a tensor twice to count bytes first
would cost a second pass over a GGUF's un-permuted Q/K rows)."""

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")
_EMBED_TENSORS = ("embed_tokens.weight",)
_HEAD_TENSORS = ("norm.weight", "lm_head.weight")
# The checkpoint's multi-token-prediction module (Qwen3.5, Qwen3-Next): the last stage runs
# it after the head, so its tensors travel in the head's file.
_HEAD_PREFIXES = ("mtp.",)


def to_bf16_bits(x: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint16]]:
    """float32 → bfloat16 bit patterns, rounding to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    nan = np.isnan(x)
    out = rounded.astype(np.uint16)
    out[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)  # keep NaN quiet
    return out


def convert(t: RawTensor, dtype: TargetDType | None) -> RawTensor:
    """``t`` in the package's storage type: unchanged without ``dtype``, else converted."""
    if dtype is None:
        return t
    target = "F32" if len(t.shape) < 2 or dtype == "f32" else dtype.upper()
    if t.dtype == target:
        return t
    x = dequantize(t)
    data: np.ndarray[Any, Any]
    if target == "F32":
        data = np.ascontiguousarray(x, dtype=np.float32)
    elif target == "F16":
        data = x.astype(np.float16)
    else:
        data = to_bf16_bits(x)
    return RawTensor(t.name, target, t.shape, data.reshape(-1).view(np.uint8))


def group_tensors(
    names: Iterable[str], num_layers: int
) -> tuple[list[str], list[list[str]], list[str]]:
    """Split canonical tensor names into (embed, per-layer, head) groups, in source order."""
    embed: list[str] = []
    layers: list[list[str]] = [[] for _ in range(num_layers)]
    head: list[str] = []
    unplaced: list[str] = []
    for name in names:
        if m := _LAYER_NAME.match(name):
            i = int(m.group(1))
            (layers[i] if i < num_layers else unplaced).append(name)
        elif name in _EMBED_TENSORS:
            embed.append(name)
        elif name in _HEAD_TENSORS or name.startswith(_HEAD_PREFIXES):
            head.append(name)
        else:
            unplaced.append(name)
    if unplaced:
        # A tensor that belongs to no part would silently vanish from every stage.
        raise ValueError(f"tensors with no place in a layer package: {unplaced}")
    return embed, layers, head


def parse_strategy(text: str) -> tuple[str, dict[str, Any]]:
    """``"NAME:type=ngram,policy=adaptive,initial_window=4,min_window=1,max_window=8,k=v"``.

    ``policy`` and the ``*_window`` keys form the ``window_policy``; other keys are the
    strategy's parameters (integers where they parse as integers), e.g. ``draft=REF``.
    """
    name, sep, body = text.partition(":")
    if not sep or not name:
        raise ValueError(f"strategy must look like NAME:type=...,key=value, got {text!r}")
    fields: dict[str, Any] = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"strategy field {item!r} is not key=value")
        fields[key.strip()] = int(value) if re.fullmatch(r"-?\d+", value) else value.strip()
    policy = {
        "default": fields.pop("policy", "fixed"),
        "initial_window": fields.pop("initial_window", 4),
        "min_window": fields.pop("min_window", 1),
        "max_window": fields.pop("max_window", 8),
    }
    if "type" not in fields:
        raise ValueError(f"strategy {name!r} needs type=ngram or type=draft-model")
    return name, {**fields, "window_policy": policy}


def speculative_block(default: str, strategies: list[str]) -> dict[str, Any]:
    """``generation.speculative_decoding`` from a default name and ``parse_strategy`` texts."""
    parsed = dict(parse_strategy(s) for s in strategies)
    if default not in parsed:
        raise ValueError(f"default strategy {default!r} is not among {sorted(parsed)}")
    return {"default": default, "strategies": parsed}


def _kv_bytes(config: dict[str, Any]) -> dict[str, int]:
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    elements = 2 * kv_heads * head_dim  # K and V, per token, per layer
    return {"f32": 4 * elements, "f16": 2 * elements, "bf16": 2 * elements}


def recurrent_layer(config: dict[str, Any], layer: int) -> dict[str, Any]:
    """Extra keys of a hybrid model's Gated DeltaNet layer entry (nothing for others).

    Such a layer keeps no KV cache (``kv_cache: false``) but a fixed state per sequence:
    ``recurrent_state_bytes`` float32 bytes (the conv window, ``K - 1`` rows of the
    ``2 Hk Dk + Hv Dv`` conv channels, plus the ``Hv`` delta-rule matrices ``Dk x Dv``),
    whatever the sequence's length. Runtimes may keep snapshots of it (meshnode: a ring).
    """
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    types = text.get("layer_types") or []
    if layer >= len(types) or types[layer] != "linear_attention":
        return {}
    kh, vh = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    kd, vd = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
    taps = int(text.get("linear_conv_kernel_dim", 4)) - 1
    conv = taps * (2 * kh * kd + vh * vd)
    return {"kv_cache": False, "recurrent_state_bytes": 4 * (conv + vh * kd * vd)}


def _token_ids(config: dict[str, Any]) -> dict[str, Any]:
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": eos_ids[0] if eos_ids else None,
        "eos_token_ids": eos_ids,
        "pad_token_id": config.get("pad_token_id"),
    }


def _source_info(path: Path | None, repo: str | None, revision: str | None) -> dict[str, Any]:
    file: Path | None = path
    if path is not None and path.is_dir():
        weights = sorted(path.glob("*.safetensors"))
        file = weights[0] if len(weights) == 1 else None
    return {
        "repo": repo,
        "revision": revision,
        "file": None if file is None else file.name,
        "sha256": None if file is None else sha256_file(file),
    }


class _PartWriter:
    """Writes part files and records their entries, reporting progress in tensors written."""

    def __init__(
        self,
        src: ModelSource,
        out: Path,
        dtype: TargetDType | None,
        total: int,
        progress: ProgressFn | None,
    ) -> None:
        self.src, self.out, self.dtype = src, out, dtype
        self.files: dict[str, dict[str, Any]] = {}
        self.done, self.total, self.progress = 0, total, progress

    def write(self, rel: str, names: list[str]) -> dict[str, Any]:
        tensors = []
        for name in names:
            raw = self.src.tensor(name)
            self.done += 1
            tensors.append(convert(raw, self.dtype))
        digest = write_tensor_file(self.out / rel, tensors)
        self._record(rel, digest)
        if self.progress is not None:
            self.progress(self.done, self.total)
        return {"file": rel, "tensors": names, "weight_bytes": sum(t.data.nbytes for t in tensors)}

    def write_text(self, rel: str, text: str) -> None:
        path = self.out / rel
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        self._record(rel, FileDigest(path.stat().st_size, sha256_file(path)))

    def _record(self, rel: str, digest: FileDigest) -> None:
        self.files[rel] = {"size": digest.size, "sha256": digest.sha256}


def write_package(
    src: str | Path | ModelSource,
    out: str | Path,
    *,
    dtype: TargetDType | None = None,
    speculative: dict[str, Any] | None = None,
    model_id: str | None = None,
    source_repo: str | None = None,
    source_revision: str | None = None,
    progress: ProgressFn | None = None,
) -> Manifest:
    """Write the package of ``src`` (a path for ``open_source``, or a source) into ``out``.

    Returns the manifest written to ``out/model-package.json``. Raises ``ValueError`` for a
    source with tensors that fit no part or without a tokenizer (a package always carries
    one), :class:`InvalidPackage` if the result would not validate (e.g. a malformed
    ``speculative`` block).
    """
    src_path = None if not isinstance(src, str | Path) else Path(src)
    source = open_source(src_path) if src_path is not None else src
    assert not isinstance(source, str | Path)
    tokenizer_json = source.tokenizer_json
    if tokenizer_json is None:
        raise ValueError("the model has no tokenizer.json: a layer package needs one")
    config = dict(source.config)
    names = source.tensor_names()
    embed, layers, head = group_tensors(names, int(config["num_hidden_layers"]))
    total = len(names)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    pw = _PartWriter(source, folder, dtype, total, progress)
    embed_entry = pw.write(EMBED_FILE, embed)
    layer_entries = [
        {**pw.write(layer_file(i), group), "start": i, "end": i + 1, **recurrent_layer(config, i)}
        for i, group in enumerate(layers)
    ]
    head_entry = {**pw.write(HEAD_FILE, head), "tied_to_embed": "lm_head.weight" not in head}
    pw.write_text(TOKENIZER_FILE, tokenizer_json)
    default_id = src_path.stem if src_path is not None else config.get("model_type", "model")
    data: dict[str, Any] = {
        "format": {"name": FORMAT_NAME, "version": FORMAT_VERSION},
        "model": {
            "id": model_id or str(config.get("_name_or_path") or default_id),
            "architecture": str(config["model_type"]),
            "source": _source_info(src_path, source_repo, source_revision),
        },
        "config": config,
        "files": pw.files,
        "embed": embed_entry,
        "layers": layer_entries,
        "head": head_entry,
        "kv_bytes_per_token_per_layer": _kv_bytes(config),
        "tokenizer": {"file": TOKENIZER_FILE, **_token_ids(config)},
        "chat_template": source.chat_template,
    }
    generation: dict[str, Any] = {}
    if speculative is not None:
        generation["speculative_decoding"] = speculative
    if sampling := sampling_defaults(source):
        generation["sampling"] = sampling
    if generation:
        data["generation"] = generation
    manifest = Manifest(data)
    problems = manifest_problems(manifest)
    if problems:
        raise InvalidPackage(problems)
    pw.write_text(MANIFEST_NAME, manifest.dumps())
    del pw.files[MANIFEST_NAME]  # the manifest does not list itself
    return manifest
