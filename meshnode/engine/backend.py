"""The array backend, chosen once: NumPy (float32) on CPU, CuPy on a CUDA device.

A :class:`Backend` is a strategy object: :class:`CpuBackend` and :class:`CudaBackend` each
own their weight layout and loading (``meshnode.engine.weights``,
``meshnode.engine.cuda.weights``), every array operation of ``model.Stage``'s one block
(products with the weights, norms, the gated MLP's activation, the embedding, attention:
NumPy and numba kernels on the CPU, the engine's CUDA kernels through ``cuda.ops``), the
KV cache, how a forward runs (``runner``: at once, or replayed as a CUDA graph) and the
copy back to the host; the stage asks its backend and never tests which one it has.
CuPy is imported only when a CUDA backend is asked for.
"""

from __future__ import annotations

import functools
import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import ModuleType
from typing import Any, ClassVar, Literal, cast, get_args

import numpy as np
from meshnode_packaging.sources import ModelSource

from meshnode.engine import ops
from meshnode.engine.attention import Attention, KernelAttention
from meshnode.engine.config import ModelConfig, ModelConfigError
from meshnode.engine.cpu import BlockMatrix, dense_product, q8, set_kernel_threads
from meshnode.engine.cpu import moe_step as cpu_moe_step
from meshnode.engine.cpu.matrix import by_rows
from meshnode.engine.cuda.device import DeviceMatrix, PinnedStaging
from meshnode.engine.cuda.graphs import GraphRunner
from meshnode.engine.cuda.kernels import BLOCK, MAX_HEAD_DIM
from meshnode.engine.cuda.ops import CudaAttention, CudaOps
from meshnode.engine.cuda.weights import device_dtype, load_cuda_stage_weights
from meshnode.engine.kv_cache import KVCache, kv_numpy_dtype
from meshnode.engine.moe_config import MoeConfig
from meshnode.engine.runner import EagerRunner, Runner
from meshnode.engine.weights import HeldBytes, StageWeights, held_bytes, load_stage_weights
from meshnode.errors import MeshnodeError

__all__ = [
    "Backend",
    "BackendError",
    "CpuBackend",
    "CudaBackend",
    "Device",
    "WeightsDtype",
    "cpu_backend",
    "cuda_free_memory",
    "select_backend",
]

log = logging.getLogger(__name__)

Device = Literal["auto", "cpu", "cuda"]
# A layer's feed-forward half of a one-row step in one call (Backend.moe_step)
MoeStep = Callable[[Any, Any, Any], "tuple[Any, Any] | None"]
# Weights on the device: ``auto`` is bfloat16 where the model's config says it was trained
# in bfloat16, else float16; float32 is the golden-parity mode. On the CPU, ``native``
# keeps the file's GGUF blocks in memory, multiplied by compiled kernels in float32
# (meshnode.engine.cpu, the exact mode: the golden references hold bit for bit); ``q8``
# (the fast mode) keeps the same blocks and multiplies quantized ones with activations
# quantized to 8 bits, llama.cpp's own arithmetic (meshnode.engine.cpu.q8: inexact, about
# 1.4-1.8x the exact mode's speed on a 1B model, README "Performance"), F32/F16/BF16
# weights exactly as ``native`` does. ``auto`` is ``q8`` on the CPU: a float checkpoint
# computes exactly in it all the same, with f16 K/V (``kv_cache.resolve_kv_dtype``).
# ``float32`` dequantizes at load (NumPy/BLAS), for parity debugging. On CUDA, ``native``
# is ``auto`` and ``q8`` is refused.
WeightsDtype = Literal["auto", "float32", "float16", "bfloat16", "native", "q8"]
WEIGHTS_DTYPES: tuple[str, ...] = get_args(WeightsDtype)


class BackendError(MeshnodeError, RuntimeError):
    """The requested device is not available."""


