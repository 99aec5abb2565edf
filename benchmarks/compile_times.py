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

import json
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["install", "main", "table"]

# The pass that lowers numba's IR to LLVM and finalizes it (optimization, machine code)
_LLVM_PASS = "native_lowering"


class _Recorder:
    """Exclusive thread CPU seconds of nested compiles and passes, per thread."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._local = threading.local()

    def _stack(self) -> list[list[Any]]:
        stack: list[list[Any]] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def push(self, kind: str, name: str) -> None:
        # a frame: kind ("compile" or "pass"), name, start, nested compiles' seconds,
        # seconds in the LLVM pass of this compile
        self._stack().append([kind, name, time.thread_time(), 0.0, 0.0])

    def pop(self, keep: bool = True) -> None:
        stack = self._stack()
        kind, name, start, nested, llvm = stack.pop()
        total = time.thread_time() - start
        parent = stack[-1] if stack else None
        if kind == "compile":
            if keep:
                self.records.append({"function": name, "seconds": total - nested, "llvm": llvm})
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


@contextmanager
def install() -> Iterator[_Recorder]:
    """Record every numba compile of this process inside the block: yields the recorder,
    whose ``records`` (dicts: ``function``, ``seconds``, ``llvm``) grow as compiles end."""
    from numba.core import ccallback
    from numba.core import event as ev

    recorder = _Recorder()

    class Compiles(ev.Listener):
        def on_start(self, event: Any) -> None:
            recorder.push("compile", _name(event.data["dispatcher"].py_func))

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
        recorder.push("compile", "cfunc " + _name(self._pyfunc))
        try:
            return compile_cfunc(self)
        finally:
            recorder.pop(keep=self._cache_hits == hits)

    ccallback.CFunc.compile = compile_timed  # type: ignore[method-assign]
    try:
        yield recorder
    finally:
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


def main() -> None:
    """``compile_times.py OUT.json MESHNODE-ARGS...``: run meshnode, record, write."""
    out, args = Path(sys.argv[1]), sys.argv[2:]
    from meshnode.cli import main as meshnode

    sys.argv = ["meshnode", *args]
    with install() as recorder:
        try:
            meshnode()
        finally:
            out.write_text(json.dumps(recorder.records))


if __name__ == "__main__":
    main()
