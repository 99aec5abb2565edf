"""scripts/gpu-check.sh and scripts/gpu-wheels.sh (issue 33), without a GPU.

The check runs on a lent GPU machine a few minutes at a time; these keep it from rotting
between loans: its steps in dry mode (each command logged, nothing run), the deadline
that skips what no longer fits, and what the commands name (files, the pytest marker,
the benchmarks' model shapes and arguments) checked here.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnode.engine.config import ModelConfig
from tests.conftest import REPO_ROOT

STEPS = ["install", "model", "pytest", "gemv", "bench", "bench-8b", "split"]


def _check(out: Path, seconds: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPU_CHECK_DRY": "1"}
    script = REPO_ROOT / "scripts" / "gpu-check.sh"
    return subprocess.run(
        ["bash", str(script), str(out), str(seconds)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_dry_run_logs_every_step_in_order(tmp_path: Path) -> None:
    run = _check(tmp_path, 480)
    assert run.returncode == 0, run.stderr
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == STEPS
    assert all(": dry (limit " in line for line in lines[:-1])
    assert lines[-1].startswith("failed or not run: 0;")
    for name in STEPS:  # each step's command, as it would run
        argv = shlex.split((tmp_path / f"{name}.log").read_text())
        for arg in argv:  # the repo files a command names exist
            if arg.startswith(("benchmarks/", "tests/")):
                assert (REPO_ROOT / arg).exists(), arg
    install = shlex.split((tmp_path / "install.log").read_text())
    assert {"--no-index", "--no-deps", "--target"} <= set(install)


def test_the_deadline_skips_what_no_longer_fits(tmp_path: Path) -> None:
    run = _check(tmp_path, 3)
    assert run.returncode == len(STEPS)
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert lines[:-1] == [f"{name}: skipped, deadline reached" for name in STEPS]


def test_the_pytest_step_selects_the_gpu_tests() -> None:
    """The marker expression of the pytest step collects the device tests (they skip here)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "--collect-only", "-p",
         "no:cacheprovider", "tests/engine/test_gpu_kernels.py", "tests/engine/test_gpu_stage.py",
         "tests/engine/test_gpu_paged.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_gpu_stage.py::" in run.stdout
    assert "test_gpu_paged.py::" in run.stdout  # the CUDA stage's pool of KV blocks


def _benchmark(name: str) -> Any:
    """The module ``benchmarks/<name>.py``, imported from its file."""
    path = REPO_ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_benchmark_arguments_and_shapes() -> None:
    gpu, gpu_split = _benchmark("gpu"), _benchmark("gpu_split")
    ((label, _fmt, source),) = gpu.sources(["8b"], ["q8_0"], tiny=False)
    config = ModelConfig.from_hf(source.config)
    assert (label, config.hidden_size, config.num_layers) == ("llama-8b-shape", 4096, 32)
    assert config.layer_params(0) * 32 > 6.9e9  # ~7e9 in the layers, 0.5e9 more embedded
    with pytest.raises(SystemExit):
        gpu_split.main(["--host-device", "tpu"])


def test_the_gemv_benchmark_builds_finite_weights_of_the_8b_shape() -> None:
    """benchmarks/gpu_gemv.py's random rows decode to finite values in every format it
    times (a NaN scale would time nothing real), at the 8B layer's matrix shapes."""
    from meshnode.engine.cuda import formats

    gemv = _benchmark("gpu_gemv")
    assert dict((n, (o, i)) for n, o, i in gemv.SHAPES)["gate_up"] == (2 * 14336, 4096)
    rng = np.random.default_rng(0)
    for fmt in gemv.FORMATS:
        raw = gemv.random_rows(fmt, 3, 512, rng)
        assert raw.shape == (3, formats.row_bytes(fmt, 512))
        assert np.isfinite(formats.decode_units(raw, fmt, 512)).all()


