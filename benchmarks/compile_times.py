"""Where a first start's CPU goes: numba's compile time per compiled function.

Run: ``.venv/bin/python benchmarks/compile_times.py OUT.json generate PROMPT --model M ...``
runs ``meshnode`` with those arguments in this process and writes to ``OUT.json``, when
it exits, one record per numba compile: the function (``module.qualname``, closures
and ``cfunc`` kernels included), its exclusive thread CPU seconds (the compiles it
triggered, its callees', not counted) and of those the seconds in numba's
``native_lowering`` pass (LLVM: optimizing the function's module with every callee's
linked in, and emitting machine code). :mod:`benchmarks.coldstart` runs its starts
through this and prints the table (:func:`table`).

Why exclusive times: numba compiles each ``@njit`` function a kernel calls as its own
module first (optimized and emitted), then links it into its caller's module and
optimizes the whole again, so a function's compile includes its callees' and every level
of a deep call chain pays again for what is below it. A caller's own seconds are mostly
that re-optimization; they shrink when the chain is shallower.

Sources: ``numba.core.event`` (``numba:compile`` around a dispatcher's compile,
``numba:run_pass`` around each compiler pass); a ``cfunc``'s compile fires neither, so
``CFunc.compile`` is wrapped here.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["install", "main", "repeats", "stages", "table"]

# The pass that lowers numba's IR to LLVM and finalizes it (optimization, machine code)
_LLVM_PASS = "native_lowering"


# What a compile spends its time on, each timed as the named method (module, class,
# method): numba's own Python (type inference; inlining ``inline="always"`` helpers into
# its IR; lowering its typed IR to LLVM IR; the Python and C entry points) and LLVM's
# native work (function passes on each new function; the module passes over the function
# with every callee linked in; emitting machine code), and writing the disk cache
_STAGES = [
    ("numba.core.typed_passes", "BaseTypeInference", "run_pass", "type inference"),
    ("numba.core.untyped_passes", "InlineInlinables", "run_pass", "numba inlining"),
    ("numba.core.lowering", "BaseLower", "lower", "numba lowering"),
    ("numba.core.cpu", "CPUContext", "create_cpython_wrapper", "entry points"),
    ("numba.core.cpu", "CPUContext", "create_cfunc_wrapper", "entry points"),
    ("numba.core.codegen", "CPUCodeLibrary", "_optimize_functions", "LLVM function passes"),
    ("numba.core.codegen", "CPUCodeLibrary", "_optimize_final_module", "LLVM module passes"),
    ("numba.core.codegen", "JITCodeLibrary", "_finalize_specific", "LLVM machine code"),
    ("numba.core.codegen", "CPUCodeLibrary", "serialize_using_object_code", "cache write"),
]


class _Recorder:
    """Exclusive thread CPU seconds of nested compiles and passes, per thread, and of
    the stages of compiling (:data:`_STAGES`) over all compiles."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.stages: dict[str, float] = defaultdict(float)
        self._local = threading.local()

    def _timed(self) -> list[list[float]]:
        # the open stages and compiles of this thread: [start, nested seconds]
        timed: list[list[float]] | None = getattr(self._local, "timed", None)
        if timed is None:
            timed = self._local.timed = []
        return timed

    def enter(self) -> None:
        """A stage (or a compile) starts in this thread."""
        self._timed().append([time.thread_time(), 0.0])

    def leave(self, stage: str | None) -> None:
        """The innermost stage (its name) or compile (None) of this thread ends: a
        stage's own seconds are counted, those of the stages and compiles inside it
        are theirs."""
        timed = self._timed()
        start, nested = timed.pop()
        total = time.thread_time() - start
        if stage is not None:
            self.stages[stage] += total - nested
        if timed:
            timed[-1][1] += total

    def _stack(self) -> list[list[Any]]:
        stack: list[list[Any]] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def push(self, kind: str, name: str, signature: str = "") -> None:
        # a frame: kind ("compile" or "pass"), name, start, nested compiles' seconds,
        # seconds in the LLVM pass of this compile, the compiled argument types
        self._stack().append([kind, name, time.thread_time(), 0.0, 0.0, signature])
        if kind == "compile":
            self.enter()

    def pop(self, keep: bool = True) -> None:
        stack = self._stack()
        kind, name, start, nested, llvm, signature = stack.pop()
        total = time.thread_time() - start
        parent = stack[-1] if stack else None
        if kind == "compile":
            self.leave(None)
            if keep:
                record = {"function": name, "seconds": total - nested, "llvm": llvm}
                record["signature"] = signature
                self.records.append(record)
            if parent is not None:
                parent[3] += total
            return
        # a pass: its own time is its compile's; compiles it triggered stay theirs
        if parent is not None:
            parent[3] += nested
            if name.split(" [")[0] == _LLVM_PASS:
                frame = next((f for f in reversed(stack) if f[0] == "compile"), None)
                if frame is not None:
                    frame[4] += total - nested


