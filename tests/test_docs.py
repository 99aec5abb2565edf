"""What the docs and docstrings point at exists: files moved or renamed leave no stale
references behind.

Two kinds of reference are checked, in the READMEs and in every source file's docstrings
and comments (the CHANGELOG is history, and names what has since moved):

- a backticked path from the repository root (its first folder is one of the repository's
  own), optionally with ``::name`` (a test or a function in that file);
- a Sphinx cross-reference (``:mod:``, ``:class:``, ``:func:``, …) to a fully qualified
  name in ``meshnode``, ``meshnode_protocol`` or ``meshnode_packaging``: the module must
  exist and define (or import) the first name after it.

A path may also be relative to ``tests/`` (the security table names tests that way).
Other relative paths and bare dotted names (logger names, JSON fields) are ambiguous and
left alone.

The user's pages (the README and ``docs/``) are checked further: every relative Markdown
link leads to a file that exists and, with ``#anchor``, to one of its headings; the README
stays an entry point; and the configuration reference lists every setting of
``meshnode.node.settings.SETTINGS`` (flag, TOML key, environment variable) and every option
of every command, so that a new knob cannot be left out of it. Their examples are checked
too: every ``meshnode`` command in a shell block exists with the options it names, every
Python block parses, and every TOML block is a config file the node accepts.
"""

from __future__ import annotations

import ast
import re
import shlex
from functools import cache
from pathlib import Path
from typing import Any

from tests.conftest import REPO_ROOT

#: The repository's own top-level folders: a backticked path starting with one of them is
#: a path from the root.
TOP_FOLDERS = (
    "meshnode",
    "protocol",
    "packaging",
    "tests",
    "scripts",
    "benchmarks",
    "deploy",
    "docs",
)
#: Where references are read: these folders' text files, and the READMEs.
SOURCE_SUFFIXES = {".py", ".sh", ".md", ".toml", ".cfg", ".yml", ".yaml", ".service"}
SKIP_PARTS = {".venv", "__pycache__", "build", "dist", ".git", "node_modules"}
#: History: it names files that have since moved, on purpose.
SKIP_FILES = {REPO_ROOT / "CHANGELOG.md", REPO_ROOT / "docs" / "performance-history.md"}

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
                and path not in SKIP_FILES
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
    # The security table names tests relative to tests/ (``protocol/test_vectors.py``).
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
    assert REPO_ROOT / "docs" / "security.md" in sources
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
    assert _sphinx_problem("meshnode.engine.model.MAX_KERNEL_ROWS") is not None
    assert _sphinx_problem("meshnode.engine.cpu.matrix.MAX_KERNEL_ROWS") is None


# ---- the user's pages: links, anchors, the README's size, the configuration reference ----

#: The pages a user reads, in the order the README links them.
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
#: The README is an entry point (issue 32): what meshnode is, the quickstart, a three-machine
#: example, the API in a paragraph, one performance table, links. The rest goes in docs/.
README_MAX_LINES = 200
#: ``[text](target)``, not an image; the target up to the first space or closing bracket.
MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()):
        if m := re.match(r"#{1,6}\s+(.*)", line):
            slug = _slug(m[1])
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _link_problem(page: Path, target: str) -> str | None:
    if re.match(r"[a-z][a-z0-9+.-]*:", target):
        return None  # https:, mailto: — not ours to check
    path_part, _, anchor = target.partition("#")
    dest = (page.parent / path_part).resolve() if path_part else page
    if not dest.exists():
        return f"no {path_part}"
    if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        return f"{dest.relative_to(REPO_ROOT)} has no heading #{anchor}"
    return None


def test_every_link_between_the_pages_leads_somewhere() -> None:
    assert len(PAGES) >= 10, "the README and the docs/ pages"
    problems = []
    links = 0
    for page in PAGES:
        # The whole text outside code: a link's text may wrap onto the next line.
        for target in MD_LINK.findall("\n".join(_prose(page.read_text()))):
            links += 1
            if problem := _link_problem(page, target):
                problems.append(f"{page.relative_to(REPO_ROOT)}: {target}: {problem}")
    assert links > 40  # enough links seen for the check to mean something
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_checker_catches_broken_links() -> None:
    readme = REPO_ROOT / "README.md"
    assert _link_problem(readme, "docs/api.md#endpoints") is None
    assert _link_problem(readme, "#quickstart") is None
    assert _link_problem(readme, "https://example.com/nowhere") is None
    assert _link_problem(readme, "docs/nowhere.md") == "no docs/nowhere.md"
    assert _link_problem(readme, "docs/api.md#nowhere") == "docs/api.md has no heading #nowhere"
    assert _slug("Anthropic's Messages API") == "anthropics-messages-api"
    assert _slug("Hung stages: the pass deadline") == "hung-stages-the-pass-deadline"
    assert _slug("8-bit activations (`--dtype q8`)") == "8-bit-activations---dtype-q8"


def test_the_readme_stays_an_entry_point() -> None:
    lines = (REPO_ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to a docs/ page"
    )
    linked = {
        (REPO_ROOT / target.partition("#")[0]).resolve()
        for target in MD_LINK.findall((REPO_ROOT / "README.md").read_text())
    }
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs/ pages the README does not link: {unlinked}"


CONFIG_PAGE = REPO_ROOT / "docs" / "configuration.md"
#: A row of the settings table: ``| `--flag` | `[section] key` | `MESHNODE_X` | …``.
SETTING_ROW = re.compile(r"^\| `(--[\w-]+)` \| `\[(\w+)\] (\w+)` \| `(MESHNODE_\w+)` \|")