def test_the_gemv_benchmarks_variants_compile_for_the_device(tmp_path: Path) -> None:
    """The variants benchmarks/gpu_gemv.py compiles beside the engine's gemv (other block
    widths, the first run's layout) compile to PTX, as the engine's kernels do in
    tests/engine/test_ops_emulated.py."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    from meshnode.engine.cuda import kernels
    from meshnode.engine.cuda.formats import CPP_NAME

    gemv = _benchmark("gpu_gemv")
    fmts = list(CPP_NAME.values())
    rows: tuple[int, ...] = kernels.GEMV_ROWS
    cases = [(f"-DMN_GEMV_WARPS={w}", "", "gemv", rows) for w in gemv.WIDTHS.values()]
    cases.append(("-DMN_GEMV_WARPS=4", gemv.BLOCK64, "gemv_block64", ()))
    for define, extra, name, instances in cases:
        args = [f"{f}, {r}" for f in fmts for r in instances] if instances else fmts
        refs = ", ".join(f"(void*)&{name}<{a}>" for a in args)
        src = tmp_path / "v.cu"
        src.write_text(kernels.SOURCE + extra + f"\nvoid* const mn_v[] = {{{refs}}};\n")
        cmd = [nvcc, "-ptx", "-arch=compute_75", "-diag-suppress", "177", define, str(src)]
        run = subprocess.run(
            [*cmd, "-o", str(tmp_path / "v.ptx")], capture_output=True, timeout=120
        )
        assert run.returncode == 0, run.stderr.decode()
        assert (tmp_path / "v.ptx").read_text().count(f".entry _Z{len(name)}{name}I") == len(args)


def test_the_lease_script_untracks_the_unread_references_and_restores_them(
    tmp_path: Path,
) -> None:
    """scripts/gpu-lease.sh, in a clone of this repo with small stand-ins for the wheels and
    the model's halves and a cap the tree alone is over: prepare takes the reference
    safetensors out of the index (ignored, so they do not travel, and still on disk) and
    the calls fit; restore leaves the clone as it was."""
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    for part, size in (
        (".whl/x.whl", 1000),
        (".gpu-model/a/part-a", 1000),
        (".gpu-model/b/part-b", 1000),
    ):
        (clone / part).parent.mkdir(parents=True, exist_ok=True)
        (clone / part).write_bytes(b"\0" * size)
    refs = subprocess.run(
        ["git", "ls-files", "tests/golden/moe/*.safetensors", "tests/golden/tiny/*.safetensors"],
        cwd=clone, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert refs
    tracked = sum((clone / f).stat().st_size for f in subprocess.run(
        ["git", "ls-files"], cwd=clone, capture_output=True, text=True, check=True
    ).stdout.split())  # fmt: skip
    refs_bytes = sum((clone / f).stat().st_size for f in refs)
    env = {**os.environ, "GPU_LEASE_CAP": str(tracked - refs_bytes + 100_000)}
    script = ["bash", str(clone / "scripts" / "gpu-lease.sh")]

    def git_status() -> str:
        run = subprocess.run(
            ["git", "status", "--short"], cwd=clone, capture_output=True, text=True
        )
        return run.stdout

    prepare = subprocess.run(
        [*script, "prepare"], cwd=clone, env=env, capture_output=True, text=True
    )
    assert prepare.returncode == 0, prepare.stdout + prepare.stderr
    assert f"took {len(refs)} reference files out of the index" in prepare.stdout
    status = git_status().splitlines()
    assert sorted(status) == sorted(f"D  {f}" for f in refs)  # nothing untracked travels
    assert all((clone / f).exists() for f in refs)
    restore = subprocess.run(
        [*script, "restore"], cwd=clone, env=env, capture_output=True, text=True
    )
    assert restore.returncode == 0, restore.stderr
    assert git_status() == ""
    exclude = (clone / ".git" / "info" / "exclude").read_text()
    assert "gpu-lease" not in exclude


def test_wheels_target_the_gpu_machines_python() -> None:
    run = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "gpu-wheels.sh"), "--dry"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    download = run.stdout.splitlines()[0]
    assert "--python-version 3.12" in download
    assert "--platform manylinux_2_28_x86_64" in download
    assert "--only-binary=:all:" in download
    assert ".whl" in download
