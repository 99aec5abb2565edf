"""``Tensor``: an n-dimensional array as it travels on the wire (dtype, shape, raw bytes).

Tensors are never CBOR-encoded: the header describes them and their bytes are appended raw
after the header, little-endian, C order. Decoded tensors hold a ``memoryview`` into the
received frame, so a receiver can wrap it with ``numpy.frombuffer`` without a copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

# Bytes per element of each wire dtype. bf16 is the upper half of an IEEE float32.
DTYPE_SIZES: Final[dict[str, int]] = {"f32": 4, "f16": 2, "bf16": 2}

# A hidden-state tensor is [tokens, hidden] and draft distributions are [k, vocab]; eight
# dimensions is generous and keeps a hostile header from describing absurd shapes.
MAX_TENSOR_DIMS: Final = 8


@dataclass(frozen=True, slots=True, eq=False)
class Tensor:
    """A dense array: ``dtype`` in ``DTYPE_SIZES``, ``shape``, and ``data`` (raw bytes).

    ``data`` may be ``bytes`` or any C-contiguous buffer (a ``memoryview`` of a NumPy array,
    for instance); it is kept as given, not copied, and viewed as unsigned bytes.
    Raises ``ValueError``/``TypeError`` when dtype, shape and byte length disagree.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"tensor dtype must be one of {sorted(DTYPE_SIZES)}, not {self.dtype!r}"
            )
        if not isinstance(self.shape, tuple) or len(self.shape) > MAX_TENSOR_DIMS:
            raise TypeError(f"tensor shape must be a tuple of at most {MAX_TENSOR_DIMS} ints")
        for dim in self.shape:
            if type(dim) is not int or dim < 0:
                raise TypeError(f"tensor shape must hold non-negative ints, not {self.shape!r}")
        if not isinstance(self.data, bytes):
            object.__setattr__(self, "data", _byte_view(self.data))
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if len(self.data) != expected:
            shape = list(self.shape)
            raise ValueError(
                f"tensor {self.dtype}{shape} needs {expected} bytes, not {self.nbytes}"
            )

    @property
    def nbytes(self) -> int:
        """Length of ``data`` in bytes."""
        return len(self.data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tensor):
            return NotImplemented
        return (self.dtype, self.shape) == (other.dtype, other.shape) and self.data == other.data

    def __hash__(self) -> int:
        return hash((self.dtype, self.shape, bytes(self.data)))

    def __repr__(self) -> str:
        return f"Tensor(dtype={self.dtype!r}, shape={self.shape!r}, nbytes={self.nbytes})"


def _byte_view(data: object) -> memoryview:
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"tensor data must be bytes or a buffer, not {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("tensor data must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
