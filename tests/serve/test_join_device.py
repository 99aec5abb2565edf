"""`meshnode join` refuses a device or weights dtype it cannot have before starting."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.engine.backend import select_backend
from tests.e2e.cluster import cli


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--device", "cpu", "--dtype", "bfloat16"], "the CPU backend computes in float32 only"),
        (["--dtype", "int3"], "dtype must be one of auto, float32, float16, bfloat16"),
        (["--device", "cuda"], "no CUDA device usable through CuPy"),
    ],
)
def test_join_refuses_what_this_machine_cannot_do(
    tmp_path: Path, args: list[str], problem: str
) -> None:
    if "cuda" in args and select_backend("auto").name == "cuda":
        pytest.skip("a CUDA device is present")
    result = cli("join", "--state-dir", str(tmp_path), "--no-mdns", *args, timeout_s=30)
    assert result.returncode == 2, result.stderr
    assert problem in result.stderr
    assert "Traceback" not in result.stderr
