"""The daemon's memory (``meshnode.node.heap``): malloc arenas and free heap, counted in a
fresh process, and what starting ``join`` imports."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# Four threads allocate at once, then the process counts its arenas in malloc_info's XML.
COUNT_ARENAS = """
import ctypes, sys, tempfile, threading
from meshnode.node.heap import limit_malloc_arenas
if sys.argv[1] == "limit":
    assert limit_malloc_arenas()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
start = threading.Barrier(4)
def allocate():
    start.wait()
    for _ in range(1000):
        libc.malloc(4000)
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.NamedTemporaryFile() as f:
    out = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, out)
    libc.fclose(out)
    print(open(f.name).read().count("<heap nr="))
"""


def _arenas(mode: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", COUNT_ARENAS, mode], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    return int(run.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")
def test_the_daemon_s_threads_share_one_malloc_arena() -> None:
    """Without the limit each thread that allocates gets an arena of its own (and keeps
    its own free memory); with it, the four threads and the main one share one."""
    assert _arenas("default") > 1
    assert _arenas("limit") == 1


# 2,000 blocks of 64 KiB freed below one that stays: free() cannot shrink the heap past it.
FREE_BELOW_A_LIVE_BLOCK = """
import ctypes
from pathlib import Path
from meshnode.node.heap import limit_malloc_arenas, release_free_memory
def anon_mib():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(l for l in status if l.startswith("RssAnon")).split()[1]) / 1024
limit_malloc_arenas()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(64 << 10) for _ in range(2000)]
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
last = libc.malloc(64)
for b in blocks:
    libc.free(b)
before = anon_mib()
assert release_free_memory()
print(before - anon_mib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_free_memory_below_live_allocations_goes_back_to_the_system() -> None:
    """125 MiB freed under a live block stay resident after ``free``; trimming hands
    most of them back (loading Gemma 3's tokenizer leaves ~190 MiB so)."""
    run = subprocess.run(
        [sys.executable, "-c", FREE_BELOW_A_LIVE_BLOCK], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) > 60  # 112 MiB here; nothing without the trim


def test_starting_join_does_not_import_numba() -> None:
    """numba and LLVM (``import numba`` maps 39 MiB of ``libllvmlite.so`` and allocates
    8 MiB) load at a block stage's first product, not with the daemon: a node holding no
    CPU block stage (a worker not yet loaded, float32, CUDA) never pays for them."""
    code = "import json, sys, meshnode.cli, meshnode.cli.join; print(json.dumps(list(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    modules = set(json.loads(run.stdout))
    assert "meshnode.node.daemon" in modules
    assert not {"numba", "llvmlite"} & modules
