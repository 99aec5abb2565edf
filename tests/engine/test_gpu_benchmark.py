"""benchmarks/gpu.py runs: its CPU smoke mode here, its refusal without a CUDA device."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshnode.engine.backend import cuda_free_memory
from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "gpu.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )


def test_cpu_tiny_smoke_mode_prints_the_table() -> None:
    run = _run("--device", "cpu", "--tiny", "--tokens", "4")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("device: cpu (NumPy, float32); copy bandwidth ")
    gap = lines.index("")  # the decode table, then the prefill table
    rows = [line.split(" | ") for line in lines[3:gap]]
    formats = [(r[0], r[1], r[3]) for r in rows]  # one row per format and stream count
    assert formats == [("| tiny", f, s) for f in ("f16", "q8_0") for s in ("1", "8")]
    for row in rows:
        assert float(row[4]) > 0  # tok/s, over all streams
        assert row[8] == "5.2 MB"  # weights per token: the float32 tiny model
    prompts = [line.strip("| ").split(" | ") for line in lines[gap + 3 :]]
    assert [p[:3] for p in prompts] == [["tiny", f, "32"] for f in ("f16", "q8_0")]
    assert all(float(p[3]) > 0 for p in prompts)  # prefill tok/s


@pytest.mark.skipif(cuda_free_memory() is not None, reason="a CUDA device is present")
def test_refuses_in_one_line_without_a_cuda_device() -> None:
    run = _run("--tokens", "4")
    assert run.returncode == 2
    assert run.stdout.count("\n") == 1
    assert run.stdout.startswith("benchmarks/gpu.py: needs a CUDA device")
