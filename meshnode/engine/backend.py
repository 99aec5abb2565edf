"""The array backend, chosen once: NumPy (float32) on CPU, CuPy on a CUDA device.

Everything in the engine does math through ``backend.xp`` so the same code runs on both.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

__all__ = ["Backend", "BackendError", "Device", "cpu_backend", "select_backend"]

Device = Literal["auto", "cpu", "cuda"]


class BackendError(RuntimeError):
    """The requested device is not available."""


@dataclass(frozen=True)
class Backend:
    """An array module plus the conversions to and from host NumPy arrays."""

    name: Literal["cpu", "cuda"]
    xp: ModuleType

    def asarray(self, a: np.ndarray) -> Any:
        """``a`` on this backend's device, float32."""
        return self.xp.asarray(a, dtype=self.xp.float32)

    def to_numpy(self, a: Any) -> np.ndarray:
        """``a`` copied to the host as a NumPy array."""
        if self.name == "cuda":
            return np.asarray(a.get())
        return np.asarray(a)


def cpu_backend() -> Backend:
    """The NumPy backend."""
    return Backend("cpu", np)


def _cupy() -> ModuleType | None:
    try:
        cupy = importlib.import_module("cupy")
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # no CuPy, no driver, no device: all mean "no CUDA here"
        return None
    return cupy


def select_backend(device: Device = "auto") -> Backend:
    """The backend for ``device``: ``auto`` prefers CUDA when CuPy sees a device.

    Raises :class:`BackendError` when ``cuda`` is asked for and unavailable.
    """
    if device == "cpu":
        return cpu_backend()
    cupy = _cupy()
    if cupy is not None:
        return Backend("cuda", cupy)
    if device == "cuda":
        raise BackendError("--device cuda: no CUDA device usable through CuPy")
    return cpu_backend()


def limit_cpu_threads(threads: int | None) -> object | None:
    """Cap the BLAS threads of this process at ``threads`` (None: the library's default).

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

    handle: object = threadpool_limits(limits=threads, user_api="blas")
    return handle

