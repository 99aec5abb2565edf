"""The kernels of :mod:`.kernels` compiled through CuPy, called with device arrays.

Every call launches on CuPy's current stream (the stage's), allocates nothing, and takes
its outputs as arguments: that is what lets a decode step be captured as a CUDA graph.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshnode.engine.cuda import kernels
from meshnode.engine.cuda.formats import CPP_NAME, Format

__all__ = ["DeviceMatrix", "Kernels", "PinnedStaging", "kernels_for"]


@dataclass(frozen=True)
class DeviceMatrix:
    """A linear weight ``[out, in]`` on the device in format ``fmt`` (see ``formats``).

    ``data`` is float32/float16 ``[out, in]`` for those formats, uint16 bit patterns for
    bfloat16 and uint8 ``[out, row_bytes]`` GGML blocks for the quantized ones.
    """

    data: Any
    fmt: Format
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes the matrix holds on the device (what a decode step reads)."""
        return int(self.data.nbytes)


class Kernels:
    """The compiled module of one process; methods launch one kernel each."""

    def __init__(self, cp: Any) -> None:
        self._cp = cp
        self._module = cp.RawModule(code=kernels.SOURCE, name_expressions=kernels.template_names())
        self._fns: dict[str, Any] = {}

    def _fn(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self._module.get_function(name)
        return fn

    def warm_up(self) -> None:
        """Load every kernel now: a module must not be loaded during graph capture."""
        for name in (*kernels.PLAIN_KERNELS, *kernels.template_names()):
            self._fn(name)

    # -- row kernels ---------------------------------------------------------------------

    def rms_norm(self, x: Any, w: Any, y: Any, eps: float) -> None:
        """``y = rms_norm(x) * w`` row by row; ``x``, ``y`` ``[r, n]`` float32."""
        rows, n = x.shape
        self._fn("rms_norm")((rows,), (kernels.BLOCK,), (x, w, y, np.int32(n), np.float32(eps)))

    def add_rms_norm(self, x: Any, h: Any, w: Any, y: Any, eps: float) -> None:
        """``x += h`` then ``y = rms_norm(x) * w`` (the residual add and the next norm)."""
        rows, n = x.shape
        args = (x, h, w, y, np.int32(n), np.float32(eps))
        self._fn("add_rms_norm")((rows,), (kernels.BLOCK,), args)

    def softmax(self, x: Any) -> None:
        """Row softmax of float32 ``x`` ``[r, n]`` in place."""
        rows, n = x.shape
        self._fn("softmax")((rows,), (kernels.BLOCK,), (x, np.int32(n)))

    def silu_mul(self, gate_up: Any, out: Any) -> None:
        """``out [r, I] = silu(gate) * up`` for the fused ``gate_up [r, 2 I]``."""
        rows, inter = out.shape
        grid = kernels.flat_grid(rows * inter)
        self._fn("silu_mul")(
            (grid,), (kernels.BLOCK,), (gate_up, out, np.int32(rows), np.int32(inter))
        )

    def gelu_tanh_mul(self, gate_up: Any, out: Any) -> None:
        """``out [r, I] = gelu_tanh(gate) * up`` for the fused ``gate_up [r, 2 I]`` (GeGLU)."""
        rows, inter = out.shape
        grid = kernels.flat_grid(rows * inter)
        self._fn("gelu_tanh_mul")(
            (grid,), (kernels.BLOCK,), (gate_up, out, np.int32(rows), np.int32(inter))
        )

    def qk_norm(
        self, qkv: Any, q_weight: Any, k_weight: Any, heads: int, kv_heads: int, eps: float
    ) -> None:
        """RMSNorm of every query and key head of ``qkv`` ``[n, (H + 2 Hkv) D]`` in place."""
        n, width = qkv.shape
        dim = width // (heads + 2 * kv_heads)
        ints = (np.int32(heads), np.int32(kv_heads), np.int32(dim))
        args = (qkv, q_weight, k_weight, *ints, np.float32(eps))
        self._fn("qk_norm")((heads + kv_heads, n), (kernels.BLOCK,), args)

    def gather_rows(self, x: Any, step: Any, out: Any) -> None:
        """``out [r, n]`` = the rows of ``x`` the step table's last column lists."""
        rows, n = out.shape
        self._fn("gather_rows")((rows,), (kernels.BLOCK,), (x, step, out, np.int32(n)))

    # -- attention -----------------------------------------------------------------------

    def rope_store(
        self, qkv: Any, inv_freq: Any, step: Any, layer: int, heads: int, kv_heads: int, kv: str
    ) -> None:
        """RoPE on Q in place; each row's rotated K and its V into the cache and position
        its row of the step table (``int64 [>= n, STEP]``) names."""
        n, width = qkv.shape
        dim = width // (heads + 2 * kv_heads)
        total = n * (heads + kv_heads) * dim // 2 + n * kv_heads * dim
        ints = (layer, n, heads, kv_heads, dim)
        args = (qkv, inv_freq, step, *(np.int32(i) for i in ints))
        self._fn(f"rope_store<{kv}>")((kernels.flat_grid(total),), (kernels.BLOCK,), args)

    def attention(
        self,
        qkv: Any,
        out: Any,
        step: Any,
        layer: int,
        heads: int,
        kv_heads: int,
        scale: float,
        kv: str,
        window: int = 0,
    ) -> None:
        """Causal GQA attention, each row over its own cache (its last ``window`` keys
        when > 0); out ``[r, H D]``: every row of ``qkv`` when ``r`` is its row count,
        else the rows the step table keeps."""
        n, width = qkv.shape
        rows = out.shape[0]
        dim = width // (heads + 2 * kv_heads)
        ints = (layer, n, rows, heads, kv_heads, dim)
        args = (qkv, out, step, *(np.int32(i) for i in ints), np.float32(scale), np.int32(window))
        self._fn(f"attention<{kv}>")((heads, rows), (kernels.BLOCK,), args)

    # -- weights -------------------------------------------------------------------------

    def gemv(self, w: DeviceMatrix, x: Any, y: Any) -> None:
        """``y [r, out] = x [r, in] @ W.T``, decoding W as it reads (in passes of
        ``MAX_ROWS`` rows; meant for up to ``MAX_BATCH_ROWS``)."""
        rows = x.shape[0]
        if x.data.ptr % 16:  # the kernel reads x as aligned float4s; a new array is on 256
            x = x.copy()
        args = (w.data, x, y, np.int32(rows), np.int32(w.in_features), np.int32(w.out_features))
        fn = self._fn(f"gemv<{CPP_NAME[w.fmt]}, {kernels.gemv_rows(rows)}>")
        fn((kernels.gemv_grid(w.out_features),), (kernels.GEMV_BLOCK,), args)

    def embed(self, table: DeviceMatrix, ids: Any, x: Any) -> None:
        """``x [r, E]`` = rows ``ids`` (int32) of the embedding ``table [V, E]``."""
        args = (table.data, ids, x, np.int32(table.in_features))
        self._fn(f"embed<{CPP_NAME[table.fmt]}>")((ids.shape[0],), (kernels.BLOCK,), args)

    def dequantize(self, w: DeviceMatrix, dtype: Any) -> Any:
        """W decoded to a new float32 or float16 ``[out, in]`` array (prefill's matmuls)."""
        cp = self._cp
        out = cp.empty((w.out_features, w.in_features), dtype=dtype)
        kind = "float" if out.dtype == cp.float32 else "u16"
        grid = kernels.flat_grid(w.out_features * w.in_features // kernels.UNIT)
        dst = out.view(cp.uint16) if kind == "u16" else out
        args = (w.data, dst, np.int32(w.in_features), np.int32(w.out_features))
        self._fn(f"dequantize<{CPP_NAME[w.fmt]}, {kind}>")((grid,), (kernels.BLOCK,), args)
        return out


_KERNELS: dict[int, Kernels] = {}
_KERNELS_LOCK = threading.Lock()


def kernels_for(cp: Any) -> Kernels:
    """The process's compiled kernels for the current device (compiled on first use)."""
    device = int(cp.cuda.runtime.getDevice())
    with _KERNELS_LOCK:
        if device not in _KERNELS:
            _KERNELS[device] = Kernels(cp)
        return _KERNELS[device]


class PinnedStaging:
    """A page-locked host buffer for device-to-host copies (``Backend.to_numpy``).

    Copies from pageable memory go through a driver bounce buffer; from page-locked
    memory they are one DMA. The buffer grows to the largest transfer seen and is
    reused; a lock makes it safe for stages driven from several threads. (A stage's
    inputs have pinned buffers of their own, see ``graphs.GraphRunner``.)
    """

    def __init__(self, cp: Any) -> None:
        import cupyx

        self._cp = cp
        self._empty_pinned = cupyx.empty_pinned
        self._buf = self._empty_pinned((1 << 16,), dtype=np.uint8)
        self._lock = threading.Lock()

    def _view(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if nbytes > self._buf.nbytes:
            self._buf = self._empty_pinned((max(nbytes, 2 * self._buf.nbytes),), dtype=np.uint8)
        view: np.ndarray = self._buf[:nbytes].view(dtype).reshape(shape)
        return view

    def to_host(self, a: Any) -> np.ndarray:
        """A host copy of device array ``a`` (a new NumPy array, not the staging memory)."""
        a = self._cp.ascontiguousarray(a)
        with self._lock:
            view = self._view(a.shape, a.dtype)
            a.get(out=view)  # blocking: the copy is complete on return
            return view.copy()
