"""What the docs and docstrings point at exists: files moved or renamed leave no stale
references behind.

Two kinds of reference are checked, in the READMEs and in every source file's docstrings
and comments (the CHANGELOG is history, and names what has since moved):

- a backticked path from the repository root (its first folder is one of the repository's
  own), optionally with ``::name`` (a test or a function in that file);
- a Sphinx cross-reference (``:mod:``, ``:class:``, ``:func:``, …) to a fully qualified
  name in ``meshnode``, ``meshnode_protocol`` or ``meshnode_packaging``: the module must
  exist and define (or import) the first name after it.

A path may also be relative to ``tests/`` (the README's tables name tests that way).
Other relative paths and bare dotted names (logger names, JSON fields) are ambiguous and
left alone.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from tests.conftest import REPO_ROOT

#: The repository's own top-level folders: a backticked path starting with one of them is
#: a path from the root.
TOP_FOLDERS = ("meshnode", "protocol", "packaging", "tests", "scripts", "benchmarks", "deploy")
#: Where references are read: these folders' text files, and the READMEs.
SOURCE_SUFFIXES = {".py", ".sh", ".md", ".toml", ".cfg", ".yml", ".yaml", ".service"}
SKIP_PARTS = {".venv", "__pycache__", "build", "dist", ".git", "node_modules"}
#: History: it names files that have since moved, on purpose.
SKIP_FILES = {REPO_ROOT / "CHANGELOG.md"}

#: `meshnode/node/worker.py`, ``tests/e2e/cluster.py::Cluster``, `protocol/vectors/`.
_TOPS = "|".join(map(re.escape, TOP_FOLDERS))
PATH_REF = re.compile(rf"`{{1,2}}((?:{_TOPS})/[\w./-]*)(?:::(\w+))?`{{1,2}}")
#: :func:`meshnode.engine.loader.reading_model`, :class:`~meshnode_protocol.Hello`.
SPHINX_REF = re.compile(
    r":(?:mod|class|func|meth|attr|data|exc|obj):`~?(meshnode(?:_protocol|_packaging)?(?:\.\w+)*)`"
)
#: Where each distribution's import package lives in the repository.
PACKAGE_DIRS = {
    "meshnode": REPO_ROOT / "meshnode",
    "meshnode_protocol": REPO_ROOT / "protocol" / "meshnode_protocol",
    "meshnode_packaging": REPO_ROOT / "packaging" / "meshnode_packaging",
}


def _sources() -> list[Path]:
    files = [p for p in REPO_ROOT.glob("*.md") if p not in SKIP_FILES]
    for top in TOP_FOLDERS:
        for path in (REPO_ROOT / top).rglob("*"):
            if (
                path.suffix in SOURCE_SUFFIXES
                and path.is_file()
                and not SKIP_PARTS.intersection(path.relative_to(REPO_ROOT).parts)
            ):
                files.append(path)
    return sorted(files)


@cache
def _defined(module: Path) -> frozenset[str]:
    """Names a module binds at its top level (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _module(parts: list[str]) -> tuple[Path | None, list[str]]:
    """The file of the longest module prefix of ``parts`` and the names after it."""
    base = PACKAGE_DIRS[parts[0]]
    for end in range(len(parts), 0, -1):
        folder = base.joinpath(*parts[1:end])
        for candidate in (folder / "__init__.py", folder.with_suffix(".py")):
            # ``meshnode.py`` is no module of ours: the top is the package folder.
            if (end > 1 or candidate.name == "__init__.py") and candidate.is_file():
                return candidate, parts[end:]
    return None, parts


def _path_problem(ref: str, name: str) -> str | None:
    if any(c in ref for c in "*<>{}") or ref.endswith("."):
        return None  # a pattern or a placeholder, not a path
    # The README's tables name tests relative to tests/ (``protocol/test_vectors.py``).
    path = next((p for p in (REPO_ROOT / ref, REPO_ROOT / "tests" / ref) if p.exists()), None)
    if path is None:
        return f"no {ref}"
    if name and path.suffix == ".py" and name not in _defined(path):
        return f"{ref} defines no {name}"
    return None


def _sphinx_problem(ref: str) -> str | None:
    module, rest = _module(ref.split("."))
    if module is None:
        return f"no module for {ref}"
    if not rest or rest[0] in _defined(module):
        return None
    # A package's submodule is reachable as an attribute too.
    if module.name == "__init__.py" and (module.parent / f"{rest[0]}.py").is_file():
        return None
    return f"{module.relative_to(REPO_ROOT)} defines no {rest[0]} ({ref})"


def _problems(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    where = path.relative_to(REPO_ROOT)
    found = [(m, _path_problem(m[1], m[2] or "")) for m in PATH_REF.finditer(text)]
    found += [(m, _sphinx_problem(m[1])) for m in SPHINX_REF.finditer(text)]
    return [
        f"{where}:{text.count(chr(10), 0, m.start()) + 1}: {problem}"
        for m, problem in found
        if problem is not None
    ]


def test_every_path_and_cross_reference_in_the_docs_exists() -> None:
    sources = _sources()
    assert REPO_ROOT / "README.md" in sources
    assert REPO_ROOT / "meshnode" / "node" / "worker.py" in sources
    texts = [path.read_text(errors="replace") for path in sources]
    # Enough references are seen for the check to mean something (66 paths and 136
    # cross-references when this test was written).
    assert sum(len(PATH_REF.findall(text)) for text in texts) > 30
    assert sum(len(SPHINX_REF.findall(text)) for text in texts) > 60
    problems = [problem for path in sources for problem in _problems(path)]
    assert not problems, "stale references:\n" + "\n".join(problems)


def test_the_checks_catch_what_has_moved() -> None:
    # The checker itself, on references that once were right and on ones that are.
    assert _path_problem("meshnode/node/worker.py", "") is None
    assert _path_problem("tests/e2e/cluster.py", "Cluster") is None
    assert _path_problem("meshnode/serve/host.py", "") == "no meshnode/serve/host.py"
    assert _path_problem("tests/e2e/cluster.py", "Gone") == "tests/e2e/cluster.py defines no Gone"
    assert _sphinx_problem("meshnode.engine.loader.reading_model") is None
    assert _sphinx_problem("meshnode_protocol.Hello") is None
    assert _sphinx_problem("meshnode.node") is None
    assert _sphinx_problem("meshnode.node.daemon.Node.stop") is None
    assert _sphinx_problem("meshnode.engine.loader.open_model") is not None
    assert _sphinx_problem("meshnode.engine.model.GEMV_MAX_ROWS") is not None
    assert _sphinx_problem("meshnode.engine.backend.GEMV_MAX_ROWS") is None
