"""A mixture-of-experts layer's chosen experts in one compiled call per thread.

Going through :class:`.BlockMatrix` one expert at a time costs a layer, per chosen expert,
two products' Python wrappers, the activation's, the gathers and the weighted add: for
the Qwen3-30B-A3B shape about a third of a decode step's expert time with the 8-bit
products (``benchmarks/realsize_moe.py``; 8 experts a row, 48 layers). Here every
chosen expert's gate/up product, SwiGLU and down product, and each row's weighted sum,
run in compiled code that calls the same product kernels as :class:`.BlockMatrix` (the
exact ones, :func:`.kernels.product_kernel`, or the 8-bit ones,
:func:`.q8_kernels.product_kernel`, as :meth:`CpuBackend.linear` would choose) and the
same activation (:func:`.glu.glu`): each expert's output is the same bits as
:func:`meshnode.engine.moe.expert_mlp` gives for the same rows, and each row sums its
experts from zero in ascending expert order as :func:`meshnode.engine.moe.moe_mlp` does.

Experts come as stacks (:class:`ExpertStack`): a 3-D tensor of every expert's matrix as
the GGUF stores it (``ffn_*_exps``), a view of the memory-mapped file, so that a step
reads the chosen experts' bytes only. With several threads (the kernel threads of
:mod:`.pool`, one chosen expert a chunk, claimed as threads come free), each computes whole
experts, and the sums are made after, in the same order: the bits do not depend on the
thread count. (An earlier version split the experts into one run of about equal rows a
thread on the tile threads of :func:`.matrix.share`; those sleep between jobs, so each
layer woke one, and a late one held the layer up: see ``benchmarks/moe_token.py
--threads 2``.)

Layering: beside :mod:`.matrix` and :mod:`.q8`; the compiled functions are in
:mod:`.experts_kernels`, imported (with numba) at the first call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from meshnode_packaging.sources import RawTensor

from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.formats import format_of, row_bytes
from meshnode.engine.cpu.q8 import Q8_FORMATS

__all__ = ["ExpertLayer", "ExpertStack", "Routes", "group", "job_parts", "route", "stack"]


@dataclass(frozen=True)
class ExpertStack:
    """One matrix of every expert of a layer (``[in, out]`` for ``x @ w``, as
    :class:`.BlockMatrix`), in its blocks: up to three parts stacked along ``out`` (gate,
    up), each ``[n, out_i, row bytes]``, read-only."""

    fmts: tuple[int, int, int]  # kernel ids; an unused part repeats the first
    raws: tuple[np.ndarray, np.ndarray, np.ndarray]  # an unused part is [n, 0, 0]
    n_in: int
    n_out: int

    def q8(self) -> bool:
        """Whether the 8-bit kernels take this matrix (as :func:`.q8.accepts`)."""
        return self.n_in % 64 == 0 and all(f in Q8_FORMATS for f in self.fmts)


def stack(tensors: Sequence[RawTensor]) -> ExpertStack | None:
    """The 3-D tensors ``[n, out_i, in]`` stacked along ``out`` as an :class:`ExpertStack`;
    None when the kernels cannot take them (a format or a row length they do not)."""
    if not 1 <= len(tensors) <= 3 or any(len(t.shape) != 3 for t in tensors):
        return None
    n, n_in = tensors[0].shape[0], tensors[0].shape[2]
    fmts, raws = [], []
    for t in tensors:
        fmt = format_of(t.dtype)
        if fmt is None or t.shape[0] != n or t.shape[2] != n_in:
            return None
        if n_in % fmt.block_size or n_in % 32:
            return None
        raw = np.asarray(t.data).reshape(n, t.shape[1], row_bytes(fmt, n_in)).view()
        raw.flags.writeable = False
        fmts.append(fmt.kernel_id)
        raws.append(raw)
    empty = np.zeros((n, 0, 0), np.uint8)
    empty.flags.writeable = False
    ids = fmts + [fmts[0]] * (3 - len(fmts))
    a, b, c = raws + [empty] * (3 - len(raws))
    n_out = sum(t.shape[1] for t in tensors)
    return ExpertStack((ids[0], ids[1], ids[2]), (a, b, c), n_in, n_out)


def group(picks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows ``picks`` ``[r, k]`` send to each expert: the experts chosen, ascending
    ``[m]``; where each one's entries start in ``order`` ``[m + 1]``; and ``order``
    ``[r k]``, the flat indices ``row k + slot`` grouped by expert, rows ascending."""
    flat = picks.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, counts = np.unique(flat[order], return_counts=True)
    starts = np.zeros(experts.size + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    return experts.astype(np.int64), starts, order.astype(np.int64)


@dataclass(frozen=True)
class Routes:
    """A layer's routing of ``r`` rows: each row's experts ``picks`` ``[r, k]`` and
    weights ``[r, k]`` (float32), and :func:`group`'s grouping of them (``chosen``,
    ``starts``, ``order``)."""

    picks: np.ndarray
    weights: np.ndarray
    chosen: np.ndarray
    starts: np.ndarray
    order: np.ndarray


def route(logits: np.ndarray, k: int, topk_softmax: bool, norm: bool) -> Routes:
    """:func:`meshnode.engine.moe.route` of router ``logits`` ``[r, n]`` then
    :func:`group`, the same bits, in one compiled call
    (:func:`.experts_route.route_group`); the arguments are the routing config's
    (``topk_softmax``: gpt-oss's rule, ``norm``: ``norm_topk_prob``)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))  # [r, n]: ops.softmax's
    rows, n = logits.shape
    picks = np.empty((rows, k), np.int64)
    weights = np.empty((rows, k), np.float32)
    chosen = np.empty(n, np.int64)
    starts = np.empty(n + 1, np.int64)
    order = np.empty(rows * k, np.int64)
    m = _routing().route_group(logits, e, topk_softmax, norm, picks, weights, chosen, starts, order)
    return Routes(picks, weights, chosen[:m], starts[: m + 1], order)


@functools.cache
def _routing() -> ModuleType:
    """:mod:`.experts_route`, imported (numba configured first) at the first call."""
    matrix.kernels()
    from meshnode.engine.cpu import experts_route

    return experts_route


@functools.cache
def _compiled() -> ModuleType:
    """:mod:`.experts_kernels`, imported (numba configured first) at the first call."""
    matrix.kernels()
    from meshnode.engine.cpu import experts_kernels

    return experts_kernels


class ExpertLayer:
    """Every expert of one layer as stacks: gate/up ``[E, 2 I]`` (gate columns, then up)
    and down ``[I, E]``, their biases ``[n, 2 I]`` and ``[n, E]`` where the model has them
    (gpt-oss), and between them SwiGLU or, given ``clamp`` ``(alpha, limit)``, gpt-oss's
    clamped SwiGLU (:func:`.glu.clamped_glu`)."""

    def __init__(
        self,
        gate_up: ExpertStack,
        down: ExpertStack,
        gate_up_bias: np.ndarray | None = None,
        down_bias: np.ndarray | None = None,
        clamp: tuple[float, float] | None = None,
    ) -> None:
        if gate_up.n_out % 32 or gate_up.n_out // 2 != down.n_in:
            raise ValueError(f"experts of {gate_up.n_out // 2} and {down.n_in} do not chain")
        n = gate_up.raws[0].shape[0]
        self.gate_up, self.down = gate_up, down
        self.gate_up_bias = _bias(gate_up_bias, n, gate_up.n_out, "gate/up")
        self.down_bias = _bias(down_bias, n, down.n_out, "down")
        self.kind = 0 if clamp is None else 1  # experts_kernels: SwiGLU, or clamped
        self.alpha, self.limit = clamp or (0.0, 0.0)

    def keys(self, q8: bool) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
        """The compiled experts' formats of gate/up and down (as
        :func:`.experts_kernels.experts_chunk` takes them): each stack's formats and
        whether its products are the 8-bit ones (``q8``, where the kernels take it)."""
        gu, dn = self.gate_up, self.down
        return (*gu.fmts, int(q8 and gu.q8())), (*dn.fmts, int(q8 and dn.q8()))

    def __call__(
        self,
        x: np.ndarray,
        picks: np.ndarray,
        weights: np.ndarray,
        q8: bool,
        routes: Routes | None = None,
    ) -> Any:
        """The layer's output ``[r, E]`` for rows ``x`` ``[r, E]``, each sent to experts
        ``picks`` ``[r, k]`` with ``weights`` ``[r, k]``; ``q8``: the 8-bit products where
        they take a matrix (``--dtype q8``), else the exact ones; ``routes``: the rows'
        grouping when :func:`route` made it (else :func:`group` makes it)."""
        gu, dn = self.gate_up, self.down
        compiled = _compiled()
        gu_key, dn_key = self.keys(q8)
        experts = compiled.experts_kernel(gu_key, dn_key)
        x = np.ascontiguousarray(x, dtype=np.float32)
        picks = np.ascontiguousarray(picks, dtype=np.int64)
        rows, k = picks.shape
        if routes is None:
            chosen, starts, order = group(picks)
        else:
            chosen, starts, order = routes.chosen, routes.starts, routes.order
        ys = np.empty((rows * k, x.shape[1]), np.float32)
        act = (self.gate_up_bias, self.down_bias, self.kind, self.alpha, self.limit)
        args = (*gu.raws, *dn.raws, *act, x, chosen, starts, order, k, ys)
        threads = matrix.shared_threads() if chosen.size > 1 else 1
        if threads < 2 or not _shared(compiled, gu_key, dn_key, args, threads):
            experts(*args)
        out = np.empty_like(x)
        compiled.sums(ys, picks, np.ascontiguousarray(weights, dtype=np.float32), out)
        return out


def _bias(bias: np.ndarray | None, n: int, width: int, name: str) -> np.ndarray:
    """Every expert's bias ``[n, width]`` as the kernel takes it (float32, C order; no
    bias: ``[n, 0]``)."""
    if bias is None:
        return np.zeros((n, 0), np.float32)
    if bias.shape != (n, width):
        raise ValueError(f"{name} biases of shape {bias.shape}, not {(n, width)}")
    return np.ascontiguousarray(bias, dtype=np.float32)


_NO_OUT = np.zeros((1, 1), np.float32)  # a shared call's "output" (ys is its own)
_EMPTY = np.zeros((0, 0), np.uint8)


def _shared(
    compiled: ModuleType,
    gate_up: tuple[int, int, int, int],
    down: tuple[int, int, int, int],
    args: tuple[Any, ...],
    threads: int,
) -> bool:
    """:func:`.experts_kernels.experts_kernel`'s call of ``args`` shared with the kernel
    threads of :mod:`.pool`, one chosen expert a chunk; False, having done nothing, where
    the pool does not take it (the caller then makes the call)."""
    block = np.zeros(compiled.BLOCK_WORDS, np.int64)
    compiled.fill_block(block, *args)
    chunk = compiled.experts_chunk(gate_up, down)
    pool = matrix._pool()
    return bool(pool.run(chunk, job_parts(args[12].size), block, _NO_OUT, threads, keep=args))


@functools.cache
def job_parts(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The parts a job of ``m`` chosen experts is posted with: a dummy first part of ``m
    * TASK_ROWS`` rows (one expert a chunk, the pool's rows; read-only, no chunk reads it)
    and two empty ones. The same arrays for every job of ``m`` experts, so that the pool
    plans their posts once (it keeps a plan while a product's parts are the same arrays)."""
    tasks = np.zeros((m * _compiled().TASK_ROWS, 1), np.uint8)
    tasks.flags.writeable = False
    return tasks, _EMPTY, _EMPTY
