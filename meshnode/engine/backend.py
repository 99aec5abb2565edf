"""The array backend, chosen once: NumPy (float32) on CPU, CuPy on a CUDA device.

Everything in the engine does math through ``backend.xp`` so the same code runs on both;
on CUDA a stage runs the engine's own kernels (``meshnode.engine.cuda``) with weights in
``weights_dtype``. CuPy is imported only when a CUDA backend is asked for.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, get_args

import numpy as np

from meshnode.errors import MeshnodeError

__all__ = [
    "Backend",
    "BackendError",
    "Device",
    "WeightsDtype",
    "cpu_backend",
    "cuda_free_memory",
    "select_backend",
]

log = logging.getLogger(__name__)

Device = Literal["auto", "cpu", "cuda"]
# Weights on the device: ``auto`` is bfloat16 where the model's config says it was trained
# in bfloat16, else float16; float32 is the golden-parity mode. On the CPU, ``auto`` and
# ``float32`` dequantize at load (NumPy/BLAS) and ``native`` keeps the file's GGUF blocks
# in memory, multiplied by compiled kernels (meshnode.engine.cpu): about a quarter of the
# memory, not yet the speed (README, "Performance"). The CPU computes in float32 either
# way. On CUDA, ``native`` is ``auto``.
WeightsDtype = Literal["auto", "float32", "float16", "bfloat16", "native"]
WEIGHTS_DTYPES: tuple[str, ...] = get_args(WeightsDtype)


class BackendError(MeshnodeError, RuntimeError):
    """The requested device is not available."""


@dataclass(frozen=True)
class Backend:
    """An array module plus the conversions to and from host NumPy arrays."""

    name: Literal["cpu", "cuda"]
    xp: ModuleType
    weights_dtype: WeightsDtype = "float32"
    cuda_graphs: bool = True  # capture and replay decode/verify steps (CUDA only)
    # CUDA: the page-locked buffer device-to-host copies go through (device.PinnedStaging).
    staging: Any = field(default=None, compare=False, repr=False)

    def asarray(self, a: np.ndarray) -> Any:
        """``a`` on this backend's device, float32."""
        return self.xp.asarray(a, dtype=self.xp.float32)

    def to_numpy(self, a: Any) -> np.ndarray:
        """``a`` copied to the host as a NumPy array."""
        if self.name == "cuda":
            if self.staging is not None:
                host: np.ndarray = self.staging.to_host(a)
                return host
            return np.asarray(a.get())
        return np.asarray(a)

    @property
    def cpu_blocks(self) -> bool:
        """Whether a CPU stage keeps weights in their GGUF blocks (else float32)."""
        return self.name == "cpu" and self.weights_dtype == "native"

    def describe(self) -> str:
        """One line naming the backend and device, e.g. for ``meshnode join``'s log."""
        if self.name == "cpu":
            if self.cpu_blocks:
                return "cpu (NumPy + numba kernels over GGUF blocks, float32)"
            return "cpu (NumPy, float32)"
        rt = self.xp.cuda.runtime
        device = int(rt.getDevice())
        name = rt.getDeviceProperties(device)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        version = int(rt.runtimeGetVersion())
        cuda = f"CUDA {version // 1000}.{version % 1000 // 10}"
        return f"cuda:{device} {name} (CuPy {self.xp.__version__}, {cuda}, {self.weights_dtype})"

    def free_memory(self) -> int | None:
        """Device memory free for weights and KV now, in bytes; None on the CPU backend."""
        return cuda_free_memory(self.xp) if self.name == "cuda" else None


def cpu_backend(weights_dtype: WeightsDtype = "float32") -> Backend:
    """The NumPy backend: weights as ``float32`` or in their GGUF blocks (``native``)."""
    return Backend("cpu", np, weights_dtype)


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

    ``weights_dtype`` is one of :data:`WeightsDtype`. Raises :class:`BackendError` when
    ``cuda`` is asked for and unavailable, or float16/bfloat16 is asked of the CPU
    backend. Chosen once per process and arguments (``join`` asks for it to refuse an
    unusable device up front, then the host and the worker ask again): the device is
    probed and the choice logged once, and every caller shares one pinned staging buffer.
    """
    if weights_dtype not in WEIGHTS_DTYPES:
        raise BackendError(f"weights dtype must be one of {', '.join(WEIGHTS_DTYPES)}")
    cupy = None if device == "cpu" else _cupy()
    if cupy is not None:
        from meshnode.engine.cuda.device import PinnedStaging

        dtype: Any = weights_dtype
        return _announce(Backend("cuda", cupy, dtype, cuda_graphs, PinnedStaging(cupy)))
    if device == "cuda":
        raise BackendError("--device cuda: no CUDA device usable through CuPy")
    if weights_dtype not in ("auto", "float32", "native"):
        raise BackendError(
            f"weights dtype {weights_dtype}: the CPU backend computes in float32 only "
            "(weights: float32, or native to keep the GGUF blocks)"
        )
    return _announce(cpu_backend("native" if weights_dtype == "native" else "float32"))


def _announce(backend: Backend) -> Backend:
    """Log the backend and device once per choice (``join`` logs its own line at INFO,
    with the thread count, once its logging is set up)."""
    log.debug("compute backend: %s", backend.describe())
    return backend


def limit_cpu_threads(threads: int | None) -> object | None:
    """Cap the BLAS and kernel threads of this process at ``threads`` (None: defaults).

    OpenBLAS threads spin while they wait: with more threads than free cores (several
    nodes on one machine, or any other busy process) decode gets about ten times slower,
    where one thread per node keeps its speed (see benchmarks/engine.py). Returns the
    threadpoolctl handle, which keeps the limit for as long as it is referenced.
    """
    if threads is None:
        return None
    if threads < 1:
        raise BackendError(f"threads must be at least 1, got {threads}")
    from threadpoolctl import threadpool_limits

    from meshnode.engine.cpu import set_kernel_threads

    set_kernel_threads(threads)
    handle: object = threadpool_limits(limits=threads, user_api="blas")
    return handle
