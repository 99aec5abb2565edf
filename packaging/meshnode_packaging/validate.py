"""Check a layer package: the manifest against its schema and itself, and every file on disk.

Every finding is a :class:`~meshnode_packaging.errors.Problem` naming the file and the field, and
the checks go on after the first one, so that a publisher sees everything wrong in one run.
A *partial* package (a stage's materialized subset) is checked for the files it holds, or for the
files of one :class:`~meshnode_packaging.manifest.Part`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema

from meshnode_packaging.errors import InvalidPackage, Problem
from meshnode_packaging.manifest import MANIFEST_NAME, Manifest, Part, schema
from meshnode_packaging.tensorfile import TensorFile

_HASH_CHUNK_BYTES = 4 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _json_path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def schema_problems(data: dict[str, Any]) -> list[Problem]:
    """Schema violations of a manifest document, one per failing field."""
    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    return [Problem(MANIFEST_NAME, _json_path(e.absolute_path), e.message) for e in errors]


def layer_range_problems(ranges: list[tuple[int, int]], num_layers: int) -> list[Problem]:
    """Gaps, overlaps, empty and out-of-bounds ranges among layer files' ``[start, end)``."""
    problems: list[Problem] = []
    covered = 0
    for i, (start, end) in sorted(enumerate(ranges), key=lambda x: x[1]):
        field = f"layers[{i}]"
        if end <= start:
            problems.append(Problem(MANIFEST_NAME, field, f"empty range [{start}, {end})"))
            continue
        if start > covered:
            problems.append(Problem(MANIFEST_NAME, field, f"layers [{covered}, {start}) missing"))
        elif start < covered:
            problems.append(
                Problem(MANIFEST_NAME, field, f"[{start}, {end}) overlaps layers below {covered}")
            )
        if end > num_layers:
            problems.append(
                Problem(MANIFEST_NAME, field, f"end {end} exceeds num_hidden_layers {num_layers}")
            )
        covered = max(covered, end)
    if covered < num_layers:
        problems.append(
            Problem(MANIFEST_NAME, "layers", f"layers [{covered}, {num_layers}) missing")
        )
    return problems


def _reference_problems(m: Manifest) -> list[Problem]:
    problems: list[Problem] = []
    named = [
        ("embed", m.data["embed"]),
        ("head", m.data["head"]),
        ("tokenizer", m.data["tokenizer"]),
    ]
    named += [(f"layers[{i}]", e) for i, e in enumerate(m.layers)]
    for field, entry in named:
        if entry["file"] not in m.files:
            problems.append(
                Problem(MANIFEST_NAME, f"{field}.file", f"{entry['file']!r} not listed in files")
            )
    return problems


def manifest_problems(m: Manifest) -> list[Problem]:
    """Everything wrong with a manifest by itself (no file is read)."""
    # The schema pins the format name and version, so a newer format stops here rather than
    # being misread; the checks below assume the schema's structure.
    problems = schema_problems(m.data)
    if problems:
        return problems
    ranges = [(int(e["start"]), int(e["end"])) for e in m.layers]
    return layer_range_problems(ranges, m.num_layers) + _reference_problems(m)


def _tensor_problems(path: Path, rel: str, expected: set[str]) -> list[Problem]:
    try:
        names = set(TensorFile(path).names())
    except InvalidPackage as exc:
        return [Problem(rel, p.field, p.message) for p in exc.problems]
    problems = [
        Problem(rel, n, "tensor listed in the manifest is missing") for n in expected - names
    ]
    problems += [Problem(rel, n, "tensor not listed in the manifest") for n in names - expected]
    return sorted(problems, key=lambda p: p.field)


def file_problems(
    folder: Path, m: Manifest, rel: str, *, check_hashes: bool = True
) -> list[Problem]:
    """Size, sha256 and (for tensor files) tensor list of one file against the manifest."""
    entry = m.files[rel]
    path = folder / rel
    if not path.is_file():
        return [Problem(rel, "", "missing")]
    problems: list[Problem] = []
    size = path.stat().st_size
    if size != entry["size"]:
        problems.append(Problem(rel, "size", f"is {size} bytes, manifest says {entry['size']}"))
    elif check_hashes and (digest := sha256_file(path)) != entry["sha256"]:
        problems.append(Problem(rel, "sha256", f"is {digest}, manifest says {entry['sha256']}"))
    tensors = {e["file"]: set(e["tensors"]) for e in m.parts()}
    if not problems and rel in tensors:
        problems += _tensor_problems(path, rel, tensors[rel])
    return problems


def validate_package(
    folder: Path, *, part: Part | None = None, check_hashes: bool = True
) -> list[Problem]:
    """Every problem of the package in ``folder`` (or of the files that ``part`` needs).

    Returns an empty list for a valid package. Never raises for a bad package: a missing or
    unparsable manifest is itself reported as a problem.
    """
    try:
        m = Manifest.load(folder)
    except InvalidPackage as exc:
        return exc.problems
    problems = manifest_problems(m)
    if problems:
        return problems
    wanted = list(m.files) if part is None else m.files_for(part)
    for rel in wanted:
        problems += file_problems(folder, m, rel, check_hashes=check_hashes)
    return problems


def check_package(folder: Path, *, part: Part | None = None) -> Manifest:
    """Validate and return the manifest; raise :class:`InvalidPackage` listing every problem."""
    problems = validate_package(folder, part=part)
    if problems:
        raise InvalidPackage(problems)
    return Manifest.load(folder)
