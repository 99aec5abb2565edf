"""`meshnode join` refuses a device or weights dtype it cannot have before starting."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from meshnode_packaging.writer import write_package

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
    result = cli("join", "--state-dir", str(tmp_path), "--no-mdns", *args)
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
    result = cli("join", "--state-dir", str(tmp_path), "--no-mdns", *args)
    assert result.returncode == 2, result.stderr
    assert problem in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("flag", ["--api", "--listen"])
def test_join_on_an_address_in_use_says_which_flag_in_one_line(tmp_path: Path, flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        free = {"--api": "127.0.0.1:0", "--listen": "127.0.0.1:0"}
        addresses = [arg for f, a in free.items() for arg in (f, address if f == flag else a)]
        result = cli("join", "--state-dir", str(tmp_path), "--no-mdns", *addresses)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"meshnode join: {flag} {address}: cannot listen there"), last
    assert "Traceback" not in result.stderr
    assert "ExceptionGroup" not in result.stderr
    # The compute backend is logged before the node starts (logging is set up first).
    # (Its wording names the CPU path in use: BLAS over float32, or the GGUF block kernels.)
    assert re.search(r"compute backend: cpu \(NumPy[^)]*\); CPU threads:", result.stderr)


def test_join_refuses_a_damaged_local_package_in_one_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    package = tmp_path / "package"
    write_package(tiny_model_dir, package)
    embed = package / "embed.safetensors"
    data = bytearray(embed.read_bytes())
    data[-1] ^= 0xFF
    embed.write_bytes(bytes(data))
    args = ["--state-dir", str(tmp_path / "state"), "--no-mdns", "--api", "127.0.0.1:0"]
    result = cli("join", *args, "--listen", "127.0.0.1:0", "--model", str(package))
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"meshnode join: --model {package}: package folder"), last
    assert "embed.safetensors: sha256" in last
    assert "Traceback" not in result.stderr
