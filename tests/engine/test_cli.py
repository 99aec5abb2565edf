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
from tests.conftest import GOLDEN_DIR
from tests.e2e.cluster import CLI_TIMEOUT_S

MESHNODE = Path(sys.executable).parent / "meshnode"
runner = CliRunner()
assert _commands


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    # a first start compiles its kernels (q8's, by default: ~37 s of CPU for SmolLM2 at
    # load 5-12), which took over 120 s with both cores busy and the tests niced
    return subprocess.run(
        [str(MESHNODE), "generate", *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S
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


def test_console_script_missing_model_file(tmp_path: Path) -> None:
    done = _script("--model", str(tmp_path / "model.gguf"), "hi")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"meshnode generate: error: {str(tmp_path / 'model.gguf')!r}: no such file or folder"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf': no such file"),
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
    """The README's main command: chat template, default model, greedy, streamed + JSON,
    in the exact mode. (The default, q8, answers "L'Étoile, la Marseillaise, la femme,",
    as llama.cpp's llama-server does with the same GGUF: the first token is a near tie.)"""
    question = "What is the capital of France?"
    done = _script("--json", "--max-tokens", "16", "--device", "cpu", "--dtype", "native", question)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    summary = json.loads(lines[-1])
    assert summary["text"] == "The capital of France is Paris."
    assert summary["finish_reason"] == "stop"
    assert lines[0] == summary["text"]  # streamed before the summary


def test_prompt_ids_in_token_ids_out_on_a_model_without_tokenizer() -> None:
    """The tiny Qwen 3 reference has no tokenizer: ids in, the reference's ids out."""
    folder = GOLDEN_DIR / "tiny" / "qwen3-tiny"
    golden = json.loads((folder / "golden.json").read_text())["prompts"][0]
    ids = ",".join(str(t) for t in golden["prompt_ids"])
    args = ["--model", str(folder), "--prompt-ids", ids, "--json", "--max-tokens", "8"]
    done = _script(*args, "--device", "cpu", "--dtype", "native")  # exact: the reference's
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["prompt_token_ids"] == golden["prompt_ids"]
    assert summary["token_ids"] == golden["gen_ids"][:8]
    text = runner.invoke(app, ["generate", "--model", str(folder), "--device", "cpu", "hi"])
    assert text.exit_code == 2
    assert "no tokenizer" in text.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-ids", "1,x,3"], "'x' is not a token id"),
        (["--prompt-ids", "1,2", "hello"], "give PROMPT or --prompt-ids"),
        ([], "give PROMPT or --prompt-ids"),
        (["--prompt-ids", "5,512"], "token id 512 is outside the vocabulary (0..511)"),
    ],
)
def test_bad_prompt_ids_exit_2(args: list[str], message: str) -> None:
    folder = str(GOLDEN_DIR / "tiny" / "qwen3-tiny")
    result = runner.invoke(app, ["generate", "--model", folder, "--device", "cpu", *args])
    assert result.exit_code == 2
    assert message in result.output
