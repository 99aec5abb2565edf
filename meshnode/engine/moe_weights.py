"""A mixture-of-experts layer's weights: the router, each expert's matrices, a shared expert.

Canonical tensor names (``meshnode_packaging.sources`` maps GGUF's and the checkpoints'
own names to these; ``p`` is ``layers.{i}.``):

- router ``p mlp.gate.weight`` ``[n, E]`` (gpt-oss: plus ``p mlp.gate.bias`` ``[n]``);
- experts either one tensor per expert, ``p mlp.experts.{e}.{gate,up,down}_proj.weight``
  (Qwen3-MoE, Mixtral, Qwen3.5-MoE checkpoints), or 3-D tensors stacking every expert,
  ``p mlp.experts.{gate,up,down}_proj.weight`` ``[n, out, in]`` with biases ``[n, out]``
  (GGUF's ``ffn_*_exps``), or ``p mlp.experts.gate_up_proj.weight`` ``[n, 2 I, E]``, gate
  rows then up rows (GGUF's ``ffn_gate_up_exps``), or gpt-oss's checkpoint layout,
  ``p mlp.experts.gate_up_proj`` ``[n, E, 2 I]`` (``x @ w``, gate and up interleaved:
  columns 0, 2, 4... are the gate), ``p mlp.experts.down_proj`` ``[n, I, E]`` and their
  ``_bias`` tensors (its MXFP4 checkpoints' ``*_blocks``/``*_scales`` reach here as GGUF's
  MXFP4 stacks: :mod:`meshnode_packaging.hf_mxfp4`);
- shared expert ``p mlp.shared_expert.{gate,up,down}_proj.weight`` and its gate
  ``p mlp.shared_expert_gate.weight`` ``[1, E]``.

Each expert becomes matrices like a dense MLP's (``gate_up`` ``[E, 2 I]`` gate then up,
``down`` ``[I, E]``, as ``x @ w`` multiplies them): in the file's blocks where asked for
(:class:`~meshnode.engine.cpu.BlockMatrix` views of one expert's slice of the memory-
mapped 3-D tensor: a token's product reads its k experts' bytes only), else float32.
In blocks, the stacks are also the layer's :class:`~meshnode.engine.cpu.experts.ExpertLayer`
(the compiled experts, SwiGLU or gpt-oss's clamped SwiGLU with biases). A checkpoint's
per-expert matrices are stacked at load (one copy in their stored format, each expert a
view of it), and gpt-oss's checkpoint layout, ``[in, out]`` and interleaved, is copied
as GGUF's fused stacks (de-interleaved, float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from meshnode_packaging.sources import ModelSource, RawTensor, dequantize

from meshnode.engine.cpu import BlockMatrix, supported
from meshnode.engine.cpu.experts import ExpertLayer, stack
from meshnode.engine.moe_config import MoeConfig

__all__ = ["ExpertWeights", "MoeWeights", "expert_slice", "load_moe", "matrix"]


@dataclass(frozen=True)
class ExpertWeights:
    """One expert (or the shared expert): a gated MLP, with biases where gpt-oss has them."""

    gate_up: Any  # [E, 2 I]: gate columns, then up
    down: Any  # [I, E]
    gate_up_bias: Any | None = None  # [2 I]
    down_bias: Any | None = None  # [E]

    def nbytes(self) -> int:
        """Bytes of this expert's weights."""
        parts = (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        return sum(int(a.nbytes) for a in parts if a is not None)


@dataclass(frozen=True)
class MoeWeights:
    """The feed-forward part of one mixture-of-experts layer."""

    router: Any  # [E, n]
    router_bias: Any | None  # [n] (gpt-oss)
    experts: tuple[ExpertWeights, ...]
    shared: ExpertWeights | None = None  # every token's expert (Qwen3.5-MoE)
    shared_gate: Any | None = None  # [E, 1]: sigmoid(x @ it) scales the shared expert
    # every expert at once, for the compiled path (engine.cpu.experts): GGUF's 3-D blocks
    # of SwiGLU experts without biases; the same views of the file as ``experts``
    stacked: ExpertLayer | None = None

    def nbytes(self) -> int:
        """Bytes of every expert, the router and the shared expert."""
        extra = (self.router, self.router_bias, self.shared_gate)
        shared = self.shared.nbytes() if self.shared is not None else 0
        return (
            sum(e.nbytes() for e in self.experts)
            + shared
            + sum(int(a.nbytes) for a in extra if a is not None)
        )


def expert_slice(t: RawTensor, e: int) -> RawTensor:
    """Expert ``e``'s ``[out, in]`` (or ``[out]``) part of a 3-D (2-D) stacked tensor, a
    view of its bytes (each expert's part is whole rows of whole blocks)."""
    count = t.shape[0]
    if not 0 <= e < count:
        raise IndexError(f"{t.name}: expert {e} outside 0..{count - 1}")
    size = t.data.nbytes // count
    return RawTensor(f"{t.name}[{e}]", t.dtype, t.shape[1:], t.data[e * size : (e + 1) * size])


def matrix(tensors: Sequence[RawTensor], blocks: bool) -> Any:
    """Tensors ``[out_i, in]`` stacked along ``out``, as the ``[in, out]`` of ``x @ w``:
    a block matrix where asked for and the kernels allow, else float32."""
    if blocks and all(supported(t) for t in tensors):
        return BlockMatrix(tensors)
    stacked = np.concatenate([dequantize(t) for t in tensors], axis=0)  # [out, in]
    return np.ascontiguousarray(stacked.T, dtype=np.float32)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class _Names:
    """Which canonical tensors of layer prefix ``p`` a source holds."""

    def __init__(self, source: ModelSource, p: str) -> None:
        self.source, self.p = source, p
        self.names = {n for n in source.tensor_names() if n.startswith(p)}
        # each tensor asked for once: a source may make it anew at each call (a
        # checkpoint's MXFP4 experts, repacked), and every expert slices the same one
        self.got: dict[str, RawTensor] = {}

    def has(self, name: str) -> bool:
        return self.p + name in self.names

    def get(self, name: str) -> RawTensor:
        if name not in self.got:
            self.got[name] = self.source.tensor(self.p + name)
        return self.got[name]

    def optional(self, name: str) -> np.ndarray | None:
        return _f32(dequantize(self.get(name))) if self.has(name) else None

    def derive(self, name: str, data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
        """Hand out ``data`` (the bytes of a ``dtype`` tensor of ``shape``) as ``name``."""
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self.got[name] = RawTensor(self.p + name, dtype, shape, raw)
        self.names.add(self.p + name)


def _per_expert(n: _Names, e: int, blocks: bool) -> ExpertWeights:
    q = f"mlp.experts.{e}."
    gate, up, down = (n.get(f"{q}{x}_proj.weight") for x in ("gate", "up", "down"))
    return ExpertWeights(matrix([gate, up], blocks), matrix([down], blocks))


def _stacked_bias(n: _Names, names: Sequence[str], e: int) -> np.ndarray | None:
    if not all(n.has(x) for x in names):
        return None
    return _f32(np.concatenate([dequantize(expert_slice(n.get(x), e)) for x in names]))


def _stacked(n: _Names, e: int, blocks: bool) -> ExpertWeights:
    """Expert ``e`` of GGUF's 3-D tensors (``[n, out, in]``), gate and up apart or fused."""
    fused = n.has("mlp.experts.gate_up_proj.weight")
    halves = ["gate_up"] if fused else ["gate", "up"]
    gate_up = [expert_slice(n.get(f"mlp.experts.{x}_proj.weight"), e) for x in halves]
    down = expert_slice(n.get("mlp.experts.down_proj.weight"), e)
    return ExpertWeights(
        matrix(gate_up, blocks),
        matrix([down], blocks),
        _stacked_bias(n, [f"mlp.experts.{x}_proj.bias" for x in halves], e),
        _stacked_bias(n, ["mlp.experts.down_proj.bias"], e),
    )


def _fuse_interleaved(n: _Names) -> None:
    """gpt-oss's checkpoint layout (``gate_up_proj`` ``[n, E, 2 I]``, ``x @ w``, gate and
    up interleaved; ``down_proj`` ``[n, I, E]``) as GGUF's fused stacks, once for every
    expert: ``gate_up_proj.weight`` ``[n, 2 I, E]`` (gate rows, then up), ``down_proj
    .weight`` ``[n, E, I]`` and the biases de-interleaved alike (float32 copies)."""
    x = "mlp.experts."
    gate_up = dequantize(n.get(f"{x}gate_up_proj"))  # [n, E, 2 I]
    down = dequantize(n.get(f"{x}down_proj"))  # [n, I, E]
    rows = np.concatenate([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], axis=2)  # [n, E, 2 I]
    count, e, two_i = rows.shape
    n.derive(f"{x}gate_up_proj.weight", _f32(rows.transpose(0, 2, 1)), "F32", (count, two_i, e))
    n.derive(f"{x}down_proj.weight", _f32(down.transpose(0, 2, 1)), "F32", (count, e, two_i // 2))
    if n.has(f"{x}gate_up_proj_bias"):
        b = dequantize(n.get(f"{x}gate_up_proj_bias"))  # [n, 2 I]
        fused = _f32(np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1))
        n.derive(f"{x}gate_up_proj.bias", fused, "F32", fused.shape)
    if n.has(f"{x}down_proj_bias"):
        d = _f32(dequantize(n.get(f"{x}down_proj_bias")))  # [n, E]
        n.derive(f"{x}down_proj.bias", d, "F32", d.shape)


def _stack_per_expert(n: _Names, count: int) -> None:
    """A checkpoint's per-expert matrices (``experts.{e}.{gate,up,down}_proj.weight``) as
    GGUF's 3-D stacks ``[n, out, in]`` in their stored format (one copy), so that they take
    the compiled experts; left per expert where the experts' tensors differ in kind."""
    x = "mlp.experts."
    for h in ("gate", "up", "down"):
        parts = [n.get(f"{x}{e}.{h}_proj.weight") for e in range(count)]
        kinds = {(t.dtype, tuple(t.shape)) for t in parts}
        if len(kinds) != 1:
            return
    for h in ("gate", "up", "down"):
        parts = [n.get(f"{x}{e}.{h}_proj.weight") for e in range(count)]
        data = np.stack([np.asarray(t.data).reshape(-1).view(np.uint8) for t in parts])
        n.derive(f"{x}{h}_proj.weight", data, parts[0].dtype, (count, *parts[0].shape))
        for e in range(count):  # each expert a view of the stack, not held twice
            del n.got[f"{x}{e}.{h}_proj.weight"]
            n.names.discard(f"{n.p}{x}{e}.{h}_proj.weight")


def _stacked_layer(n: _Names, config: MoeConfig) -> ExpertLayer | None:
    """The layer's experts as :class:`ExpertLayer` where its tensors are GGUF's 3-D
    blocks (gate and up apart or fused; biases where gpt-oss has them) and the kernels
    take them, else None."""
    x = "mlp.experts."
    halves = ["gate_up"] if n.has(f"{x}gate_up_proj.weight") else ["gate", "up"]
    names = [f"{x}{h}_proj.weight" for h in halves]
    if not all(n.has(a) for a in [*names, f"{x}down_proj.weight"]):
        return None
    gate_up = stack([n.get(a) for a in names])
    down = stack([n.get(f"{x}down_proj.weight")])
    if gate_up is None or down is None or gate_up.n_out % 32 or gate_up.n_out // 2 != down.n_in:
        return None
    biases = [f"{x}{h}_proj.bias" for h in halves]
    gate_up_bias = None
    if all(n.has(b) for b in biases):
        gate_up_bias = _f32(np.concatenate([dequantize(n.get(b)) for b in biases], axis=1))
    down_bias = n.optional(f"{x}down_proj.bias")
    clamp = None
    if config.glu == "clamped_swiglu":
        clamp = (config.swiglu_alpha, config.swiglu_limit)
    return ExpertLayer(gate_up, down, gate_up_bias, down_bias, clamp)


def _expert(n: _Names, e: int, blocks: bool) -> ExpertWeights:
    if n.has(f"mlp.experts.{e}.gate_proj.weight"):
        return _per_expert(n, e, blocks)
    return _stacked(n, e, blocks)


def _shared(n: _Names, blocks: bool) -> tuple[ExpertWeights | None, Any | None]:
    if not n.has("mlp.shared_expert.gate_proj.weight"):
        return None, None
    q = "mlp.shared_expert."
    gate, up, down = (n.get(f"{q}{x}_proj.weight") for x in ("gate", "up", "down"))
    expert = ExpertWeights(matrix([gate, up], blocks), matrix([down], blocks))
    return expert, matrix([n.get("mlp.shared_expert_gate.weight")], blocks)  # [E, 1]


def load_moe(source: ModelSource, config: MoeConfig, p: str, *, blocks: bool) -> MoeWeights:
    """The experts of the layer whose tensors are named ``p`` + ... (``layers.{i}.``).

    Raises ``KeyError`` naming a missing tensor and ``ValueError`` for a router of another
    size than the config's or a feature meshnode does not run (DeepSeek's score bias).
    """
    n = _Names(source, p)
    if n.has("mlp.gate.e_score_correction_bias"):
        raise ValueError(f"{p}: expert score-correction biases are not supported")
    router = n.get("mlp.gate.weight")
    if router.shape[0] != config.num_experts:
        raise ValueError(
            f"{p}mlp.gate.weight routes to {router.shape[0]} experts, not {config.num_experts}"
        )
    if n.has("mlp.experts.gate_up_proj"):  # gpt-oss's checkpoint layout
        _fuse_interleaved(n)
    elif blocks and n.has("mlp.experts.0.gate_proj.weight"):
        _stack_per_expert(n, config.num_experts)
    experts = tuple(_expert(n, e, blocks) for e in range(config.num_experts))
    shared, shared_gate = _shared(n, blocks)
    return MoeWeights(
        # in blocks too where asked for: a row's logits then do not depend on the batch
        router=matrix([router], blocks),  # [E, n]
        router_bias=n.optional("mlp.gate.bias"),
        experts=experts,
        shared=shared,
        shared_gate=shared_gate,
        stacked=_stacked_layer(n, config) if blocks else None,
    )
