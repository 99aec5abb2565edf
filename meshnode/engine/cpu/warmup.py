"""Compiling a kernel in a second process while a first start goes on (issue 29).

numba compiles a kernel at its first call and holds one compiler lock per process, so a
first start (an empty cache: :func:`.matrix.numba_cache_dir`) compiles every kernel one
after another on one core, and the decode attention alone is about half of it (SmolLM2:
~20 of ~40 s of CPU). Its argument types are known when the stage is built, long before
its first call: :func:`start` (a dispatcher's signatures) or :func:`run` (any
module-level function that compiles, such as the attention's chunk function and entry:
``cpu.attention.compile_kernel``) hands them to a worker process (``python -P -c``
:data:`_BOOT`, running :func:`work`) that compiles them into the same on-disk cache while this
process loads the rest and compiles the products, norms and the prefill's kernels.
:func:`wait`, at the kernel's first call, waits for the worker to end; the call then
loads the compiled code from the cache (numba looks there before compiling). The code is
the one this process would have compiled: the same source, types, flags and machine; a
callee loaded from the cache is linked into its callers from its cached LLVM module, as
a freshly compiled one is.

Nothing depends on the worker: if it cannot start, fails or is killed, the kernel
compiles here at its first call, as without it. No worker starts when what it would
compile is in the cache already (:func:`cached`), with fewer than two usable cores,
without ``fcntl`` (the cache lock below), or with ``MESHNODE_COMPILE_AHEAD=0`` in the
environment. The worker imports this process's modules (its ``sys.path``, handed over), so
it compiles the very functions this process then looks up, whatever its working directory.

numba's cache is safe for one process only: two processes saving different signatures of
one function can both pick the same data file name, and the index of one may then name
the other's code. :func:`lock_cache` makes every save (and load) of this process hold an
``flock`` on the cache folder; the worker holds the same, and so does every process that
compiles through :func:`.matrix.kernels`, worker or not: two nodes on one machine, or
stages on a loaded machine (where no worker starts), compile into one folder at once.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from meshnode.engine.cpu.gauge import usable_cpus

__all__ = [
    "WAIT_LIMIT_S",
    "Call",
    "cached",
    "compile",
    "enabled",
    "lock_cache",
    "pending",
    "run",
    "start",
    "wait",
]

log = logging.getLogger(__name__)

# The longest a kernel's first call waits for its worker before it kills it and compiles
# the kernel itself: a whole first start took 40-75 s of CPU (docs/performance.md, "First
# start"); a worker past ten minutes is stuck, not slow.
WAIT_LIMIT_S = 600.0
# The environment variable that turns compiling ahead off ("0"), read at each start.
SWITCH = "MESHNODE_COMPILE_AHEAD"
# The end of a failed worker's stderr logged with the warning.
ERROR_TAIL_BYTES = 2000
# The worker's program (``python -P -c``: no working directory on its path): read the job,
# take its parent's ``sys.path`` before importing anything of meshnode, make its calls.
_BOOT = (
    "import pickle, sys\n"
    "path, calls = pickle.loads(sys.stdin.buffer.read())\n"
    "sys.path[:] = path\n"
    "from meshnode.engine.cpu.warmup import work\n"
    "work(calls)\n"
)


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    err: IO[bytes]  # its stderr, read back if it fails


_pending: dict[str, _Worker] = {}
_lock = threading.Lock()


def pending() -> list[str]:
    """The keys of the workers started and not yet waited for."""
    return list(_pending)


@dataclass(frozen=True)
class Call:
    """What a worker does: call ``module.name(*args)`` (a module-level function that
    compiles numba functions into the cache; ``args`` pickled)."""

    module: str
    name: str
    args: tuple[Any, ...]


def start(key: str, dispatcher: Any, signatures: Sequence[tuple[Any, ...]]) -> bool:
    """Compile ``dispatcher`` (a ``numba`` ``@njit(cache=True)`` function at module level)
    for each of ``signatures`` (tuples of numba types) not in the cache yet in a worker
    process (:func:`run`); :func:`wait` with the same ``key`` before its first call.
    Returns whether a worker started."""
    if not enabled():
        return False
    missing = [sig for sig in signatures if not cached(dispatcher, sig)]
    fn = dispatcher.py_func
    calls = [Call(__name__, "compile", (fn.__module__, fn.__name__, missing))]
    return bool(missing) and run(key, calls)


def enabled() -> bool:
    """Whether a worker may start (see the module docstring): compiling ahead not switched
    off, two usable cores, ``fcntl``."""
    if os.environ.get(SWITCH, "1") == "0" or len(usable_cpus()) < 2:
        return False
    try:
        import fcntl  # noqa: F401  (POSIX only: the cache lock)
    except ImportError:
        return False
    return True


def run(key: str, calls: Sequence[Call]) -> bool:
    """Make ``calls`` in a worker process, unless compiling ahead is off
    (:func:`enabled`) or ``key``'s worker runs already; :func:`wait` with the same
    ``key`` before the first call of what they compile. Returns whether a worker
    started."""
    if not calls or not enabled():
        return False
    with _lock:  # two stages built at once start one worker
        return key not in _pending and _spawn(key, calls)


def compile(module: str, name: str, signatures: Sequence[tuple[Any, ...]]) -> None:
    """Compile ``module.name`` (an ``@njit(cache=True)`` function) for each of
    ``signatures``, into numba's cache (a worker's :class:`Call`)."""
    dispatcher = getattr(importlib.import_module(module), name)
    for sig in signatures:
        dispatcher.compile(sig)


def _spawn(key: str, calls: Sequence[Call]) -> bool:
    lock_cache()
    # this process's import path with the job: the worker compiles the code this process
    # runs (a ``python -m`` worker would put its working directory first, and a folder
    # holding another ``meshnode``, a source checkout, would shadow this one: the worker
    # then filled the cache with another file's functions and this process compiled its
    # own kernel again)
    job = pickle.dumps((list(sys.path), [(c.module, c.name, c.args) for c in calls]))
    err = tempfile.TemporaryFile()  # noqa: SIM115  (kept with the worker, closed in wait)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-c", _BOOT], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=err, env=_env(),
        )  # fmt: skip
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(job)
    except OSError as exc:  # no worker: the kernel compiles at its first call
        log.warning("could not start a process to compile %s ahead: %s", key, exc)
        err.close()
        return False
    _pending[key] = _Worker(proc, err)
    return True


def wait(key: str) -> None:
    """Wait for ``key``'s worker, if one runs (at most :data:`WAIT_LIMIT_S`: then it is
    killed); a failed one is logged, and the kernel compiles here."""
    if key not in _pending:  # the common case, at every call
        return
    with _lock:
        worker = _pending.pop(key, None)
    if worker is None:
        return
    try:
        code = worker.proc.wait(timeout=WAIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        worker.proc.kill()
        code = worker.proc.wait()
    if code != 0:
        worker.err.seek(0)
        tail = worker.err.read()[-ERROR_TAIL_BYTES:].decode(errors="replace")
        log.warning("compiling %s ahead failed (exit %s), compiling it here:\n%s", key, code, tail)
    worker.err.close()


@atexit.register
def _stop_all() -> None:
    """A stage that never ran its kernel: end its worker with the process."""
    for key in list(_pending):
        worker = _pending.pop(key)
        worker.proc.kill()
        worker.proc.wait()
        worker.err.close()


def cached(compiled: Any, sig: Any) -> bool:
    """Whether numba's cache holds ``compiled`` (a dispatcher or a ``CFunc``, caching on)
    compiled for ``sig``: its index, read as numba reads it on a call (any surprise: yes,
    so that nothing starts)."""
    try:
        from numba.core.registry import cpu_target

        cache = compiled._cache
        key = cache._index_key(sig, cpu_target.target_context.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # numba's internals changed: do as without workers
        log.debug("numba cache index unreadable; not compiling ahead", exc_info=True)
        return True


def _env() -> dict[str, str]:
    """The worker's environment: this one's (the same ``NUMBA_CACHE_DIR`` and numba
    settings), with this ``meshnode`` first on its path."""
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": root + (os.pathsep + path if path else "")}


# -- numba's cache, one process at a time ----------------------------------------------


def lock_cache() -> None:
    """Make numba's cache saves (and loads) in this process hold an exclusive (shared)
    ``flock`` on the cache's folder, so that another process's save of the same function
    waits: numba picks a new entry's data file name from the index it read, and writes
    the index before the data. Idempotent."""
    try:
        import fcntl  # noqa: F401  (POSIX only)
    except ImportError:  # no flock: numba's cache as numba leaves it
        return
    from numba.core.caching import IndexDataCacheFile

    if getattr(IndexDataCacheFile.save, "_locked", False):
        return
    save: Any = IndexDataCacheFile.save
    load: Any = IndexDataCacheFile.load

    def locked_save(self: Any, key: Any, data: Any) -> None:
        with _flock(self._cache_path, shared=False):
            save(self, key, data)

    def locked_load(self: Any, key: Any) -> Any:
        with _flock(self._cache_path, shared=True):
            return load(self, key)

    locked_save._locked = True  # type: ignore[attr-defined]
    IndexDataCacheFile.save = locked_save  # type: ignore[method-assign]
    IndexDataCacheFile.load = locked_load  # type: ignore[method-assign]


@contextlib.contextmanager
def _flock(folder: str, *, shared: bool) -> Iterator[None]:
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def work(calls: Sequence[tuple[str, str, tuple[Any, ...]]]) -> None:
    """The worker: make each call ``(module, function, args)`` (from :func:`run`, this
    package's own parent process), saving into numba's cache under :func:`lock_cache`."""
    lock_cache()
    for module, name, args in calls:
        getattr(importlib.import_module(module), name)(*args)


def main() -> None:
    """``python -m meshnode.engine.cpu.warmup``: :func:`work` on the pickled ``(import
    path, calls)`` on stdin (the path is not applied: ``-m`` has imported this module)."""
    _, calls = pickle.loads(sys.stdin.buffer.read())
    work(calls)


if __name__ == "__main__":
    main()
