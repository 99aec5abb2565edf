"""Fixtures of the node tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from meshnode_packaging.testing import LocalHub
from meshnode_packaging.writer import write_package

from tests.engine.tiny import write_tiny_model
from tests.node.inmemory import REF


@pytest.fixture
def hub_ref(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """The tiny model as a layer package on a loopback hub; (ref, package folder)."""
    gguf_path = write_tiny_model(tmp_path / "model", "Q8_0")
    package = tmp_path / "package"
    write_package(gguf_path, package)
    with LocalHub() as hub:
        hub.add_repo("test/tiny", package)
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield REF, package
