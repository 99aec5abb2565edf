"""Fixtures of the packaging tests: tiny GGUF models, packages written from them, a local hub."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from meshnode_packaging.testing import LocalHub
from meshnode_packaging.writer import write_package

from tests.packaging.tinymodel import write_tiny_gguf

REPO = "org/tiny"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 30-layer random Llama whose head is tied to its embedding."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tied=True)


@pytest.fixture(scope="session")
def tiny_gguf_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 30-layer random Llama with its own output projection."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "untied.gguf", tied=False, seed=1)


@pytest.fixture(scope="session")
def tiny_package_ro(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    """The package of ``tiny_gguf``, shared by the session: never modify it."""
    out = tmp_path_factory.mktemp("pkg") / "tiny"
    write_package(tiny_gguf, out, model_id="tiny")
    return out


@pytest.fixture
def tiny_package(tmp_path: Path, tiny_package_ro: Path) -> Path:
    """A private copy of the tiny package, free to damage."""
    return Path(shutil.copytree(tiny_package_ro, tmp_path / "pkg"))


@pytest.fixture
def hub(tiny_package: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    """A loopback hub serving ``tiny_package`` as ``org/tiny``; HF_ENDPOINT points at it."""
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    with LocalHub() as h:
        h.add_repo(REPO, tiny_package)
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        yield h
