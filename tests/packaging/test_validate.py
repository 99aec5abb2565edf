"""The validator lists every problem with its file and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from meshnode_packaging.errors import InvalidPackage
from meshnode_packaging.manifest import MANIFEST_NAME, Part
from meshnode_packaging.validate import check_package, layer_range_problems, validate_package


def _edit_manifest(folder: Path, edit: Any) -> None:
    path = folder / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _where(problems: list[Any]) -> list[tuple[str, str]]:
    return [(p.file, p.field) for p in problems]


def test_a_fresh_package_is_valid(tiny_package_ro: Path) -> None:
    assert validate_package(tiny_package_ro) == []
    assert check_package(tiny_package_ro).num_layers == 30


def test_wrong_sha256_and_size_are_named(tiny_package: Path) -> None:
    layer = tiny_package / "layers/00004.safetensors"
    raw = bytearray(layer.read_bytes())
    raw[-1] ^= 0xFF  # same size, different bytes
    layer.write_bytes(bytes(raw))
    with (tiny_package / "tokenizer.json").open("a") as f:
        f.write(" ")
    problems = validate_package(tiny_package)
    assert _where(problems) == [("layers/00004.safetensors", "sha256"), ("tokenizer.json", "size")]
    assert "manifest says" in str(problems[0])


def test_missing_layer_file(tiny_package: Path) -> None:
    (tiny_package / "layers/00007.safetensors").unlink()
    assert _where(validate_package(tiny_package)) == [("layers/00007.safetensors", "")]
    # A stage that does not need layer 7 is still fine with this folder.
    assert validate_package(tiny_package, part=Part(10, 20)) == []


def test_overlapping_and_missing_ranges(tiny_package: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["layers"][3]["end"] = 5  # [3, 5) overlaps layer 4's [4, 5)
        del data["layers"][10]  # layer 10 now missing

    _edit_manifest(tiny_package, edit)
    problems = validate_package(tiny_package)
    assert [str(p) for p in problems] == [
        "model-package.json: layers[4]: [4, 5) overlaps layers below 5",
        "model-package.json: layers[10]: layers [10, 11) missing",
    ]


def test_range_checks_as_a_table() -> None:
    assert layer_range_problems([(0, 2), (2, 4)], 4) == []
    assert [p.message for p in layer_range_problems([(0, 2)], 4)] == ["layers [2, 4) missing"]
    assert [p.message for p in layer_range_problems([(1, 4)], 4)] == ["layers [0, 1) missing"]
    assert [p.message for p in layer_range_problems([(0, 3), (2, 4)], 4)] == [
        "[2, 4) overlaps layers below 3"
    ]
    assert [p.message for p in layer_range_problems([(0, 5)], 4)] == [
        "end 5 exceeds num_hidden_layers 4"
    ]
    assert [p.message for p in layer_range_problems([(0, 4), (2, 2)], 4)] == ["empty range [2, 2)"]


def test_schema_violations_name_the_field(tiny_package: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["files"]["embed.safetensors"]["sha256"] = "not-a-hash"
        data["format"]["version"] = 99
        data["generation"] = {
            "speculative_decoding": {
                "default": "n",
                "strategies": {"n": {"type": "ngram", "window_policy": {"default": "wild"}}},
            }
        }

    _edit_manifest(tiny_package, edit)
    where = _where(validate_package(tiny_package))
    assert ("model-package.json", "files.embed.safetensors.sha256") in where
    assert ("model-package.json", "format.version") in where
    strategy = "generation.speculative_decoding.strategies.n.window_policy"
    assert ("model-package.json", strategy) in where  # required keys missing
    assert ("model-package.json", strategy + ".default") in where


def test_tensor_list_mismatch(tiny_package: Path) -> None:
    _edit_manifest(tiny_package, lambda d: d["layers"][2]["tensors"].append("layers.2.extra"))
    assert _where(validate_package(tiny_package)) == [
        ("layers/00002.safetensors", "layers.2.extra")
    ]


def test_unreadable_manifest(tmp_path: Path) -> None:
    assert "missing" in str(validate_package(tmp_path)[0])
    (tmp_path / MANIFEST_NAME).write_text("{")
    assert "not JSON" in str(validate_package(tmp_path)[0])
    with pytest.raises(InvalidPackage, match="1 problem"):
        check_package(tmp_path)


@pytest.mark.parametrize("name", ["../../escape.bin", "/etc/passwd", "layers/../../x", "a\\b"])
def test_a_manifest_cannot_name_a_file_outside_its_folder(tiny_package: Path, name: str) -> None:
    """A fetched manifest's file names become paths in the cache (issue 15, item 5)."""

    def edit(data: dict[str, Any]) -> None:
        data["files"][name] = data["files"]["tokenizer.json"]

    _edit_manifest(tiny_package, edit)
    problems = validate_package(tiny_package)
    assert any(p.file == MANIFEST_NAME and p.field == "files" for p in problems), problems