def _name(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _types(args: Sequence[Any]) -> str:
    # numba's own names: "(readonly array(uint8, 2d, C), int64)"
    return "(" + ", ".join(str(a) for a in args) + ")"


def _time_stage(recorder: _Recorder, module: str, cls_name: str, method: str, stage: str) -> Any:
    """Wrap ``module.cls_name.method`` so that its calls count as ``stage``: (the class,
    the method's name, the original) to put back."""
    cls = getattr(importlib.import_module(module), cls_name)
    original = cls.__dict__[method]

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        recorder.enter()
        try:
            return original(*args, **kwargs)
        finally:
            recorder.leave(stage)

    setattr(cls, method, timed)
    return cls, method, original


@contextmanager
def install() -> Iterator[_Recorder]:
    """Record every numba compile of this process inside the block: yields the recorder,
    whose ``records`` (dicts: ``function``, ``seconds``, ``llvm``, ``signature``: the
    compiled argument types, which tell one function's compiles apart) grow as compiles
    end."""
    from numba.core import ccallback
    from numba.core import event as ev

    recorder = _Recorder()

    class Compiles(ev.Listener):
        def on_start(self, event: Any) -> None:
            data = event.data
            recorder.push("compile", _name(data["dispatcher"].py_func), _types(data["args"]))

        def on_end(self, event: Any) -> None:
            recorder.pop()

    class Passes(ev.Listener):
        def on_start(self, event: Any) -> None:
            recorder.push("pass", event.data["name"])

        def on_end(self, event: Any) -> None:
            recorder.pop()

    listeners = [("numba:compile", Compiles()), ("numba:run_pass", Passes())]
    for kind, listener in listeners:
        ev.register(kind, listener)  # type: ignore[no-untyped-call]
    compile_cfunc = ccallback.CFunc.compile

    def compile_timed(self: Any) -> Any:
        # called on a cache hit too (it loads): only a miss is a compile
        hits = self._cache_hits
        recorder.push("compile", "cfunc " + _name(self._pyfunc), _types(self._sig.args))
        try:
            return compile_cfunc(self)
        finally:
            recorder.pop(keep=self._cache_hits == hits)

    ccallback.CFunc.compile = compile_timed  # type: ignore[method-assign]
    patched = [_time_stage(recorder, *where) for where in _STAGES]
    try:
        yield recorder
    finally:
        for cls, method, original in reversed(patched):
            setattr(cls, method, original)
        ccallback.CFunc.compile = compile_cfunc  # type: ignore[method-assign]
        for kind, listener in listeners:
            ev.unregister(kind, listener)  # type: ignore[no-untyped-call]


def table(runs: Sequence[Sequence[dict[str, Any]]], top: int) -> list[str]:
    """Markdown lines: the total compile seconds (LLVM's part) of ``runs`` (each a
    process's records) and the ``top`` functions by seconds, each the mean over runs."""
    n = max(1, len(runs))
    seconds: dict[str, float] = defaultdict(float)
    llvm: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for records in runs:
        for r in records:
            seconds[r["function"]] += r["seconds"] / n
            llvm[r["function"]] += r["llvm"] / n
            counts[r["function"]] += 1
    total, in_llvm = sum(seconds.values()), sum(llvm.values())
    lines = [
        f"compiling: {total:.1f} s of thread CPU ({in_llvm:.1f} s in LLVM), "
        f"{sum(counts.values()) // n} compiles; the top {top}:",
        "",
        "| function (exclusive: its callees' compiles not counted) | compiles | s | LLVM s |",
        "|---|---:|---:|---:|",
    ]
    for name in sorted(seconds, key=lambda k: -seconds[k])[:top]:
        short = name.replace("meshnode.engine.", "")
        lines.append(f"| {short} | {counts[name] // n} | {seconds[name]:.2f} | {llvm[name]:.2f} |")
    return lines


def stages(runs: Sequence[dict[str, float]]) -> str:
    """One line: the seconds of each stage of compiling (the mean over ``runs``, each a
    process's :attr:`_Recorder.stages`), largest first, and numba's Python part."""
    n = max(1, len(runs))
    mean: dict[str, float] = defaultdict(float)
    for run in runs:
        for stage, seconds in run.items():
            mean[stage] += seconds / n
    python = sum(mean[s] for s in ("type inference", "numba inlining", "numba lowering"))
    parts = ", ".join(f"{s} {mean[s]:.1f}" for s in sorted(mean, key=lambda s: -mean[s]))
    return f"by stage (s): {parts}; numba's own Python (typing, inlining, lowering) {python:.1f}"


def repeats(records: Sequence[dict[str, Any]], width: int = 160) -> list[str]:
    """Markdown lines: each function ``records`` (one process's) compiled more than once,
    with the argument types of each compile (cut to ``width`` characters): a
    read-only array beside a writable one, an ``int32`` beside an ``int64``, a literal
    beside a plain int each cost one more compile of the same code."""
    signatures: dict[str, list[str]] = defaultdict(list)
    for r in records:
        signatures[r["function"]].append(r["signature"])
    lines = []
    for name, sigs in sorted(signatures.items()):
        if len(sigs) > 1:
            lines.append(f"- {name.replace('meshnode.engine.', '')}, {len(sigs)} compiles:")
            lines += [f"  - `{sig[:width]}`" for sig in sigs]
    return lines


# A compile-ahead worker's program (meshnode.engine.cpu.warmup._BOOT's, recording): its
# records and stages go to the file named by the format's one argument
_WORKER = """import json, pickle, sys
path, calls = pickle.loads(sys.stdin.buffer.read())
sys.path[:] = [*path, {here!r}]
from compile_times import install
with install() as recorder:
    from meshnode.engine.cpu.warmup import work
    try:
        work(calls)
    finally:
        with open({out!r}, "w") as f:
            json.dump({{"records": recorder.records, "stages": recorder.stages}}, f)
"""


def _record_workers(out: Path) -> list[Path]:
    """Make this process's compile-ahead workers (``meshnode.engine.cpu.warmup``) record
    their compiles too, each into a file beside ``out``: the list those files will be in
    (empty: a meshnode without such workers, or one whose worker takes no program)."""
    try:
        from meshnode.engine.cpu import warmup
    except ImportError:
        return []
    if not hasattr(warmup, "_BOOT"):  # its worker runs "python -m": not recorded
        return []
    files: list[Path] = []
    spawn = warmup._spawn

    def recorded(key: str, calls: Any) -> bool:
        files.append(out.with_name(f"{out.stem}.worker{len(files)}.json"))
        warmup._BOOT = _WORKER.format(out=str(files[-1]), here=str(Path(__file__).parent))
        return bool(spawn(key, calls))

    warmup._spawn = recorded
    return files


def main() -> None:
    """``compile_times.py OUT.json MESHNODE-ARGS...``: run meshnode, record, write
    ``{"records": [...], "stages": {stage: seconds}, "workers": [...]}``, the last the
    records of each compile-ahead worker it started (its own ``records`` and ``stages``)."""
    out, args = Path(sys.argv[1]), sys.argv[2:]
    from meshnode.cli import main as meshnode

    workers = _record_workers(out)
    sys.argv = ["meshnode", *args]
    with install() as recorder:
        try:
            meshnode()
        finally:
            done = [json.loads(f.read_text()) for f in workers if f.exists()]
            record = {"records": recorder.records, "stages": recorder.stages, "workers": done}
            out.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
