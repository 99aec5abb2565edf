"""The daemon's C heap: one malloc arena for the whole process.

glibc's ``malloc`` gives a thread that allocates while another holds the main arena an
arena of its own (up to eight per core), and keeps what is freed in each arena for that
arena's next allocations. A node has several such threads: the event loop, the worker
thread that runs the stage's forwards (NumPy temporaries; the kernels are loaded there at
the first request, leaving numba's and LLVM's garbage behind), the kernel threads, trio's
and the tokenizer's threads. Each arena then holds its own peak and its own free memory:
a single-node ``meshnode join`` serving SmolLM2 at ``--threads 2`` held 410 MiB after a
completion with the default arenas, 381 MiB with two, 370 MiB with one
(``MALLOC_ARENA_MAX``, benchmarks/engine.py ``--join-rss``). Python code allocates under
the GIL and the compiled kernels allocate nothing in their loops, so the threads hardly
contend for one arena's lock.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["MALLOC_ARENAS", "limit_malloc_arenas"]

log = logging.getLogger(__name__)

#: Arenas the daemon's threads share (see the module docstring for the measurement).
MALLOC_ARENAS = 1
_M_ARENA_MAX = -8  # mallopt's parameter number (glibc's malloc.h)


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Let ``malloc`` create no more than ``arenas`` arenas from now on (threads that
    allocate next share them). Call it before the process starts its threads.

    Returns False where the C library has no such setting (not glibc): nothing changes.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_ARENA_MAX, arenas))
    log.debug("malloc arenas limited to %d: %s", arenas, done)
    return done
