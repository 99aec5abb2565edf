"""Backend selection and device memory where there is no CUDA device (every CI machine)."""

from __future__ import annotations

import logging

import psutil
import pytest

from meshnode.engine.backend import BackendError, cpu_backend, cuda_free_memory, select_backend
from meshnode.node.config import NodeConfig
from meshnode.node.daemon import usable_memory


def _has_cuda() -> bool:
    return cuda_free_memory() is not None


def test_cpu_refuses_reduced_weight_dtypes() -> None:
    assert select_backend("cpu", "float32") == cpu_backend("float32")
    # the default on the CPU: the fast mode, llama.cpp's arithmetic (README "Performance")
    assert select_backend("cpu", "auto") == cpu_backend("q8")
    assert select_backend("cpu", "native") == cpu_backend("native")
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(BackendError, match="CPU backend computes in float32 only"):
            select_backend("cpu", dtype)
    with pytest.raises(BackendError, match="weights dtype must be one of"):
        select_backend("cpu", "int8")


def test_cpu_backend_describes_itself_and_has_no_device_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="meshnode.engine.backend"):
        backend = select_backend("cpu", "float32")
        blocks = select_backend("cpu", "native")
        fast = select_backend("cpu")
    assert backend.describe() == "cpu (NumPy, float32)"
    assert not backend.cpu_blocks
    assert blocks.describe() == "cpu (NumPy + numba kernels over GGUF blocks, float32)"
    assert blocks.cpu_blocks
    assert fast.describe() == (
        "cpu (NumPy + numba kernels over GGUF blocks, 8-bit activations: inexact; "
        "--dtype native: exact)"
    )
    assert fast.cpu_blocks
    assert backend.free_memory() is None
    # Logged once per process: an earlier test may already have selected it.
    assert all("compute backend: cpu" in r.message for r in caplog.records)


@pytest.mark.skipif(_has_cuda(), reason="a CUDA device is present")
def test_without_a_device_cuda_is_refused_and_auto_is_the_cpu() -> None:
    with pytest.raises(BackendError, match="no CUDA device"):
        select_backend("cuda")
    assert select_backend("auto").name == "cpu"
    with pytest.raises(BackendError, match="CPU backend computes in float32 only"):
        select_backend("auto", "float16")


@pytest.mark.skipif(_has_cuda(), reason="a CUDA device is present")
def test_usable_memory_of_a_cuda_node_without_a_device_is_ram() -> None:
    config = NodeConfig(device="cuda", max_memory_bytes=None)
    ram = psutil.virtual_memory().available
    assert abs(usable_memory(config) - ram) < ram // 4  # RAM moves a little between reads
    assert usable_memory(NodeConfig(device="cuda", max_memory_bytes=1 << 20)) == 1 << 20
