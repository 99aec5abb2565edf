"""Activations at a stage boundary, in host memory: cast to and from the wire's dtypes.

What crosses the network between stages is raw bytes in a wire dtype (``meshnode.node.wire``
builds the protocol's tensors around them). The engine computes in float32; the wire may
carry float16 (half the bytes for a rounding of about 1e-3 relative, ``benchmarks/split.py``).
:class:`Staging` keeps one sequence's two buffers, the outgoing wire-dtype copy and the
incoming float32 copy, and rewrites them in place frame after frame, so a decode step
allocates no activation-sized arrays.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

__all__ = ["WIRE_DTYPES", "Staging", "from_wire", "to_wire", "wire_nbytes"]

WIRE_DTYPES: Final = {"f32": np.float32, "f16": np.float16}
"""Activation dtypes this node sends and accepts (bf16 needs a bit-level conversion NumPy
lacks; it is accepted on the wire by the codec but not offered by this implementation)."""


def to_wire(array: Any, dtype: str) -> np.ndarray[Any, Any]:
    """``array`` (host memory, any float dtype) as a contiguous array of wire ``dtype``."""
    return np.ascontiguousarray(array, dtype=WIRE_DTYPES[dtype])


def wire_nbytes(array: Any, dtype: str) -> int:
    """Bytes of ``array`` (host memory) in the wire ``dtype``."""
    return int(np.asarray(array).size) * np.dtype(WIRE_DTYPES[dtype]).itemsize


def from_wire(data: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """A new float32 array of the values in ``data`` (raw bytes of wire ``dtype``).

    Raises ``ValueError`` for a dtype this node does not accept.
    """
    return _view(data, dtype, shape).astype(np.float32)


def _view(data: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"activation dtype {dtype!r} is not supported by this node")
    return np.frombuffer(data, dtype=WIRE_DTYPES[dtype]).reshape(shape)


def _rows_of(buffer: np.ndarray[Any, Any] | None, rows: int, width: int, dtype: Any) -> Any:
    """``buffer`` if it has at least ``rows`` rows of ``width`` and ``dtype``, else a new one."""
    if buffer is None or buffer.shape[0] < rows or buffer.shape[1:] != (width,):
        return np.empty((rows, width), dtype=dtype)
    if buffer.dtype != dtype:
        return np.empty((max(rows, buffer.shape[0]), width), dtype=dtype)
    return buffer


class Staging:
    """One sequence's reused activation buffers, grown to the largest frame it sent (a
    prefill chunk). An array returned here views the buffer: it is valid until the
    sequence's next frame in the same direction is staged."""

    __slots__ = ("_incoming", "_outgoing")

    def __init__(self) -> None:
        self._outgoing: np.ndarray[Any, Any] | None = None  # [rows, hidden], wire dtype
        self._incoming: np.ndarray[Any, Any] | None = None  # [rows, hidden], float32

    @property
    def nbytes(self) -> int:
        """Bytes its buffers hold."""
        return sum(b.nbytes for b in (self._outgoing, self._incoming) if b is not None)

    def to_wire(self, array: Any, dtype: str) -> np.ndarray[Any, Any]:
        """As :func:`to_wire`; a ``[rows, hidden]`` array is written into the buffer."""
        host = np.asarray(array)
        if host.ndim != 2:
            return to_wire(host, dtype)
        rows, width = host.shape
        self._outgoing = _rows_of(self._outgoing, rows, width, WIRE_DTYPES[dtype])
        staged: np.ndarray[Any, Any] = self._outgoing[:rows]
        np.copyto(staged, host, casting="same_kind")
        return staged

    def from_wire(self, data: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        """As :func:`from_wire`; ``[rows, hidden]`` values are written into the buffer."""
        raw = _view(data, dtype, shape)
        if raw.ndim != 2:
            return raw.astype(np.float32)
        rows, width = raw.shape
        self._incoming = _rows_of(self._incoming, rows, width, np.float32)
        hidden: np.ndarray[Any, Any] = self._incoming[:rows]
        np.copyto(hidden, raw)
        return hidden
