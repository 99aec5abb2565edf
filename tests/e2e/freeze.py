"""Hang a node's compute while its event loop runs on: its other threads frozen by ptrace.

A stage whose forward hangs (a stuck kernel, a driver that never returns) still answers
heartbeats: only the thread that computes is stuck. SIGSTOP cannot make that (it stops the
whole process, heartbeats too). :class:`Freezer` attaches with ``PTRACE_SEIZE`` and stops
every thread of a process except its main one (the trio loop: sessions, heartbeats, the
API) with ``PTRACE_INTERRUPT``; detaching lets them go on where they were.

A Python thread frozen while it holds the GIL would stop the main thread as well. The
forwards spend most of their time in numba kernels and BLAS calls that release it, so
:meth:`Freezer.freeze` checks that the node still answers its API with the threads frozen,
and otherwise lets them go and tries again a moment later.

ptrace requests must all come from the thread that attached, so a :class:`Freezer` owns
one thread that does every call. Linux only; :func:`unavailable_reason` says why not here.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_DETACH = 17
WALL = 0x40000000  # __WALL: wait for any thread, not only children
TRIES = 200  # freeze, probe, thaw: each try takes a probe's time at most
RETRY_PAUSE_S = 0.005

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def unavailable_reason(pid: int) -> str | None:
    """Why this process cannot ptrace ``pid`` (a child it started), or ``None``."""
    if not os.path.isdir(f"/proc/{pid}/task"):
        return "no /proc/PID/task: freezing threads with ptrace needs Linux"
    probe = Freezer(pid)
    try:
        reason = probe.call(probe.attach_test)
        assert reason is None or isinstance(reason, str)
        return reason
    finally:
        probe.close()


def freezer_of(node: Any, timeout_s: float) -> tuple[Freezer, Callable[[], bool]]:
    """A :class:`Freezer` of ``node``'s process (a test's node: ``process``, ``api``,
    ``get``) and the check :meth:`Freezer.freeze` takes: the node's event loop answers its
    status endpoint within ``timeout_s``. Skips the test, with the reason, where ptrace
    cannot be used."""
    reason = unavailable_reason(node.process.pid)
    if reason is not None:
        pytest.skip(reason)
    status_url = f"{node.api}/v1/mesh/status"

    def serves() -> bool:
        """The node's event loop answers with its other threads frozen."""
        try:
            return bool(node.get(status_url, timeout_s).status_code == 200)
        except httpx.HTTPError:
            return False

    return Freezer(node.process.pid), serves


class Freezer:
    """Freeze and thaw the non-main threads of process ``pid`` (see the module docstring)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.frozen: list[int] = []
        self._calls: queue.Queue[tuple[Callable[[], object], queue.Queue[object]] | None]
        self._calls = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="freezer")
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            work, reply = item
            try:
                reply.put(work())
            except BaseException as exc:  # handed to the caller
                reply.put(exc)
        self._thaw()  # a thread that exits detaches anyway; say so explicitly

    def call(self, work: Callable[[], object]) -> object:
        """``work()`` on the tracer thread; its result (its exception is raised here)."""
        reply: queue.Queue[object] = queue.Queue()
        self._calls.put((work, reply))
        result = reply.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def attach_test(self) -> str | None:
        if _libc.ptrace(PTRACE_SEIZE, self.pid, None, None) != 0:
            err = ctypes.get_errno()
            return f"cannot ptrace a child process here: {os.strerror(err)}"
        _libc.ptrace(PTRACE_INTERRUPT, self.pid, None, None)  # detaching needs a stop
        os.waitpid(self.pid, WALL)
        _libc.ptrace(PTRACE_DETACH, self.pid, None, None)
        return None

    def _threads(self) -> list[int]:
        return [int(t) for t in os.listdir(f"/proc/{self.pid}/task") if int(t) != self.pid]

    def _freeze(self) -> None:
        for tid in self._threads():
            if _libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
                continue  # the thread ended meanwhile
            _libc.ptrace(PTRACE_INTERRUPT, tid, None, None)
            os.waitpid(tid, WALL)
            self.frozen.append(tid)

    def _thaw(self) -> None:
        for tid in self.frozen:
            _libc.ptrace(PTRACE_DETACH, tid, None, None)
        self.frozen.clear()

    def freeze(self, still_serves: Callable[[], bool]) -> int:
        """Freeze the threads at a moment when ``still_serves()`` (the node's loop answers)
        holds with them frozen; the number of threads frozen. Raises RuntimeError when no
        such moment came in :data:`TRIES` tries."""

        def attempt() -> int:
            for _ in range(TRIES):
                self._freeze()
                if self.frozen and still_serves():
                    return len(self.frozen)
                self._thaw()
                time.sleep(RETRY_PAUSE_S)
            raise RuntimeError(f"could not freeze {self.pid}'s threads outside the GIL")

        frozen = self.call(attempt)
        assert isinstance(frozen, int)
        return frozen

    def thaw(self) -> None:
        """Let the frozen threads go on."""
        self.call(self._thaw)

    def close(self) -> None:
        """Thaw anything frozen and end the tracer thread."""
        self._calls.put(None)
        self._thread.join(timeout=10)
