"""``meshnode generate``: the real console script, exit codes and messages for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnode.cli import app
from meshnode.cli import commands as _commands  # registers the commands on app
from meshnode.engine.backend import select_backend

MESHNODE = Path(sys.executable).parent / "meshnode"
runner = CliRunner()
assert _commands


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MESHNODE), "generate", *args], capture_output=True, text=True, timeout=120
    )


def test_console_script_with_a_tiny_model_prints_json(tiny_gguf: Callable[[str], Path]) -> None:
    done = _script(
        "--model",
        str(tiny_gguf("Q8_0")),
        "--raw",
        "--json",
        "--max-tokens",
        "5",
        "--device",
        "cpu",
        "the 12",
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary) >= {"prompt_token_ids", "token_ids", "text", "finish_reason", "timings"}
    assert summary["finish_reason"] in ("stop", "length")
    assert len(summary["token_ids"]) <= 5
    assert {"prefill_ms", "decode_tokens_per_s"} <= set(summary["timings"])
    assert done.stdout.startswith(summary["text"])


def test_console_script_unknown_alias() -> None:
    done = _script("--model", "gpt-17", "hi")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("meshnode generate: error: 'gpt-17' is not a model alias")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model.gguf"], "'/nonexistent/model.gguf' is not a model"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--device", "cpu", "--dtype", "float16"], "the CPU backend computes in float32 only"),
        (["--device", "cpu", "--dtype", "int3"], "weights dtype must be one of"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["generate", *args, "hello"])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_unsupported_architecture_exits_2(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(path, "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    result = runner.invoke(app, ["generate", "--model", str(path), "hello"])
    assert result.exit_code == 2
    assert "unsupported GGUF architecture 'mamba'" in result.output


def test_cuda_requested_without_a_device_exits_2() -> None:
    if select_backend("auto").name == "cuda":
        pytest.skip("a CUDA device is present")
    result = runner.invoke(app, ["generate", "--device", "cuda", "hello"])
    assert result.exit_code == 2
    assert "no CUDA device" in result.output


@pytest.mark.real_model
def test_console_script_default_model_chat_reply() -> None:
    """The README's main command: chat template, default model, greedy, streamed + JSON."""
    done = _script(
        "--json", "--max-tokens", "16", "--device", "cpu", "What is the capital of France?"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    summary = json.loads(lines[-1])
    assert summary["text"] == "The capital of France is Paris."
    assert summary["finish_reason"] == "stop"
    assert lines[0] == summary["text"]  # streamed before the summary
