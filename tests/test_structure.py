"""The shape of the ``meshnode`` package, checked from its source: which package imports
which (DESIGN §1's layering, which each ``meshnode/*/__init__.py`` docstring repeats), how
big modules and classes grow (STYLE: mid-sized modules), and that the exception tree drawn
in ``meshnode/errors.py`` names every exception class under its real parent."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import meshnode_packaging
import meshnode_protocol
import pytest

import meshnode
from meshnode import errors

PACKAGE = Path(meshnode.__file__).parent
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300

#: What each package may import, of meshnode's packages and the two sibling distributions
#: (DESIGN §1; lower never imports higher). ``cli`` composes everything.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "engine": {"errors", "meshnode_packaging"},
    "speculative": {"errors", "engine", "meshnode_packaging"},
    "net": {"errors", "meshnode_protocol"},
    "node": {"errors", "engine", "speculative", "net", "meshnode_packaging", "meshnode_protocol"},
    "generation": {"errors", "node", "speculative", "engine"},
    "serve": {"errors", "generation", "node", "speculative", "engine", "net"},
    "cli": {
        "errors",
        "engine",
        "speculative",
        "net",
        "node",
        "generation",
        "serve",
        "meshnode_packaging",
    },
}
FIRST_PARTY = {"meshnode", "meshnode_packaging", "meshnode_protocol"}
#: Array libraries: the engine's (DESIGN §6: code above the engine never imports numpy or
#: cupy for math), and the speculative package's acceptance math over probability rows.
ARRAYS = {"numpy", "cupy", "cupyx", "numba", "llvmlite"}
MAY_IMPORT_ARRAYS = {"engine", "speculative"}
#: I/O and concurrency: the engine and the speculative package do none (pure logic).
IO = {"trio", "anyio", "asyncio", "socket", "ssl", "httpx", "hypercorn", "zeroconf"}
PURE = {"engine", "speculative"}


@dataclass(frozen=True)
class Import:
    module: Path
    line: int
    name: str  # the dotted module imported

    @property
    def top(self) -> str:
        return self.name.split(".")[0]

    @property
    def package(self) -> str:
        """The meshnode package imported (``errors`` for meshnode.errors), else the top."""
        parts = self.name.split(".")
        if parts[0] != "meshnode":
            return parts[0]
        return parts[1] if len(parts) > 1 else "meshnode"

    def __str__(self) -> str:
        return f"{self.module.relative_to(PACKAGE.parent)}:{self.line} imports {self.name}"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imports(path: Path) -> list[Import]:
    """Every absolute import in ``path``, those under ``if TYPE_CHECKING:`` included (a
    type is a dependency too); relative imports stay inside their package."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(Import(path, node.lineno, node.module))
    return out


def _all_imports() -> list[Import]:
    return [imp for path in _modules() for imp in _imports(path)]


def test_the_walk_sees_every_package_and_its_imports() -> None:
    """The checks below cannot pass by seeing nothing."""
    packages = {_package_of(p) for p in _modules()}
    assert set(MAY_IMPORT) | {"__init__"} <= packages
    seen = {(_package_of(i.module), i.package) for i in _all_imports()}
    assert ("node", "engine") in seen
    assert ("engine", "numpy") in seen
    assert ("serve", "node") in seen
    assert ("generation", "node") in seen


def test_packages_import_only_what_the_layering_allows() -> None:
    wrong = [
        str(imp)
        for imp in _all_imports()
        if imp.top in FIRST_PARTY
        and (pkg := _package_of(imp.module)) in MAY_IMPORT
        and imp.package != pkg
        and imp.package not in MAY_IMPORT[pkg]
        and imp.name != "meshnode"
    ]
    assert not wrong, "imports against DESIGN §1's layering:\n" + "\n".join(wrong)


def test_only_the_engine_and_the_acceptance_math_import_array_libraries() -> None:
    wrong = [
        str(imp)
        for imp in _all_imports()
        if imp.top in ARRAYS and _package_of(imp.module) not in MAY_IMPORT_ARRAYS
    ]
    assert not wrong, "array math above the engine:\n" + "\n".join(wrong)


def test_the_engine_and_the_speculative_package_do_no_io() -> None:
    wrong = [
        str(imp) for imp in _all_imports() if imp.top in IO and _package_of(imp.module) in PURE
    ]
    assert not wrong, "I/O or async in pure packages:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(set(MAY_IMPORT) - {"errors", "cli"}))
def test_package_docstrings_name_what_the_package_imports(package: str) -> None:
    """Each package's docstring names every meshnode package and sibling distribution it
    imports (``meshnode.engine``, ``meshnode_packaging``, …)."""
    doc = importlib.import_module(f"meshnode.{package}").__doc__ or ""
    used = {
        imp.package
        for imp in _all_imports()
        if imp.top in FIRST_PARTY and _package_of(imp.module) == package
    } - {package, "meshnode"}
    named = {u for u in used if (f"meshnode.{u}" if u in MAY_IMPORT else u) in doc}
    assert used - named == set(), f"meshnode.{package}'s docstring does not name {used - named}"