class Backend(ABC):
    """Where a stage computes: its array module, how its weights are laid out and loaded,
    and the parts of the forward that differ by device (:class:`CpuBackend`,
    :class:`CudaBackend`)."""

    name: ClassVar[Literal["cpu", "cuda"]]
    xp: ModuleType
    weights_dtype: WeightsDtype

    def asarray(self, a: np.ndarray) -> Any:
        """``a`` on this backend's device, float32."""
        return self.xp.asarray(a, dtype=self.xp.float32)

    @abstractmethod
    def to_numpy(self, a: Any) -> np.ndarray:
        """``a`` copied to the host as a NumPy array."""

    @property
    def cpu_blocks(self) -> bool:
        """Whether a CPU stage keeps weights in their GGUF blocks (else float32)."""
        return False

    @abstractmethod
    def describe(self) -> str:
        """One line naming the backend and device, e.g. for ``meshnode join``'s log."""

    def free_memory(self) -> int | None:
        """Device memory free for weights and KV now, in bytes; None on the CPU backend."""
        return None

    @abstractmethod
    def check_model(self, config: ModelConfig) -> None:
        """Raise :class:`ModelConfigError` if a stage of ``config``'s model cannot run here."""

    @abstractmethod
    def load_weights(
        self,
        source: ModelSource,
        config: ModelConfig,
        start: int,
        end: int,
        *,
        embed: bool,
        head: bool,
    ) -> StageWeights:
        """The weights stage ``[start, end)`` needs from ``source``, laid out for this
        backend's forward. Raises ``KeyError`` naming a missing tensor."""

    def held_bytes(self, source: ModelSource, config: ModelConfig) -> HeldBytes | None:
        """What a stage here holds of ``source``, from the tensors' stored sizes; None
        when the caller must estimate (see :func:`meshnode.engine.weights.held_bytes`)."""
        return None

    def new_kv_cache(
        self, shape: tuple[int, int, int], max_tokens: int, kv_dtype: str, weights: StageWeights
    ) -> KVCache:
        """An empty KV cache of ``shape`` (layers, Hkv, D) for ``max_tokens`` positions,
        its K/V in ``kv_dtype`` (``kv_cache.KV_DTYPES``)."""
        dtype = kv_numpy_dtype(kv_dtype)
        return KVCache(self.xp, *shape, max_tokens, dtype=dtype)

    def runner(self, config: ModelConfig, *, embed: bool, graphs: bool) -> Runner:
        """What runs a stage's forwards (``engine.runner``): here, at once."""
        return EagerRunner(self.xp, embed)

    def linear(self, x: Any, w: Any, sizes: Sequence[int] | None = None) -> Any:
        """``x @ w`` for ``x`` ``[r, in]``, ``w`` ``[in, out]`` as :meth:`load_weights`
        lays it out; ``sizes``: the row counts of the batch's segments in ``x``, for a
        backend whose products take another path for many rows than for few."""
        return x @ w

    def attention(self, config: ModelConfig, start: int, end: int) -> Attention:
        """The attention of layers ``[start, end)`` over a batch's sequences, for the
        NumPy forward: :mod:`meshnode.engine.ops`'s functions, a sequence at a time."""
        return Attention(self.xp, config, start, end)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """RMSNorm of the rows of ``x`` ``[r, E]`` (:func:`meshnode.engine.ops.rms_norm`)."""
        return ops.rms_norm(self.xp, x, weight, eps)

    def add_rms_norm(
        self, x: Any, h: Any, h_weight: Any | None, weight: Any | None, eps: float
    ) -> tuple[Any, Any | None]:
        """A block's residual add and the next norm: ``x + h`` (``h`` through RMSNorm with
        ``h_weight`` first, if given) and that sum through RMSNorm with ``weight`` (None
        when ``weight`` is None), as :meth:`rms_norm` and NumPy's ``+`` compute them."""
        if h_weight is not None:
            h = self.rms_norm(h, h_weight, eps)
        x = x + h
        return x, None if weight is None else self.rms_norm(x, weight, eps)

    def add(self, x: Any, b: Any) -> Any:
        """``x + b`` (a bias row ``b`` ``[n]`` broadcast over the rows of ``x`` ``[r, n]``)."""
        return x + b

    def scale(self, x: Any, factor: Any) -> Any:
        """``x * factor`` for a scalar ``factor`` (Gemma's scaled embeddings)."""
        return x * factor

    def glu(self, gate_up: Any, activation: str) -> Any:
        """The gated MLP's activation of the fused ``[r, 2 I]`` product -> ``[r, I]``:
        :func:`meshnode.engine.ops.gelu_tanh_mul` for ``gelu_tanh`` (GeGLU), else
        :func:`meshnode.engine.ops.silu_mul` (SwiGLU)."""
        if activation == "gelu_tanh":
            return ops.gelu_tanh_mul(self.xp, gate_up)
        return ops.silu_mul(self.xp, gate_up)

    def clamped_glu(self, gate_up: Any, alpha: float, limit: float) -> Any:
        """gpt-oss's clamped SwiGLU of the fused ``[r, 2 I]`` product (gate, then up) ->
        ``[r, I]``: :func:`meshnode.engine.ops.clamped_swiglu_mul`."""
        return ops.clamped_swiglu_mul(self.xp, gate_up, alpha, limit)

    def moe_step(self, w: Any, moe: MoeConfig | None, eps: float) -> MoeStep | None:
        """Layer ``w``'s feed-forward half of a one-row step as one call, where this
        backend has one: ``step(x, h, then)`` gives what the stage's residual add, norm,
        feed-forward and next add and norm give (``x``: the residual ``[1, E]``, ``h``:
        the attention's output, ``then``: the next norm's weight or None), or None where
        it does not take the call; None here: the stage's Python path."""
        del w, moe, eps
        return None

    def embed_rows(self, table: Any, ids: Any) -> Any:
        """The embedding rows ``[S, E]`` of token ``ids`` (an integer array on this
        backend's device) from ``table`` (``embed_t``, ``[E, V]`` as :meth:`load_weights`
        lays it out)."""
        return table[:, ids].T


