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
gpt-oss's checkpoint layout is ``[in, out]`` already and interleaved, so it is copied
(de-interleaved) whichever way.
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


def _dense(rows: np.ndarray, name: str, blocks: bool) -> Any:
    """A float32 ``[out, in]`` array as :func:`matrix` holds it (F32 blocks if asked)."""
    rows = _f32(rows)
    raw = RawTensor(name, "F32", rows.shape, rows.reshape(-1).view(np.uint8))
    return matrix([raw], blocks)


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


def _interleaved(n: _Names, e: int, blocks: bool) -> ExpertWeights:
    """Expert ``e`` of gpt-oss's checkpoint layout (``[n, E, 2 I]``, gate/up interleaved)."""
    gate_up = dequantize(expert_slice(n.get("mlp.experts.gate_up_proj"), e))  # [E, 2 I]
    down = dequantize(expert_slice(n.get("mlp.experts.down_proj"), e))  # [I, E]
    rows = np.concatenate([gate_up[:, 0::2].T, gate_up[:, 1::2].T])  # [2 I, E]: gate, up
    bias = None
    if n.has("mlp.experts.gate_up_proj_bias"):
        b = dequantize(expert_slice(n.get("mlp.experts.gate_up_proj_bias"), e))
        bias = _f32(np.concatenate([b[0::2], b[1::2]]))
    down_bias = None
    if n.has("mlp.experts.down_proj_bias"):
        down_bias = _f32(dequantize(expert_slice(n.get("mlp.experts.down_proj_bias"), e)))
    name = f"{n.p}mlp.experts"
    return ExpertWeights(
        _dense(rows, f"{name}.gate_up[{e}]", blocks),
        _dense(down.T, f"{name}.down[{e}]", blocks),
        bias,
        down_bias,
    )


def _stacked_layer(n: _Names, config: MoeConfig) -> ExpertLayer | None:
    """The layer's experts as :class:`ExpertLayer` where its tensors are GGUF's 3-D
    blocks of SwiGLU experts without biases and the kernels take them, else None."""
    x = "mlp.experts."
    halves = ["gate_up"] if n.has(f"{x}gate_up_proj.weight") else ["gate", "up"]
    names = [f"{x}{h}_proj.weight" for h in halves]
    if config.glu != "silu" or not all(n.has(a) for a in [*names, f"{x}down_proj.weight"]):
        return None
    if any(n.has(f"{x}{h}_proj.bias") for h in [*halves, "down"]):
        return None
    gate_up = stack([n.get(a) for a in names])
    down = stack([n.get(f"{x}down_proj.weight")])
    if gate_up is None or down is None or gate_up.n_out % 32 or gate_up.n_out // 2 != down.n_in:
        return None
    return ExpertLayer(gate_up, down)


def _expert(n: _Names, e: int, blocks: bool) -> ExpertWeights:
    if n.has(f"mlp.experts.{e}.gate_proj.weight"):
        return _per_expert(n, e, blocks)
    if n.has("mlp.experts.gate_up_proj"):
        return _interleaved(n, e, blocks)
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
