"""A model's own sampling defaults: read from GGUF ``general.sampling.*`` and from a
checkpoint's ``generation_config.json``, carried by a package as ``generation.sampling``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from meshnode_packaging.package import open_package
from meshnode_packaging.sources import GGUFSource, HFFolderSource, sampling_defaults
from meshnode_packaging.validate import validate_package
from meshnode_packaging.writer import write_package

from tests.packaging.tinymodel import write_tiny_gguf, write_tiny_hf_repo

GGUF_SAMPLING: dict[str, float | int] = {"temp": 0.5, "top_k": 20, "top_p": 0.75,
                                         "penalty_repeat": 1.25}  # fmt: skip
EXPECTED = {"temperature": 0.5, "top_k": 20, "top_p": 0.75, "repetition_penalty": 1.25}


@pytest.fixture(scope="module")
def sampled_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "sampled.gguf"
    return write_tiny_gguf(path, layers=2, sampling=GGUF_SAMPLING)


def test_a_gguf_carries_its_sampling_defaults(sampled_gguf: Path, tiny_gguf: Path) -> None:
    assert sampling_defaults(GGUFSource(sampled_gguf)) == EXPECTED
    assert sampling_defaults(GGUFSource(tiny_gguf)) == {}


def test_a_checkpoint_reads_generation_config(tiny_gguf: Path, tmp_path: Path) -> None:
    folder = write_tiny_hf_repo(tmp_path / "hf", tiny_gguf, shards=1)
    assert sampling_defaults(HFFolderSource(folder)) == {}
    config = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9,
              "top_k": 40, "min_p": None, "max_new_tokens": 99}  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults(HFFolderSource(folder)) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 40,
    }


def test_a_package_keeps_them_and_validates(sampled_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    manifest = write_package(sampled_gguf, out, model_id="sampled")
    assert manifest.data["generation"]["sampling"] == EXPECTED
    assert validate_package(out) == []
    assert sampling_defaults(open_package(out)) == EXPECTED
