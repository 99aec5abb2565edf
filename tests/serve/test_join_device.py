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


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--split", "0"], "--split: expected a positive integer, got 0"),
        (["--wire-dtype", "bf16"], "--wire-dtype: wire dtype must be f16 or f32"),
        (["--threads", "0"], "--threads: expected a positive integer, got 0"),
        (["--log-level", "verbose"], "--log-level: log level must be"),
        (["--context", "0"], "--context: expected a positive integer, got 0"),
    ],
)
def test_join_refuses_bad_flag_values_in_one_line(
    tmp_path: Path, args: list[str], problem: str
) -> None:
    result = cli("join", "--state-dir", str(tmp_path), "--no-mdns", *args, timeout_s=30)
    assert result.returncode == 2, result.stderr
    assert problem in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
