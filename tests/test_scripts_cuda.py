"""scripts/cuda_extra.sh: which CUDA extra install.sh adds, against stand-in nvidia-smi's.

Only the picking functions run (sourced into bash); nothing is installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "cuda_extra.sh"

# The first lines of nvidia-smi's output, as drivers print them.
HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.82.07              Driver Version: 580.82.07      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""


def _smi(folder: Path, cuda: str | None, *, status: int = 0) -> Path:
    """A stand-in ``nvidia-smi`` printing the header for ``cuda`` (nothing if None)."""
    path = folder / "nvidia-smi"
    text = "" if cuda is None else HEADER.format(cuda=cuda)
    path.write_text(f"#!/bin/sh\ncat <<'END'\n{text}END\nexit {status}\n")
    path.chmod(0o755)
    return path


def _bash(snippet: str, smi: Path, extras: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MESHNODE_EXTRAS"}
    env["NVIDIA_SMI"] = str(smi)
    if extras is not None:
        env["MESHNODE_EXTRAS"] = extras
    script = f"set -euo pipefail; . {SCRIPT}; {snippet}"
    run = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    return run.stdout.strip()


@pytest.mark.parametrize(
    ("cuda", "extra"),
    [("12.4", "cuda12"), ("12.0", "cuda12"), ("13.0", "cuda13"), ("14.1", "cuda13"), ("11.8", "")],
)
def test_cuda_extra_follows_the_driver_cuda_version(tmp_path: Path, cuda: str, extra: str) -> None:
    assert _bash("cuda_extra", _smi(tmp_path, cuda)) == extra


def test_no_nvidia_smi_or_a_failing_one_picks_nothing(tmp_path: Path) -> None:
    assert _bash("cuda_extra", tmp_path / "absent") == ""
    assert _bash("cuda_extra", _smi(tmp_path, None, status=9)) == ""


def test_install_adds_the_extra_only_when_meshnode_extras_is_unset(tmp_path: Path) -> None:
    smi = _smi(tmp_path, "12.8")
    assert _bash('meshnode_extras ""', smi) == "cuda12"
    assert _bash("meshnode_extras test", smi) == "test,cuda12"
    assert _bash("meshnode_extras test", smi, extras="") == "test"  # set, even empty: as given
    assert _bash("meshnode_extras test", smi, extras="cuda13") == "test"
    # No driver: exactly the extras asked for, as before this script existed.
    assert _bash("meshnode_extras test", tmp_path / "absent") == "test"
    assert _bash('meshnode_extras ""', tmp_path / "absent") == ""


def test_install_script_sources_the_picker() -> None:
    text = (REPO_ROOT / "scripts" / "install.sh").read_text()
    assert '. "$root/scripts/cuda_extra.sh"' in text
    assert 'extras="$(meshnode_extras "${1:-}")"' in text