def test_no_module_over_600_lines_and_no_class_over_300() -> None:
    big = []
    for path in _modules():
        text = path.read_text()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
        classes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)]
        for node in classes:
            if (size := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_CLASS_LINES:
                big.append(f"{path.relative_to(PACKAGE.parent)}: class {node.name}, {size}")
    assert not big, "over the size limits:\n" + "\n".join(big)


#: The three distributions' import packages, whose modules the cycle check walks.
DISTRIBUTIONS = (
    PACKAGE,
    Path(meshnode_protocol.__file__).parent,
    Path(meshnode_packaging.__file__).parent,
)


def _module_name(path: Path, root: Path) -> str:
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


#: Import edges that close a cycle on purpose: the CLI's entry point imports its command
#: modules (inside ``main``) so that they register themselves on ``meshnode.cli.app``.
REGISTRATION = {("meshnode.cli", "meshnode.cli.commands")}


def _imported(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> set[str]:
    """The first-party modules one import statement names, in module ``package``'s
    package: ``from pkg import sub`` is an edge to ``pkg.sub`` when that is a module, and
    a relative import is resolved against ``package``."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, base] if base else parts)
    subs = {f"{base}.{alias.name}" for alias in node.names} & modules
    return subs or ({base} & modules)


def _import_graph() -> dict[str, set[str]]:
    """module -> the first-party modules it imports, in meshnode and its two sibling
    distributions: at module level, inside a function, or under ``if TYPE_CHECKING:`` (a
    type is a dependency too: a cycle through one still ties the modules together)."""
    paths = {_module_name(p, root): p for root in DISTRIBUTIONS for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= {
                    t for t in _imported(node, package, modules) if (name, t) not in REGISTRATION
                }
        graph[name] = edges - {name}
    return graph


def test_no_import_cycles_between_modules() -> None:
    """No module imports, at load time, later or for its types only, a module that
    imports it back, in ``meshnode``, ``meshnode_protocol`` or ``meshnode_packaging``.

    ``engine.weights`` once imported ``engine.cuda.weights`` inside a function, which
    imports it back; the backend strategies (``engine.backend``) now pick the loader.
    ``node.pipeline`` once imported the batcher and the stage runner built on its records;
    ``LocalPipeline`` moved to ``node.local``. Cycles through ``TYPE_CHECKING`` and
    function-local imports were broken by moving the shared records apart (issue 32):
    ``Slot`` and the sequence limit to ``node.pipeline``, ``MeshView`` and
    ``CoordinatorSettings`` to ``node.mesh``, ``WorkerRun`` to ``node.worker_run``,
    ``RemotePackage`` to ``meshnode_packaging.reference``, the vectors' JSON form to
    ``meshnode_protocol.vector_json``.
    """
    graph = _import_graph()
    assert "meshnode.engine.cuda.weights" in graph["meshnode.engine.backend"]
    assert "meshnode.node.batcher" in graph["meshnode.node.local"]
    assert "meshnode.node.mesh" in graph["meshnode.node.bringup"]  # under TYPE_CHECKING
    assert "meshnode_packaging.reference" in graph["meshnode_packaging.remote"]  # ditto
    assert "meshnode_protocol._messages" in graph["meshnode_protocol.vector_json"]
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


# -- the exception tree -------------------------------------------------------------------

#: A line of the drawing: its prefix of rails, then one or more class names.
TREE_LINE = re.compile(r"^(?P<rails>(?:[│ ] {3})*)(?:├── |└── )(?P<names>\w+(?:, \w+)*)")


def _drawn_tree() -> dict[str, str | None]:
    """class name -> parent name, as ``meshnode/errors.py``'s docstring draws them."""
    doc = errors.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    lines = [line[4:] for line in block.splitlines()]  # the block is indented by 4
    assert lines[0] == "MeshnodeError"
    parents: dict[str, str | None] = {"MeshnodeError": None}
    stack = ["MeshnodeError"]
    for line in lines[1:]:
        match = TREE_LINE.match(line)
        if match is None:  # a description's continuation line
            continue
        depth = len(match["rails"]) // 4 + 1
        del stack[depth:]
        names = match["names"].split(", ")
        for name in names:
            parents[name] = stack[depth - 1]
        stack.append(names[0])
    return parents


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package, by name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(meshnode.__path__, "meshnode."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                assert name not in found, f"two exception classes named {name}"
                found[name] = obj
    return found


def test_the_exception_tree_names_every_exception_class_under_its_parent() -> None:
    drawn = _drawn_tree()
    classes = _exception_classes()
    assert {"MeshnodeError", "StageError", "ServiceUnavailableError"} <= set(classes)
    doc = errors.__doc__ or ""
    outside = {name for name in classes if name.startswith("_")}
    assert all(f"``{name}``" in doc or f"._{name[1:]}``" in doc for name in outside), (
        f"private exceptions the docstring does not name: {sorted(outside)}"
    )
    public = {name: cls for name, cls in classes.items() if name not in outside}
    assert set(public) == set(drawn), (
        f"not drawn: {sorted(set(public) - set(drawn))}; "
        f"drawn but not defined: {sorted(set(drawn) - set(public))}"
    )
    for name, cls in public.items():
        bases = [b for b in cls.__bases__ if issubclass(b, errors.MeshnodeError)]
        real = bases[0].__name__ if bases else None
        assert drawn[name] == real, f"{name} is drawn under {drawn[name]}, derives from {real}"
