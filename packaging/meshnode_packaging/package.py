"""Open a layer package folder — whole or partial — as a ``ModelSource``.

A stage's cache folder holds the manifest and only the files its layer range needs, so
:func:`open_package` never assumes a file is present: each tensor file is opened (its header
parsed, its data memory-mapped) the first time one of its tensors is asked for. Asking for a
tensor whose file was not materialized raises :class:`~meshnode_packaging.errors.MissingPart`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshnode_packaging.errors import InvalidPackage, MissingPart
from meshnode_packaging.manifest import Manifest
from meshnode_packaging.sources import RawTensor
from meshnode_packaging.tensorfile import TensorFile
from meshnode_packaging.validate import manifest_problems


class PackageSource:
    """A ``ModelSource`` over a package folder; tensors are read lazily from memory maps."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder = folder
        self.manifest = manifest
        self.config: dict[str, Any] = manifest.config
        self.chat_template: str | None = manifest.chat_template
        self.sampling_defaults = manifest.sampling
        self._file_of = {name: e["file"] for e in manifest.parts() for name in e["tensors"]}
        self._open: dict[str, TensorFile] = {}
        self._tokenizer_json: str | None = None

    @property
    def tokenizer_json(self) -> str:
        """The ``tokenizer.json`` document (only materialized with the embedding stage)."""
        if self._tokenizer_json is None:
            rel = str(self.manifest.data["tokenizer"]["file"])
            path = self.folder / rel
            if not path.is_file():
                raise MissingPart(f"{rel} is not materialized in {self.folder}")
            self._tokenizer_json = path.read_text(encoding="utf-8")
        return self._tokenizer_json

    @tokenizer_json.setter
    def tokenizer_json(self, value: str) -> None:
        # ModelSource declares a plain attribute; a setter keeps this class assignable to it
        # while a stage without the tokenizer file still opens (and fails only if it asks).
        self._tokenizer_json = value

    def has_file(self, rel: str) -> bool:
        """Whether ``rel`` (a path relative to the package root) is present in the folder."""
        return (self.folder / rel).is_file()

    def tensor_names(self) -> list[str]:
        """Names of the tensors whose files are present, in manifest order."""
        return [n for n, rel in self._file_of.items() if self.has_file(rel)]

    def tensor(self, name: str) -> RawTensor:
        """Tensor ``name`` in its stored dtype; its data is a view of a memory-mapped file."""
        rel = self._file_of.get(name)
        if rel is None:
            raise MissingPart(f"no tensor {name!r} in package {self.folder}")
        tf = self._open.get(rel)
        if tf is None:
            if not self.has_file(rel):
                raise MissingPart(f"tensor {name!r} lives in {rel}, not materialized here")
            tf = self._open[rel] = TensorFile(self.folder / rel)
        return tf.raw(name)


def open_package(folder: str | Path) -> PackageSource:
    """Open the package in ``folder``; raise :class:`InvalidPackage` if its manifest is bad.

    Only the manifest is read here. File sizes and hashes are the materializer's and the
    validator's business (:func:`meshnode_packaging.validate.validate_package`).
    """
    path = Path(folder)
    manifest = Manifest.load(path)
    problems = manifest_problems(manifest)
    if problems:
        raise InvalidPackage(problems)
    return PackageSource(path, manifest)