def _section(page: Path, heading: str) -> str:
    return page.read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_configuration_reference_lists_every_setting_once() -> None:
    from meshnode.node.settings import SETTINGS

    rows = [
        m.groups()
        for line in _section(CONFIG_PAGE, "## Settings").splitlines()
        if (m := SETTING_ROW.match(line))
    ]
    declared = [(s.option, s.section, s.key, s.env) for s in SETTINGS]
    assert len(rows) == len(set(rows)), "a setting is listed twice"
    missing = [
        f"| `{o}` | `[{s}] {k}` | `{e}` |" for o, s, k, e in declared if (o, s, k, e) not in rows
    ]
    stale = [row for row in rows if row not in declared]
    assert not missing, "docs/configuration.md lacks rows for:\n" + "\n".join(missing)
    assert not stale, f"docs/configuration.md lists settings that SETTINGS does not: {stale}"


def _commands() -> dict[str, list[str]]:
    """Every command's options, from the command line itself: ``{"package fetch": [...]}``."""
    import typer

    from meshnode.cli import app
    from meshnode.cli import commands as _commands  # noqa: F401  (registers the commands)

    out: dict[str, list[str]] = {}

    def walk(group: Any, prefix: str) -> None:
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                walk(command, f"{prefix}{name} ")
            else:
                opts = [o for p in command.params if p.param_type_name == "option" for o in p.opts]
                out[prefix + name] = opts

    walk(typer.main.get_command(app), "")
    return out


def test_the_configuration_reference_names_every_option_of_every_command() -> None:
    from meshnode.speculative.settings import TABLE_KEYS

    text = CONFIG_PAGE.read_text()
    commands = _commands()
    assert {"join", "init", "status", "generate", "package write"} <= set(commands)
    assert len(commands["join"]) > 30
    join = _section(CONFIG_PAGE, "## Settings") + _section(CONFIG_PAGE, "## Speculative decoding")
    others = _section(CONFIG_PAGE, "## Other commands")
    missing = [f"join {o}" for o in commands.pop("join") if f"`{o}" not in join]
    for name, opts in commands.items():
        row = next((line for line in others.splitlines() if f"`meshnode {name}" in line), None)
        if row is None:
            missing.append(f"meshnode {name} (no row)")
        else:
            missing += [f"{name} {o}" for o in opts if f"`{o}" not in row]
    missing += [f"speculative key {k}" for k in TABLE_KEYS if f"`{k}`" not in text]
    assert not missing, "docs/configuration.md does not mention:\n" + "\n".join(missing)


# ---- the examples on the user's pages: commands name real options, code parses ----------

#: A fenced block and its language: ```sh … ```.
CODE_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(language: str) -> list[tuple[Path, str]]:
    return [
        (page, m[2])
        for page in PAGES
        for m in CODE_BLOCK.finditer(page.read_text())
        if m[1] == language
    ]


def _command_problems(line: str, commands: dict[str, list[str]]) -> list[str]:
    """What is wrong with one shell line's ``meshnode`` call: an unknown command or option."""
    words = shlex.split(line, comments=True)
    starts = [i for i, w in enumerate(words) if w.endswith(("bin/meshnode", "scripts/run.sh"))]
    if not starts:
        return []
    args = words[starts[0] + 1 :]
    if not args or args[0].startswith("-"):
        return []  # meshnode --version, run.sh --help
    name = " ".join(args[:2]) if " ".join(args[:2]) in commands else args[0]
    if name not in commands:
        return [f"no command meshnode {name}"]
    flags = [w.split("=", 1)[0] for w in args if w.startswith("--")]
    known = {*commands[name], "--help"}
    return [f"meshnode {name} has no {flag}" for flag in flags if flag not in known]


def test_every_command_in_the_examples_exists_with_its_options() -> None:
    commands = _commands()
    blocks = _blocks("sh")
    assert len(blocks) >= 8
    problems = []
    calls = 0
    for page, code in blocks:
        for line in code.replace("\\\n", " ").splitlines():
            calls += "meshnode " in line or "run.sh " in line
            problems += [
                f"{page.relative_to(REPO_ROOT)}: {p}" for p in _command_problems(line, commands)
            ]
    assert calls >= 15
    assert not problems, "examples that would fail:\n" + "\n".join(problems)


def test_the_command_checker_catches_what_would_fail() -> None:
    commands = _commands()
    ok = ".venv/bin/meshnode join --token-file t --model m --split=2   # a comment --nope"
    assert _command_problems(ok, commands) == []
    assert _command_problems("bash scripts/run.sh join --nope", commands) == [
        "meshnode join has no --nope"
    ]
    assert _command_problems(".venv/bin/meshnode package fetch r --layers 1:2", commands) == []
    assert _command_problems(".venv/bin/meshnode serve", commands) == ["no command meshnode serve"]


def test_every_python_example_parses() -> None:
    blocks = _blocks("python")
    assert len(blocks) >= 4
    for page, code in blocks:
        compile(code, str(page.relative_to(REPO_ROOT)), "exec")


def test_every_toml_example_is_a_config_the_node_accepts(tmp_path: Path) -> None:
    from meshnode.node.config import load_config

    blocks = _blocks("toml")
    assert blocks
    for number, (_page, code) in enumerate(blocks):
        path = tmp_path / f"example{number}.toml"
        path.write_text(code)
        load_config(config_file=path, env={})  # raises ConfigError on an unknown key
