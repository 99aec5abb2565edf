"""gpt-oss's MXFP4 experts in a Hugging Face folder, handed out as GGUF's stacked experts.

gpt-oss checkpoints store each layer's experts quantized (``config.json``'s
``quantization_config.quant_method`` ``mxfp4``; transformers' ``integrations/mxfp4.py``):

- ``mlp.experts.gate_up_proj_blocks`` ``uint8 [n, 2 I, E / 32, 16]`` and
  ``mlp.experts.gate_up_proj_scales`` ``uint8 [n, 2 I, E / 32]``: rows are output features,
  gate and up interleaved (even rows the gate, odd rows up, as the float layout's columns);
- ``mlp.experts.down_proj_blocks`` ``[n, E, I / 32, 16]`` and ``down_proj_scales``;
- float biases ``mlp.experts.gate_up_proj_bias`` ``[n, 2 I]`` (interleaved) and
  ``mlp.experts.down_proj_bias`` ``[n, E]``.

:func:`mxfp4_plan` names what a reader hands out instead: llama.cpp's converter's layout
(``convert_hf_to_gguf.py``, ``GptOssModel``), ``mlp.experts.{gate,up,down}_proj.weight``
``MXFP4 [n, out, in]`` in GGML blocks (:func:`.quants.mxfp4_from_hf`) and
``mlp.experts.{gate,up,down}_proj.bias``, so the engine loads the folder's experts as it
loads a GGUF's, each a :class:`~meshnode.engine.cpu.BlockMatrix` of its blocks.
:func:`derive` makes one. Repacking copies (GGML puts each block's scale before its
codes): a folder's experts are held in memory once, where a GGUF's stay memory-mapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from meshnode_packaging.quants import mxfp4_from_hf
from meshnode_packaging.source_types import RawTensor, SourceError

__all__ = ["Derived", "derive", "mxfp4_plan"]

_BLOCKS, _SCALES, _BIAS = "_blocks", "_scales", "_bias"
_GATE, _UP, _ALL = slice(0, None, 2), slice(1, None, 2), slice(None)
# stored matrix -> the tensors made from it, each with its rows (axis 1) of the stored one
_SPLITS = {
    "gate_up_proj": (("gate_proj", _GATE), ("up_proj", _UP)),
    "down_proj": (("down_proj", _ALL),),
}
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True)
class Derived:
    """A tensor made from stored ones: MXFP4 ``blocks``/``scales`` (a weight) or a float
    ``bias``, and which of their rows (axis 1) it takes."""

    stored: tuple[str, ...]  # (blocks, scales) or (bias,)
    rows: slice


def mxfp4_plan(names: Iterable[str]) -> dict[str, Derived]:
    """The tensors made from the MXFP4 expert tensors among canonical ``names``, by name
    (empty for a checkpoint without them)."""
    present = set(names)
    plan: dict[str, Derived] = {}
    for name in sorted(present):
        if not name.endswith(_BLOCKS):
            continue
        prefix, _, stored = name.removesuffix(_BLOCKS).rpartition(".")
        if stored not in _SPLITS or prefix + "." + stored + _SCALES not in present:
            continue
        base = f"{prefix}.{stored}"
        for made, rows in _SPLITS[stored]:
            plan[f"{prefix}.{made}.weight"] = Derived((base + _BLOCKS, base + _SCALES), rows)
            if base + _BIAS in present:
                plan[f"{prefix}.{made}.bias"] = Derived((base + _BIAS,), rows)
    return plan


def derive(name: str, d: Derived, stored: Callable[[str], RawTensor]) -> RawTensor:
    """The tensor ``name`` that ``d`` describes, from the ``stored`` tensors (a copy).
    Raises :class:`SourceError` for stored tensors of the wrong type or shape."""
    if len(d.stored) == 1:
        return _bias(name, stored(d.stored[0]), d.rows)
    blocks, scales = (stored(s) for s in d.stored)
    if blocks.dtype != "U8" or scales.dtype != "U8" or len(blocks.shape) != 4:
        raise SourceError(
            f"{blocks.name}: MXFP4 blocks are uint8 [n, out, in / 32, 16], "
            f"got {blocks.dtype} {list(blocks.shape)}"
        )
    codes = blocks.data.reshape(blocks.shape)[:, d.rows]  # [n, out, in / 32, 16]
    scale = scales.data.reshape(scales.shape)[:, d.rows]  # [n, out, in / 32]
    packed = mxfp4_from_hf(codes, scale)  # [n, out, in / 32 * 17]
    n, out, groups = scale.shape
    return RawTensor(name, "MXFP4", (n, out, groups * 32), packed.reshape(-1))


def _bias(name: str, t: RawTensor, rows: slice) -> RawTensor:
    if t.dtype not in _ITEM_BYTES or len(t.shape) != 2:
        raise SourceError(f"{t.name}: expected a float [n, out] bias, got {t.dtype}")
    item = t.data.view(f"<u{_ITEM_BYTES[t.dtype]}").reshape(t.shape)[:, rows]  # [n, out']
    data = np.ascontiguousarray(item).view(np.uint8).reshape(-1)
    return RawTensor(name, t.dtype, item.shape, data)