@dataclass(frozen=True)
class CpuBackend(Backend):
    """NumPy, float32 math; weights as float32 or in their GGUF blocks (``native``)."""

    name: ClassVar[Literal["cpu", "cuda"]] = "cpu"
    weights_dtype: WeightsDtype = "float32"
    xp: ModuleType = field(default=np, init=False, repr=False, compare=False)

    def to_numpy(self, a: Any) -> np.ndarray:
        """``a`` as a NumPy array (no copy)."""
        return np.asarray(a)

    @property
    def cpu_blocks(self) -> bool:
        """Whether weights stay in their GGUF blocks (``native``, ``q8``), else float32."""
        return self.weights_dtype in ("native", "q8")

    def describe(self) -> str:
        """One line naming the backend, e.g. for ``meshnode join``'s log."""
        if self.weights_dtype == "q8":
            return (
                "cpu (NumPy + numba kernels over GGUF blocks, 8-bit activations: inexact; "
                "--dtype native: exact)"
            )
        if self.cpu_blocks:
            return "cpu (NumPy + numba kernels over GGUF blocks, float32)"
        return "cpu (NumPy, float32)"

    def check_model(self, config: ModelConfig) -> None:
        """Every family in ``config.ARCHITECTURES`` runs on the CPU: refuses nothing."""

    def load_weights(
        self,
        source: ModelSource,
        config: ModelConfig,
        start: int,
        end: int,
        *,
        embed: bool,
        head: bool,
    ) -> StageWeights:
        """Dequantized ``[in, out]`` float32 matrices, or block matrices (``native``)."""
        return load_stage_weights(
            source, config, start, end, embed=embed, head=head, blocks=self.cpu_blocks
        )

    def held_bytes(self, source: ModelSource, config: ModelConfig) -> HeldBytes | None:
        """As :func:`meshnode.engine.weights.held_bytes` lays out this backend's weights."""
        return held_bytes(source, config, blocks=self.cpu_blocks)

    def moe_step(self, w: Any, moe: MoeConfig | None, eps: float) -> MoeStep | None:
        """As :meth:`Backend.moe_step`, over GGUF blocks:
        :func:`meshnode.engine.cpu.moe_step.step_for` (the same compiled calls as the
        Python path, the same bits)."""
        if not self.cpu_blocks:
            return None
        return cpu_moe_step.step_for(w, moe, eps, self.weights_dtype == "q8")

    def embed_rows(self, table: Any, ids: Any) -> Any:
        """The rows of ``ids``; a table in GGUF blocks decodes only those rows."""
        if isinstance(table, BlockMatrix):
            return table.rows(ids)
        return table[:, ids].T

    def attention(self, config: ModelConfig, start: int, end: int) -> Attention:
        """Every sequence of a batch in one compiled call per layer
        (:class:`KernelAttention`), over GGUF blocks and with float32 weights alike: a
        row's attention is the same bits however its prompt was cut (resumed from cached
        prefix blocks, chunked, decoded), where the NumPy reference's BLAS products round a
        row by the rows beside it (OpenBLAS's Haswell kernels: issue 30)."""
        return KernelAttention(self.xp, config, start, end)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """As :meth:`Backend.rms_norm`; over GGUF blocks in one compiled call
        (:mod:`meshnode.engine.cpu.norms`: a row's result does not depend on the other rows,
        so a sequence's rows are the same alone and batched)."""
        if not self._compiled_norm(x):
            return ops.rms_norm(np, x, weight, eps)
        x, out, eps32 = np.ascontiguousarray(x), np.empty_like(x), np.float32(eps)
        by_rows(lambda lo, hi: _norms().rms_norm(x[lo:hi], weight, eps32, out[lo:hi]), len(x))
        return out

    def add_rms_norm(
        self, x: Any, h: Any, h_weight: Any | None, weight: Any | None, eps: float
    ) -> tuple[Any, Any | None]:
        """As :meth:`Backend.add_rms_norm`; over GGUF blocks in one compiled call
        (:func:`meshnode.engine.cpu.norms.add_rms_norm`: :meth:`rms_norm`'s row function
        and the same float32 additions, so the same bits as the separate calls)."""
        if not self._compiled_norm(x) or h.shape != x.shape or h.dtype != np.float32:
            return super().add_rms_norm(x, h, h_weight, weight, eps)
        total = np.empty_like(x)
        out = np.empty_like(x) if weight is not None else _NOTHING
        ws = tuple(_NO_WEIGHT if w is None else w for w in (h_weight, weight))
        x, h, eps32 = np.ascontiguousarray(x), np.ascontiguousarray(h), np.float32(eps)

        def part(lo: int, hi: int) -> None:
            _norms().add_rms_norm(x[lo:hi], h[lo:hi], *ws, eps32, total[lo:hi], out[lo:hi])

        by_rows(part, len(x))
        return total, None if weight is None else out

    def _compiled_norm(self, x: Any) -> bool:
        """Whether RMSNorm of ``x`` goes through :mod:`meshnode.engine.cpu.norms`."""
        return bool(
            self.cpu_blocks and x.ndim == 2 and x.shape[1] % 16 == 0 and x.dtype == np.float32
        )

    def glu(self, gate_up: Any, activation: str) -> Any:
        """As :meth:`Backend.glu`; over GGUF blocks in one compiled call
        (:mod:`meshnode.engine.cpu.glu`: the reference's expressions with a vector
        exponential; a row's result does not depend on the other rows)."""
        x = gate_up
        if not self.cpu_blocks or x.ndim != 2 or x.shape[1] % 32 or x.dtype != np.float32:
            return super().glu(x, activation)
        glu = _glu()
        kind = glu.GELU_TANH if activation == "gelu_tanh" else glu.SILU
        x, out = np.ascontiguousarray(x), np.empty((x.shape[0], x.shape[1] // 2), np.float32)
        by_rows(lambda lo, hi: glu.glu(x[lo:hi], kind, out[lo:hi]), len(x))
        return out

    def clamped_glu(self, gate_up: Any, alpha: float, limit: float) -> Any:
        """As :meth:`Backend.clamped_glu`; over GGUF blocks in one compiled call
        (:func:`meshnode.engine.cpu.glu.clamped_glu`, which the compiled experts call too)."""
        x = gate_up
        if not self.cpu_blocks or x.ndim != 2 or x.shape[1] % 32 or x.dtype != np.float32:
            return super().clamped_glu(x, alpha, limit)
        out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
        _glu().clamped_glu(np.ascontiguousarray(x), alpha, limit, out)
        return out

    def linear(self, x: Any, w: Any, sizes: Sequence[int] | None = None) -> Any:
        """``x @ w``; block kernels take every row in one pass over the weights, or, given
        the segments' ``sizes``, each segment's rows by the path it takes alone
        (:meth:`.BlockMatrix.product_by_segment`: the same bits in any batch); float32
        weights likewise (:func:`.cpu.dense_product`: a few rows one gemv each)."""
        n = x.shape[0]
        if self.weights_dtype == "q8" and isinstance(w, BlockMatrix) and q8.accepts(w, n):
            return q8.q8_product(w, x)
        if sizes is not None and len(sizes) > 1 and isinstance(w, BlockMatrix):
            return w.product_by_segment(x, sizes)
        if isinstance(w, np.ndarray) and w.dtype == np.float32 and x.ndim == 2:
            return dense_product(x, w, sizes)
        return x @ w


@dataclass(frozen=True)
class CudaBackend(Backend):
    """CuPy on a CUDA device: weights in their device formats (``meshnode.engine.cuda``),
    the forward in the engine's kernels with CUDA graphs."""

    name: ClassVar[Literal["cpu", "cuda"]] = "cuda"
    xp: ModuleType
    weights_dtype: WeightsDtype = "float32"
    cuda_graphs: bool = True  # capture and replay decode/verify steps
    # The page-locked buffer device-to-host copies go through.
    staging: PinnedStaging | None = field(default=None, compare=False, repr=False)

    def to_numpy(self, a: Any) -> np.ndarray:
        """``a`` copied to the host (through the pinned staging buffer when there is one)."""
        if self.staging is not None:
            return self.staging.to_host(a)
        return np.asarray(a.get())

    def describe(self) -> str:
        """The device, its name, CuPy's and CUDA's versions and the weights dtype."""
        rt = self.xp.cuda.runtime
        device = int(rt.getDevice())
        name = rt.getDeviceProperties(device)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        version = int(rt.runtimeGetVersion())
        cuda = f"CUDA {version // 1000}.{version % 1000 // 10}"
        return f"cuda:{device} {name} (CuPy {self.xp.__version__}, {cuda}, {self.weights_dtype})"

    def free_memory(self) -> int | None:
        """Free memory of the current device plus CuPy's unused pool, in bytes."""
        return cuda_free_memory(self.xp)

    def check_model(self, config: ModelConfig) -> None:
        """Refuse a head dim the attention kernel cannot hold (every family runs on the
        device through the same block; a hybrid model's recurrence through CuPy), and a
        mixture of experts or attention sinks, which the device does not run yet."""
        moe = config.hybrid.moe if config.hybrid is not None else config.moe
        if moe is not None or config.arch.attention_sinks:
            raise ModelConfigError(
                f"the CUDA stage does not run {config.model_type} models yet (use --device cpu)"
            )
        if config.hybrid is None and (config.head_dim > MAX_HEAD_DIM or BLOCK % config.head_dim):
            raise ModelConfigError(
                f"the CUDA attention kernel needs a head_dim dividing {BLOCK}, "
                f"not {config.head_dim} (use --device cpu)"
            )

    def load_weights(
        self,
        source: ModelSource,
        config: ModelConfig,
        start: int,
        end: int,
        *,
        embed: bool,
        head: bool,
    ) -> StageWeights:
        """Device matrices ``[out, in]`` (``embed_t``/``head_t`` hold ``[V, E]`` rows).

        Raises ``KeyError`` naming a missing tensor, ``ValueError`` for a width the
        kernels cannot decode (not a multiple of 32).
        """
        dtype = device_dtype(self.weights_dtype, source)
        return load_cuda_stage_weights(
            source, config, start, end, embed=embed, head=head, cp=self.xp, dtype=dtype
        )

    @cached_property
    def device(self) -> CudaOps:
        """The operations on this device (the kernels compiled on first use)."""
        return CudaOps(self.xp)

    def new_kv_cache(
        self, shape: tuple[int, int, int], max_tokens: int, kv_dtype: str, weights: StageWeights
    ) -> KVCache:
        """A cache allocated in full now: float32 with float32 weights (the golden-parity
        mode), float16 bits (``uint16``) otherwise."""
        first = weights.layers[0].wqkv if weights.layers else None
        exact = not isinstance(first, DeviceMatrix) or first.fmt == "f32"
        dtype = self.xp.float32 if exact else self.xp.uint16
        return KVCache(self.xp, *shape, max_tokens, dtype=dtype)

    def runner(self, config: ModelConfig, *, embed: bool, graphs: bool) -> Runner:
        """The stage's stream, fixed input buffers and CUDA graphs (``cuda.graphs``)."""
        return GraphRunner(self.xp, config, embed=embed, graphs=graphs and self.cuda_graphs)

    def attention(self, config: ModelConfig, start: int, end: int) -> Any:
        """Every sequence of a batch in one launch per kernel (``cuda.ops.CudaAttention``)."""
        return CudaAttention(self.device, config, start, end)

    def linear(self, x: Any, w: Any, sizes: Sequence[int] | None = None) -> Any:
        """As :meth:`Backend.linear`, through the matvec or matmul (``CudaOps.linear``)."""
        return self.device.linear(x, w)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """As :meth:`Backend.rms_norm`, one launch."""
        return self.device.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: Any, h: Any, h_weight: Any | None, weight: Any | None, eps: float
    ) -> tuple[Any, Any | None]:
        """As :meth:`Backend.add_rms_norm`, the add fused into the norm."""
        return self.device.add_rms_norm(x, h, h_weight, weight, eps)

    def add(self, x: Any, b: Any) -> Any:
        """As :meth:`Backend.add`, one launch."""
        return self.device.add(x, b)

    def scale(self, x: Any, factor: Any) -> Any:
        """As :meth:`Backend.scale`, one launch."""
        return self.device.scale(x, factor)

    def glu(self, gate_up: Any, activation: str) -> Any:
        """As :meth:`Backend.glu`, one launch."""
        return self.device.glu(gate_up, activation)

    def embed_rows(self, table: Any, ids: Any) -> Any:
        """As :meth:`Backend.embed_rows`; a device matrix ``[V, E]`` by the gather kernel."""
        return self.device.embed_rows(table, ids)


@functools.cache
def _norms() -> ModuleType:
    """The compiled RMSNorm's module, imported (numba with it) at its first use."""
    from meshnode.engine.cpu import norms

    return norms


# The empty weight (no norm) and output (the sum only) of cpu.norms.add_rms_norm.
_NO_WEIGHT = np.zeros(0, np.float32)
_NOTHING = np.zeros((0, 0), np.float32)


@functools.cache
def _glu() -> ModuleType:
    """The compiled GLU activations' module, imported (numba with it) at its first use."""
    from meshnode.engine.cpu import glu

    return glu


def cpu_backend(weights_dtype: WeightsDtype = "float32") -> CpuBackend:
    """The NumPy backend: weights as ``float32`` or in their GGUF blocks (``native``, or
    ``q8`` for 8-bit activations in the products of quantized weights)."""
    return CpuBackend(weights_dtype)


def _cupy() -> ModuleType | None:
    try:
        cupy = importlib.import_module("cupy")
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # no CuPy, no driver, no device: all mean "no CUDA here"
        return None
    return cupy


def cuda_free_memory(cupy: ModuleType | None = None) -> int | None:
    """Free memory of the current CUDA device plus what CuPy's pool holds unused, in bytes.

    None when there is no CUDA device usable through CuPy.
    """
    cupy = cupy or _cupy()
    if cupy is None:
        return None
    free, _total = cupy.cuda.runtime.memGetInfo()
    return int(free) + int(cupy.get_default_memory_pool().free_bytes())


@functools.cache
def select_backend(
    device: Device = "auto", weights_dtype: str = "auto", *, cuda_graphs: bool = True
) -> Backend:
    """The backend for ``device``: ``auto`` prefers CUDA when CuPy sees a device.

    ``weights_dtype`` is one of :data:`WeightsDtype` (``auto``: the fast mode, ``q8``, on
    the CPU). Raises :class:`BackendError` when
    ``cuda`` is asked for and unavailable, or float16/bfloat16 is asked of the CPU
    backend. Chosen once per process and arguments (``join`` asks for it to refuse an
    unusable device up front, then the host and the worker ask again): the device is
    probed and the choice logged once, and every caller shares one pinned staging buffer.
    """
    if weights_dtype not in WEIGHTS_DTYPES:
        raise BackendError(f"weights dtype must be one of {', '.join(WEIGHTS_DTYPES)}")
    cupy = None if device == "cpu" else _cupy()
    if cupy is not None and weights_dtype == "q8":
        raise BackendError("--dtype q8 is for CPU stages (add --device cpu)")
    if cupy is not None:
        dtype: Any = weights_dtype
        return _announce(CudaBackend(cupy, dtype, cuda_graphs, PinnedStaging(cupy)))
    if device == "cuda":
        raise BackendError("--device cuda: no CUDA device usable through CuPy")
    if weights_dtype not in ("auto", "float32", "native", "q8"):
        raise BackendError(
            f"weights dtype {weights_dtype}: the CPU backend computes in float32 only "
            "(weights: float32, native to keep the GGUF blocks, q8 for 8-bit activations)"
        )
    cpu_dtype = cast(WeightsDtype, "q8" if weights_dtype == "auto" else weights_dtype)
    return _announce(cpu_backend(cpu_dtype))


def _announce(backend: Backend) -> Backend:
    """Log the backend and device once per choice (``join`` logs its own line at INFO,
    with the thread count, once its logging is set up)."""
    log.debug("compute backend: %s", backend.describe())
    return backend


def limit_cpu_threads(threads: int | None) -> object | None:
    """Cap the kernel threads of this process at ``threads`` (None: defaults), and hold
    its BLAS at one thread.

    OpenBLAS threads spin while they wait: with more threads than free cores (several
    nodes on one machine, or any other busy process) decode gets about ten times slower,
    where one thread per node keeps its speed (see benchmarks/engine.py). The kernel and
    tile threads share the work instead, and BLAS stays at one thread whatever the cap,
    so that a product's bits never depend on it (:mod:`meshnode.engine.cpu.tiles`).
    Returns the threadpoolctl handle, which keeps the limit for as long as it is
    referenced.
    """
    if threads is None:
        return None
    if threads < 1:
        raise BackendError(f"threads must be at least 1, got {threads}")
    from threadpoolctl import threadpool_limits

    set_kernel_threads(threads)
    handle: object = threadpool_limits(limits=1, user_api="blas")
    return handle
