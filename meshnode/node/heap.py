"""The daemon's C heap: one malloc arena for the whole process, and free pages handed
back once a stage is loaded.

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

``free`` returns memory to the system only from the top of the heap. Loading a model
leaves large free stretches below live allocations: building Gemma 3's tokenizer from its
13-million-character ``tokenizer.json`` frees ~190 MiB that way, which the process kept
for good. :func:`release_free_memory` (``malloc_trim``) hands such pages back; the stage
runs it once its weights are loaded.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["MALLOC_ARENAS", "limit_malloc_arenas", "release_free_memory"]

log = logging.getLogger(__name__)

#: Arenas the daemon's threads share (see the module docstring for the measurement).
MALLOC_ARENAS = 1
_M_ARENA_MAX = -8  # mallopt's parameter number (glibc's malloc.h)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the C library the process runs on


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Let ``malloc`` create no more than ``arenas`` arenas from now on (threads that
    allocate next share them). Call it before the process starts its threads.

    Returns False where the C library has no such setting (not glibc): nothing changes.
    """
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_ARENA_MAX, arenas))
    log.debug("malloc arenas limited to %d: %s", arenas, done)
    return done


def release_free_memory() -> bool:
    """Return the free pages of every malloc arena to the system (they read as zeros
    when malloc hands them out again). Takes a few milliseconds; call it after a load,
    not per request.

    Returns False where the C library has no ``malloc_trim`` (not glibc).
    """
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
