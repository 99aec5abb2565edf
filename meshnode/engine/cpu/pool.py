"""Kernel threads that share a product by claiming its chunks, each from a range of its own.

A decode step of a small model is a hundred-odd products of 100-300 µs each, a few tens
of microseconds apart. numba's parallel regions (OpenMP) cost more than a second thread
saves there: each product wakes the sleeping threads (or, spinning, they starve a busy
machine), splits the rows statically and waits at a barrier for the last thread, so a
thread that starts late or is descheduled holds the product up. Here instead:

- the calling thread posts a product (its arguments' addresses, a compiled ``cfunc`` that
  computes one chunk of output rows) into a shared ``int64`` array and claims chunks
  itself at once; it only ever waits for chunks another thread has claimed and is
  computing (microseconds each), never for a thread that has not started;
- helper threads spin for :data:`SPIN_MICROSECONDS` after their last chunk (so the
  products of one forward find them awake), then sleep on an event until the next post
  wakes them: no CPU is burned between tokens;
- the chunks are dealt out in contiguous ranges, one a thread (the caller's first): each
  thread claims the chunks of its own range in order, so it streams its weights as one
  thread would (chunks taken in turns, a thread's next chunk is not where its last one
  ended, and starts with weights not yet asked for: 4-7 % more of one thread's CPU time
  on the Llama-3.2-1B shape's one-row products, ``benchmarks/streams_step.py
  --chunk-orders``); a thread done with its range takes chunks from the end of another's
  (a late helper's range is taken from its end by the caller);
- a range word packs the job's generation and the range's first and end chunk, so a
  thread can only claim a chunk of the job it read (compare-and-swap), and a job's fields
  stay fixed while any of its chunks is unclaimed or in flight: consecutive jobs take
  turns between two areas of fields (and of done counts), so that a job can be posted
  while a helper still computes a chunk of the one before (descheduled mid-chunk, which
  the caller then computed itself); only a helper still in the job before that one
  makes the caller compute the next product alone.

Every output element is computed by one chunk with the same code as the serial kernel:
results are bit-identical whatever the thread count. One product at a time uses the pool;
a second thread posting meanwhile (several stages in one process) computes serially.

**The rule every chunk function must keep**: a chunk may run twice at once, and may finish
after the caller has returned. When a helper holds a chunk past the caller's patience (a
few of the job's chunk times: a helper descheduled mid-chunk on a busy machine) the caller
computes that chunk itself and returns; the helper then completes it too. So a chunk
writes only finished values to memory the caller reads, each value the same however often
it is written: partial sums live in the chunk's own scratch (per task or per thread),
never in the output (a window's attention once kept them in the output and a busy machine
read half-summed values; issue 30).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from meshnode.engine.cpu.gauge import SAMPLE_SECONDS, CoreGauge, usable_cpus

# the shared words under their old names: the chunk functions read their job's fields as
# pool.X, pool.ROWS, ... (pool_words.__all__)
from meshnode.engine.cpu.pool_words import *  # noqa: F403
from meshnode.engine.cpu.pool_words import (
    _MAX_GEN,
    ACTIVE,
    AHEAD,
    AHEAD_END,
    AREAS,
    CALLER_RAN,
    CHUNKS,
    COUNTS,
    HELPER_RAN,
    HELPERS,
    MAX_HELPERS,
    RAN,
    REDONE,
    SLEPT_STARTED,
    SLEPT_STARTS,
    SPINS,
    STARTED,
    STARTS,
    WAITED,
    WORDS,
    _calibrate,
    _helper_spin,
    _now,
    _post,
    _stale,
    _work,
)

__all__ = [
    "CHUNK_ROWS",
    "PANEL_CHAINS",
    "SAMPLE_SECONDS",
    "CoreGauge",
    "KernelPool",
    "chunk_rows",
    "usable_cpus",
]

# Output rows per chunk, at least (4-row tiles), about CHUNKS_PER_THREAD chunks per thread
# (balance, few claims: a cache line passed between cores, ~0.1 µs each), and at most
# about CHUNK_WORK weights times activation rows per chunk: 2-15 µs for the products of a
# layer (SmolLM2: 32 rows of 576 Q4_1 one row ~2 µs, 224 rows ~13 µs), up to ~50 µs for
# an output head (Gemma 3: 819 rows of 640 Q8_0). Measured at 2 threads (Gemma 3 decode,
# in one process, a raised priority): CHUNK_WORK 2**19 against 2**17 (~15 µs head chunks)
# 9.23 -> 8.87 ms for the 262k-row head; more, smaller chunks (16 per thread, 8 or 16 rows
# at least) were slower. At real size chunks are longer: on the Llama-3.2-1B shape (one
# thread's CPU time, busy machine) ~70 µs for the q8 8-row products, ~130 µs for the 8-row
# down projection (32 rows of 8192), ~80-110 µs for an exact decode product. Weighing
# each activation row fully (chunks a third as long for 8 rows, 16 rows at least) did no
# better there at 2 threads (benchmarks/streams_step.py, load 7-10, both modes: one
# thread's CPU time x 1.05 against 1.01 for q8, x 1.01 against 0.97 exact; each chunk
# starts with weights not yet asked for).
CHUNK_ROWS = 32
# float32 a thread's scratch holds beyond 4 n_in, at least: .panels.CHAINS and the 15
# floats its start may move on to a 64-byte line
PANEL_CHAINS = 2048 + 16
CHUNK_WORK = 1 << 19
CHUNKS_PER_THREAD = 8
# How long a helper spins for the next chunk before it sleeps: longer than the gaps
# between the products of one forward (attention, norms: ~10-100 µs), short enough that a
# busy machine loses little and an idle node sleeps between tokens.
SPIN_MICROSECONDS = 300
# Bytes of its range in the next product that an idle helper asks for ahead (pool_words'
# AHEAD): between two products the caller runs the serial parts of a step (attention,
# norms, the SwiGLU, quantizing the activations, Python), the helper spins and the memory
# rests, while a decode product at 2 threads streams its weights near the memory's rate.
# The next product is the one that followed this one the last time (the same each step
# of a decode); only products of at least AHEAD_MIN_BYTES a helper's range count (the
# attention's and the experts' blocks do not break the chain).
AHEAD_BYTES = 1 << 20
AHEAD_MIN_BYTES = 64 << 10
# Products whose chunk size and spans ahead the pool keeps (each holds its parts: all
# dropped when full)
PLANS = 1024
# How long the caller waits for the chunks helpers hold before computing them itself:
# PATIENCE_CHUNKS times the job's chunk time (a helper computing its last chunk ends
# within one; one descheduled mid-chunk on a busy machine holds it for a time slice,
# milliseconds), within PATIENCE_MICROSECONDS .. PATIENCE_MAX_MICROSECONDS. The chunk time
# is learned per chunk function and row count, from the caller's own chunks (time per
# unit of chunk_rows()' work, a running average weighing each product PATIENCE_WEIGHT).
# A fixed 100 µs was too short at real size, where an 8-row chunk takes 70-130 µs: idle,
# an 8-stream step of the Llama-3.2-1B shape redid 6.5 chunks a step at 100 µs against
# 0.5 at 300 µs and 1000 µs, in 412 ms against 363 and 382 (benchmarks/streams_step.py
# --patience-us 100 300 1000, 2026-11-29); a one-row chunk takes ~10-30 µs.
PATIENCE_MICROSECONDS = 100
PATIENCE_MAX_MICROSECONDS = 1000
PATIENCE_CHUNKS = 3
PATIENCE_WEIGHT = 0.25


def chunk_rows(n_out: int, n_in: int, k: int, threads: int) -> int:
    """Output rows per chunk of a product of ``k`` activation rows of ``n_in`` into
    ``n_out`` outputs on ``threads`` threads: about :data:`CHUNKS_PER_THREAD` chunks per
    thread, of at most :data:`CHUNK_WORK` weights times rows (a row's decode weighs as
    much as 4 rows' FMAs), at least :data:`CHUNK_ROWS`, a multiple of 4."""
    rows = min(-(-n_out // (CHUNKS_PER_THREAD * threads)), CHUNK_WORK // _row_work(n_in, k))
    return max(CHUNK_ROWS, rows - rows % 4)


def _row_work(n_in: int, k: int) -> int:
    """The work of one output row of a product of ``k`` activation rows of ``n_in``, in
    weights times rows (a row's decode weighs as much as 4 rows' FMAs): what
    :func:`chunk_rows` fills a chunk with and the caller's patience is learned by."""
    return n_in * (1 + k // 4)


class _Plan:
    """What the posts of one product share: its parts (the same arrays), what it was
    worked out for (chunk function, activation rows, ``n_in``, threads), rows a chunk,
    the key and chunk work its patience is learned by, the helpers' spans ahead
    (:func:`_spans`) and whether helpers ask ahead for it."""

    __slots__ = ("counts", "key", "of", "parts", "rows", "spans", "units")

    def __init__(
        self, parts: Any, of: tuple[int, ...], rows: int, key: tuple[int, int], units: int
    ) -> None:
        self.parts, self.of, self.rows, self.key, self.units = parts, of, rows, key, units
        self.spans: tuple[tuple[int, int], ...] = ()
        self.counts = False


class KernelPool:
    """The calling thread plus up to :data:`MAX_HELPERS` helper threads, started as
    needed, for one product at a time."""

    def __init__(self, gauge: CoreGauge | None = None) -> None:
        self._st = np.zeros((1 + AREAS) * WORDS, np.int64)
        self._st[ACTIVE] = 1
        self._gauge = gauge or CoreGauge()
        self._lock = threading.Lock()
        self._events: list[threading.Event] = []
        self._scratch = np.zeros((1, 0), np.float32)  # [threads, 7 n_in]: decoded rows
        self._gen = 0
        self._pid = os.getpid()
        self._per_us = 0.0  # idle-loop iterations a microsecond (calibrated at the first post)
        self._cycles_per_us = 0.0  # of the time stamp counter (inf: none; 0: not known yet)
        self._patience_us: float | None = None  # a fixed patience (set_waits), else learned
        self._spin_us: float = SPIN_MICROSECONDS
        # (chunk function, rows k) -> the caller's seconds a unit of chunk work
        self._unit_s: dict[tuple[int, int], float] = {}
        # the arrays of the last AREAS jobs, while a helper may still use them
        self._kept: tuple[Any, ...] = ((),) * AREAS
        self._ahead_bytes = AHEAD_BYTES
        self._plans: dict[int, _Plan] = {}  # id(parts) -> what its posts share
        # id(parts) -> the helpers' spans of the product that came next (of at least
        # AHEAD_MIN_BYTES), the last time
        self._after: dict[int, tuple[tuple[int, int], ...]] = {}
        self._last_parts = 0  # id(parts) of the last product of at least AHEAD_MIN_BYTES
        self.posted = 0  # products shared so far
        self.declined = 0  # products left to the caller: a helper still held an old chunk
        self.crowded = 0  # products left to the caller: the gauge found under 1.5 cores free
        self.woken = 0  # products posted while a helper that may claim slept

    def job_word(self, word: int) -> int:
        """Word ``word`` (:data:`ROWS`, :data:`N_IN`, ...) of the last job posted (tests)."""
        return int(self._st[WORDS * (1 + self._gen % AREAS) + word])

    def counts(self) -> dict[str, float]:
        """What the pool has done so far (benchmarks: differences over a run): products
        ``posted``, ``declined`` (:meth:`run`), left to the caller because other
        processes used the cores (``crowded``: the gauge) and posted while a helper slept
        (``woken``); ``chunks`` posted, run by the ``caller`` and by the ``helpers``
        (a chunk redone by the caller counts once for each); ``waited_us``: the caller's
        wait for the chunks helpers held after its own; ``start_us`` / ``starts``: the
        time from a post to a spinning helper's first chunk of the job, summed, and the
        jobs, and ``woken_start_us`` / ``woken_starts`` the same for the first job after
        a helper slept (microseconds; 0 without a time stamp counter)."""
        if not self._cycles_per_us:  # calibrated here: not on a serving node's first post
            self._cycles_per_us = _cycles_per_microsecond() or math.inf
        st, per_us = self._st, self._cycles_per_us
        helpers = [COUNTS + 8 * who for who in range(1, int(st[HELPERS]) + 1)]
        return {
            "posted": self.posted,
            "declined": self.declined,
            "crowded": self.crowded,
            "woken": self.woken,
            "chunks": int(st[CHUNKS]),
            "caller": int(st[CALLER_RAN]) + self.redone,
            "helpers": sum(int(st[h + HELPER_RAN]) for h in helpers),
            "waited_us": int(st[WAITED]) / per_us,
            "start_us": sum(int(st[h + STARTED]) for h in helpers) / per_us,
            "starts": sum(int(st[h + STARTS]) for h in helpers),
            "woken_start_us": sum(int(st[h + SLEPT_STARTED]) for h in helpers) / per_us,
            "woken_starts": sum(int(st[h + SLEPT_STARTS]) for h in helpers),
        }

    @property
    def redone(self) -> int:
        """Chunks the caller computed itself because a helper held them past the
        patience (so far; the helper computed them too)."""
        return int(self._st[REDONE])

    def set_ahead(self, ahead_bytes: int = AHEAD_BYTES) -> None:
        """The bytes of its range in the next product an idle helper asks for ahead (0:
        none), from the next product (benchmarks)."""
        self._ahead_bytes = ahead_bytes
        self._plans.clear()
        self._after.clear()

    def set_waits(self, patience_us: float | None = None, spin_us: float | None = None) -> None:
        """Fix the caller's patience at ``patience_us`` (None: the pool's own, a few of
        the job's chunk times: :data:`PATIENCE_CHUNKS`) and the helpers' spin at
        ``spin_us`` (None: :data:`SPIN_MICROSECONDS`), from the next product (benchmarks)."""
        self._patience_us = patience_us
        self._spin_us = SPIN_MICROSECONDS if spin_us is None else spin_us
        if self._per_us:
            self._st[SPINS] = self._iterations(self._spin_us)

    @property
    def gauge(self) -> CoreGauge:
        """The gauge of the cores other processes leave this one (which other thread
        teams of the process, :mod:`.tiles`, read too)."""
        return self._gauge

    def run(
        self,
        fn: int | Callable[[], int],
        parts: tuple[Any, Any, Any],
        x: Any,
        out: Any,
        threads: int,
        keep: object = None,
    ) -> bool:
        """Compute ``out`` (``[k, n_out]``) = ``x`` (``k`` rows of ``n_in``, flat) times
        the stacked ``parts`` ``(a, b, c)`` on up to ``threads`` threads, chunk by chunk
        with the cfunc at address ``fn`` (:func:`.kernels.chunk_kernel`), or at the
        address ``fn()`` gives, asked for only once the job will be posted (so that a
        chunk function compiles only where the pool runs it: on a busy machine a first
        start's pool may never find a core free). ``keep``: what else the chunks read or
        write by address, held as the job's arrays are (below).

        Returns False, having done nothing, when fewer than two threads would run (the
        cap, or the cores other processes leave free), when another thread is using the
        pool, or when a helper still holds a chunk of the job before the last one: the
        caller then computes serially.
        """
        if threads < 2 or os.getpid() != self._pid:  # helpers do not survive a fork
            return False
        threads = min(threads, int(self._gauge.free() + 0.5))
        if threads < 2:
            self.crowded += 1
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._post(fn if isinstance(fn, int) else fn(), parts, x, out, threads, keep)
        finally:
            self._lock.release()

    def settle(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s`` seconds, until no helper still holds a chunk of a
        finished job (one descheduled mid-chunk on a busy machine finishes it when it
        runs again; until then the job after the next one cannot be posted). True when
        settled: the next :meth:`run` can post. For tests that check the pool took a
        product."""
        deadline = time.monotonic() + timeout_s
        while _stale(self._st):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def _post(
        self, fn: int, parts: tuple[Any, Any, Any], x: Any, out: Any, threads: int, keep: object
    ) -> bool:
        """Post the job, wake the helpers that sleep, do the caller's share."""
        k = out.shape[0]
        n_in = x.shape[0] // k
        # scratch a thread: the exact kernels' 4 n_in decoded values or .panels' blocks, the
        # q8 tiles' 26 n_in bytes (.q8_tiles.scratch_bytes)
        self._start(threads, max(7 * n_in, 4 * n_in + PANEL_CHAINS))
        plan = self.plan_of(fn, parts, k, n_in, out.shape[1], threads)
        gen = self._gen % _MAX_GEN + 1
        a, b, c = parts
        patience = self._patience(plan.key, plan.units)
        began = time.perf_counter()
        self.ask_ahead(plan, threads)
        args = (self._st, fn, gen, a, b, c, x, out, self._scratch, plan.rows, patience)
        woken = _post(*args)
        if woken < 0:
            # a helper descheduled mid-chunk of the job before the last (which the caller
            # then finished) still reads its fields, in the area this job would take, and
            # writes its output: no new job, and that job's arrays kept, until it is done
            self.declined += 1
            return False
        self._gen = gen
        self._kept = (*self._kept[1:], (parts, x, out, self._scratch, keep))
        self.posted += 1
        if woken:
            self.woken += 1
            self.wake(woken)
            _work(self._st, patience)
        self._learn(plan.key, plan.units, time.perf_counter() - began)
        self._chain(plan)
        return True

    def wake(self, woken: int) -> None:
        """Set the events of the helpers ``woken`` names (bit ``who``: helper ``who``),
        whose sleeping flags a post cleared."""
        for who in range(1, len(self._events) + 1):
            if woken >> who & 1:
                self._events[who - 1].set()

    def plan_of(
        self, fn: int, parts: tuple[Any, Any, Any], k: int, n_in: int, n_out: int, threads: int
    ) -> _Plan:
        """The plan of a product of ``parts`` (kept while they are the same arrays)."""
        plan = self._plans.get(id(parts))
        if plan is None or plan.parts is not parts or plan.of != (fn, k, n_in, threads):
            plan = self._plan(fn, parts, k, n_in, n_out, threads)
        return plan

    def patience(self, plan: _Plan) -> int:
        """The caller's patience for a job of ``plan``'s product (:meth:`_patience`)."""
        return self._patience(plan.key, plan.units)

    def ask_ahead(self, plan: _Plan, threads: int) -> None:
        """Tell the helpers what to ask for ahead once done with ``plan``'s product: the
        spans of the product that followed it the last time (a product too small to count
        leaves the words as they are)."""
        if plan.counts:
            after = self._after.get(id(plan.parts), ())
            st = self._st
            for who in range(1, threads):
                first, end = after[who - 1] if who <= len(after) else (0, 0)
                st[COUNTS + 8 * who + AHEAD], st[COUNTS + 8 * who + AHEAD_END] = first, end

    def _chain(self, plan: _Plan) -> None:
        """After ``plan``'s product: its spans, for the one before it (learned after it)."""
        if plan.counts:
            self._after[self._last_parts] = plan.spans
            self._last_parts = id(plan.parts)

    def posted_compiled(
        self, plans: list[_Plan], jobs: int, woken: int, declined: int, keep: object
    ) -> None:
        """Count ``jobs`` that compiled code posted (:mod:`.moe_step`; ``plans``: those of
        its products, in order; ``woken``: the posts that woke a helper; ``declined``: the
        products it ran alone instead), and keep ``keep`` (every array they read or write)
        as :meth:`run` keeps a job's arrays."""
        for _ in range(jobs):
            self._gen = self._gen % _MAX_GEN + 1
            self._kept = (*self._kept[1:], (keep, self._scratch))
        self.posted += jobs
        self.woken += woken
        self.declined += declined
        for plan in plans:
            self._chain(plan)

    def _plan(
        self, fn: int, parts: tuple[Any, Any, Any], k: int, n_in: int, n_out: int, threads: int
    ) -> _Plan:
        """What a product's posts share, worked out once (kept while its parts are the
        same arrays: a matrix's; an attention's or experts' blocks are new each time)."""
        if len(self._plans) >= PLANS:
            self._plans.clear()
            self._after.clear()
        rows = chunk_rows(n_out, n_in, k, threads)
        spans = _spans(parts, rows, threads, self._ahead_bytes)
        plan = _Plan(parts, (fn, k, n_in, threads), rows, (fn, k), rows * _row_work(n_in, k))
        # whether helpers ask ahead for it (and after it): of at least AHEAD_MIN_BYTES
        most = min(AHEAD_MIN_BYTES, self._ahead_bytes)
        plan.spans, plan.counts = spans, bool(spans) and spans[0][1] - spans[0][0] >= most
        self._plans[id(parts)] = plan
        return plan

    def _patience(self, key: tuple[int, int], units: int) -> int:
        """The caller's patience for a job of chunks of ``units`` work, in iterations:
        :data:`PATIENCE_CHUNKS` of its chunk times as learned for ``key`` (the first
        time :data:`PATIENCE_MICROSECONDS`), within the bounds, unless one is fixed."""
        us = self._patience_us
        if us is None:
            unit_s = self._unit_s.get(key)
            us = PATIENCE_MICROSECONDS if unit_s is None else PATIENCE_CHUNKS * unit_s * units * 1e6
            us = min(PATIENCE_MAX_MICROSECONDS, max(PATIENCE_MICROSECONDS, us))
        return self._iterations(us)

    def _learn(self, key: tuple[int, int], units: int, seconds: float) -> None:
        """Fold a product's time into ``key``'s time a unit of chunk work: ``seconds``
        from the post to the caller's return, over the chunks the caller ran (its wait
        for the helpers' last ones counts too: at most a chunk)."""
        ran = int(self._st[RAN])
        if ran:
            unit_s = seconds / (ran * units)
            last = self._unit_s.get(key, unit_s)
            self._unit_s[key] = last + PATIENCE_WEIGHT * (unit_s - last)

    def _start(self, threads: int, scratch: int) -> None:
        """Helpers up to ``threads - 1``, the others idle; scratch rows of ``scratch``."""
        threads = min(threads, MAX_HELPERS + 1)
        rows, width = self._scratch.shape
        if rows < threads or width < scratch:
            self._scratch = _lined_rows(max(rows, threads), max(width, scratch))
        if not self._per_us:
            self._per_us = _per_microsecond(self._st)
            self._st[SPINS] = self._iterations(self._spin_us)
        while len(self._events) < threads - 1:
            event = threading.Event()
            self._events.append(event)
            who = len(self._events)
            args = (self._st, event, who)
            name = f"meshnode-kernel-{who}"
            threading.Thread(target=_helper, args=args, name=name, daemon=True).start()
            self._st[HELPERS] = who
        self._st[ACTIVE] = threads

    def _iterations(self, microseconds: float) -> int:
        """Idle-loop iterations that take about ``microseconds`` (at least 100)."""
        return max(100, int(self._per_us * microseconds))


def _lined_rows(rows: int, width: int) -> np.ndarray:
    """Zeros ``[rows, width]`` float32 (``width`` rounded up to whole 64-byte lines), every
    row beginning on a 64-byte cache line: the chunk functions' scratch. NumPy's large
    arrays begin 16 bytes into a line, and a chunk's 32-byte loads from a scratch there
    straddled two lines every other load (the exact k-row passes ~1.1-1.2x as long,
    ``benchmarks/narrow_parts.py --offsets``; the q8 tiles' unpacked words likewise). The
    exact chunks also round their own start up (:func:`.kernels._line`); the q8 tiles'
    chunks (:mod:`.q8_tiles`, 64 activation rows and more) read the row where it begins."""
    width = -(-width // 16) * 16
    buf = np.zeros(rows * width + 16, np.float32)
    at = (-(buf.ctypes.data // 4)) % 16
    lined: np.ndarray = buf[at : at + rows * width].reshape(rows, width)
    return lined


def _spans(
    parts: tuple[Any, Any, Any], rows: int, threads: int, most: int
) -> tuple[tuple[int, int], ...]:
    """For helpers 1 .. ``threads - 1``: the addresses of the first bytes of their ranges
    of a product of ``parts`` in chunks of ``rows`` rows (as :func:`.pool_words._post`
    deals them out, a chunk ``rows`` rows of a part), at most ``most`` bytes, within the
    part their range starts in; none for a product smaller than :data:`AHEAD_MIN_BYTES`."""
    if sum(p.nbytes for p in parts) < AHEAD_MIN_BYTES:
        return ()
    counts = [(p.shape[0] + rows - 1) // rows for p in parts]
    chunks = sum(counts)
    spans = []
    for who in range(1, threads):
        first, end = who * chunks // threads, (who + 1) * chunks // threads
        ch, at = first, 0
        while at < 2 and ch >= counts[at]:
            ch, at = ch - counts[at], at + 1
        part = parts[at]
        if first >= end or ch >= counts[at] or part.ndim != 2:
            spans.append((0, 0))
            continue
        size = part.shape[1] * part.itemsize
        lo = part.ctypes.data + ch * rows * size
        hi = part.ctypes.data + min(part.shape[0], (ch + end - first) * rows) * size
        spans.append((lo, min(hi, lo + most)))
    return tuple(spans)


def _per_microsecond(st: np.ndarray) -> float:
    """Idle-loop iterations a microsecond on this CPU."""
    n = 20_000
    _calibrate(st, n)  # compiled or loaded first
    t = time.perf_counter()
    _calibrate(st, n)
    return n / max(1e-6, (time.perf_counter() - t) * 1e6)


def _cycles_per_microsecond() -> float:
    """Time stamp counter cycles a microsecond (0 without one): both are wall clocks, so
    a thread descheduled meanwhile does not change it."""
    _now()  # compiled or loaded first
    c, t = _now(), time.perf_counter()
    time.sleep(0.002)
    return float(_now() - c) / max(1e-6, (time.perf_counter() - t) * 1e6)


def _helper(st: np.ndarray, event: threading.Event, who: int) -> None:
    """A helper thread: spin for chunks, sleep when idle, woken by the next post."""
    while True:
        _helper_spin(st, who)
        event.wait()
        event.clear()
