"""``meshnode package write|validate|fetch`` through the real typer app."""

from __future__ import annotations

from pathlib import Path

from meshnode_packaging.manifest import Manifest
from meshnode_packaging.testing import LocalHub
from typer.testing import CliRunner

from meshnode.cli import app
from meshnode.cli import commands as _commands  # noqa: F401  (registers the sub-apps)

runner = CliRunner()


def test_write_then_validate(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    result = runner.invoke(
        app,
        [
            "package",
            "write",
            str(tiny_gguf),
            "--out",
            str(out),
            "--dtype",
            "f16",
            "--speculative-default",
            "ng",
            "--strategy",
            "ng:type=ngram,policy=adaptive,max_window=6",
        ],
    )
    assert result.exit_code == 0, result.output
    m = Manifest.load(out)
    assert m.speculative_decoding is not None
    assert m.speculative_decoding["strategies"]["ng"]["window_policy"]["max_window"] == 6
    result = runner.invoke(app, ["package", "validate", str(out)])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output


def test_validate_lists_problems_and_exits_2(tiny_package: Path) -> None:
    (tiny_package / "layers/00003.safetensors").unlink()
    (tiny_package / "head.safetensors").write_bytes(b"x")
    result = runner.invoke(app, ["package", "validate", str(tiny_package)])
    assert result.exit_code == 2
    assert "error: layers/00003.safetensors: missing" in result.output
    assert "error: head.safetensors: size: is 1 bytes" in result.output


def test_bad_input_exits_2(tiny_package: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["package", "write", str(tmp_path / "nope.gguf"), "--out", "x"])
    assert result.exit_code == 2
    assert "error:" in result.output
    result = runner.invoke(app, ["package", "fetch", str(tiny_package), "--layers", "3-4"])
    assert result.exit_code == 2
    assert "START:END" in result.output


def test_fetch_prints_the_stage_folder(hub: LocalHub, tmp_path: Path) -> None:
    args = ["package", "fetch", "hf://org/tiny", "--layers", "10:20", "--cache-dir", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    folder = Path(result.output.strip())
    assert sorted(p.name for p in (folder / "layers").iterdir()) == [
        f"{i:05d}.safetensors" for i in range(10, 20)
    ]
    result = runner.invoke(
        app,
        ["package", "fetch", "hf://org/absent", "--layers", "0:1", "--cache-dir", str(tmp_path)],
    )
    assert result.exit_code == 2
    assert "404" in result.output


def test_fetch_of_a_local_folder_checks_the_parts_files(tiny_package: Path) -> None:
    args = ["package", "fetch", str(tiny_package), "--layers", "3:5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tiny_package)
    (tiny_package / "layers/00004.safetensors").unlink()
    layer = tiny_package / "layers/00003.safetensors"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    layer.write_bytes(bytes(data))
    (tiny_package / "layers/00009.safetensors").unlink()  # outside the part: not looked at
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("error: layers/00003.safetensors: sha256: is ")
    assert lines[1] == "error: layers/00004.safetensors: missing"
    assert "is a local folder, so nothing can fetch it again" in lines[2]
    assert len(lines) == 3
