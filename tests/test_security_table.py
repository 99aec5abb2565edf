"""The security page's table names, for every row, the tests that prove it (issue 15):
each named test exists, and the table covers strangers, members, hubs and HTTP clients."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The page and the section holding the table.
PAGE = ROOT / "docs" / "security.md"
SECTION = "## Who can do what"
#: A proof reference in the table: ``node/test_x.py`` or ``node/test_x.py::test_name``.
PROOF = re.compile(r"`([\w/]+\.py)(?:::(\w+))?`")


def _rows() -> list[list[str]]:
    text = PAGE.read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    }


def test_every_row_names_tests_that_exist() -> None:
    rows = _rows()
    assert len(rows) > 10
    for who, _can, _cannot, proof in rows:
        refs = PROOF.findall(proof)
        assert refs, f"row {who!r} names no test"
        for file, name in refs:
            path = ROOT / "tests" / file
            assert path.is_file(), f"row {who!r}: no {path}"
            if name:
                assert name in _test_names(path), f"row {who!r}: no {file}::{name}"


def test_the_table_covers_every_kind_of_party() -> None:
    parties = " ".join(row[0] for row in _rows()).lower()
    for party in ("stranger", "member", "hub", "http client"):
        assert party in parties, party
