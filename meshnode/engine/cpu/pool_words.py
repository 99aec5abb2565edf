"""The kernel pool's shared words and the compiled loops that read and write them
(:mod:`.pool`: the protocol; :class:`.pool.KernelPool`: the Python side that posts).

One ``int64`` array is shared by the calling thread and the helper threads: control
words, then the areas the jobs take in turns. The functions here claim chunks
(:func:`_take`), run them (:func:`_claim_and_run`), post a job (:func:`_post`), do the
caller's share and wait for the helpers' last chunks (:func:`_work`), and spin a helper
(:func:`_helper_spin`); the chunk functions (``.kernels``, ``.q8_kernels``, the
attention's, the experts') read their job's fields from the words named here.
"""

from __future__ import annotations

import numpy as np
from numba.np.numpy_support import carray

from meshnode.engine.cpu.atomics import call3, cas, cycles, fetch_add, load, pause, ptr_u8, store
from meshnode.engine.cpu.simd import entry, inner
from meshnode.engine.cpu.simd_int import prefetch

__all__ = [
    "ACTIVE",
    "AHEAD",
    "AHEAD_END",
    "AHEAD_STEP",
    "AREAS",
    "BUSY",
    "CA",
    "CALLER_RAN",
    "CB",
    "CHUNKS",
    "CLAIM",
    "COUNTS",
    "DONE",
    "FN",
    "HELPERS",
    "HELPER_RAN",
    "JOB",
    "MAX_HELPERS",
    "NA",
    "NB",
    "NC",
    "N_IN",
    "N_OUT",
    "OUT",
    "POSTED",
    "RAN",
    "RANGES",
    "RBA",
    "RBB",
    "RBC",
    "REDONE",
    "ROWS",
    "SCRATCH",
    "SEEN",
    "SLEEPING",
    "SLEPT_STARTED",
    "SLEPT_STARTS",
    "SPINS",
    "STARTED",
    "STARTS",
    "STRIDE",
    "WAITED",
    "WORDS",
    "A",
    "B",
    "C",
    "K",
    "X",
    "_post",
    "_stale",
    "_work",
    "run_alone",
    "run_chunks",
]


# The words of the shared array: a block of WORDS control words, then AREAS areas of as
# many words, which a job's fields and done count take in turns (job generation g, area
# g % AREAS: _area); a chunk function reads its job's fields from its area's address as
# if it were the whole array (only the words from JOB are filled there). Words written by
# different threads sit on their own 64-byte lines (8 words), so a spinning helper's
# reads do not slow the writers.
CLAIM = 0  # generation << 40 | chunks << 20: the job posted last
DONE = 8  # in an area: chunks of its job finished
# the caller's counts (time stamp counter cycles: .atomics.cycles; KernelPool.counts)
WAITED = 9  # cycles the caller waited for the chunks helpers computed, after its own
CHUNKS = 10  # chunks posted
CALLER_RAN = 11  # chunks the caller ran
ACTIVE = 16  # how many threads may claim (the caller and helpers 1 .. ACTIVE - 1)
HELPERS = 17  # helper threads started
SPINS = 18  # idle iterations a helper spins for the next chunk before it sleeps
SLEEPING = 24  # + who: 1 while helper ``who`` sleeps on its event
MAX_HELPERS = 63
BUSY = SLEEPING + 8 * ((MAX_HELPERS + 8) // 8)  # + who: 1 + (generation << 20 | chunk)
# + 8 who + SEEN .. SLEPT_STARTS: helper ``who``'s counts, on a line of its own
COUNTS = BUSY + 8 * ((MAX_HELPERS + 8) // 8)
SEEN = 0  # the last job generation it claimed a chunk of
STARTED, STARTS = 1, 2  # cycles from a post to its first chunk of the job, summed; jobs
SLEPT_STARTED, SLEPT_STARTS = 3, 4  # the same for the first job after it slept
HELPER_RAN = 5  # chunks it ran
# the bytes [AHEAD, AHEAD_END) (addresses, written by the caller at each post) that the
# helper asks for while it has no chunk to claim: the first weights of its range in the
# product the caller expects next (.pool.KernelPool; 0, 0: none)
AHEAD, AHEAD_END = 6, 7
# + 8 who: generation << 40 | end << 20 | first: the chunks of the job left in thread
# ``who``'s range (the caller's: 0); its owner claims the first, others the last
RANGES = COUNTS + 8 * (MAX_HELPERS + 1)
JOB = RANGES + 8 * (MAX_HELPERS + 1)  # the job's fields, written by the poster
FN, A, NA, RBA, B, NB, RBB, C, NC, RBC = range(JOB, JOB + 10)
X, K, N_IN, OUT, N_OUT, SCRATCH, STRIDE, CA, CB, ROWS = range(JOB + 10, JOB + 20)
REDONE = JOB + 20  # chunks the caller computed that a helper held (written by the caller)
RAN = JOB + 21  # chunks the caller claimed and ran in the last job (written by the caller)
POSTED = JOB + 22  # in an area: the time stamp counter when the job was posted
WORDS = JOB + 24
AREAS = 2  # job areas after the control words: a job's and the one before's

# Bytes an idle helper asks for per iteration of its spin (eight cache lines): between
# two looks at the claim words, so that a post is still seen within a fraction of a µs.
AHEAD_STEP = 512

_FIELD = (1 << 20) - 1  # chunk count and next chunk: 20 bits each
# generations 1 .. _MAX_GEN in turn (the claim word's other 23 bits): an even count, so
# that consecutive jobs take different areas across the wrap too
_MAX_GEN = (1 << 23) - 2


@inner
def _area(gen):  # type: ignore[no-untyped-def]
    # the first word of the area of job generation ``gen``
    return WORDS * (1 + gen % AREAS)


@inner
def _take(st, who):  # type: ignore[no-untyped-def]
    # claim a chunk: the first of this thread's range, else the last of another's (the
    # next thread's first); generation << 20 | chunk, or -1 when none is left. A helper
    # names the chunk in its BUSY word before it claims it (cleared if it lost the
    # race), so the caller can see (and redo) a chunk a descheduled helper holds.
    n = load(st, ACTIVE)
    for i in range(n):
        at = RANGES + 8 * ((who + i) % n)
        while True:
            word = load(st, at)
            first, end = word & _FIELD, (word >> 20) & _FIELD
            if first >= end:
                break
            held = (word >> 40) << 20 | (first if i == 0 else end - 1)
            if who > 0:
                store(st, BUSY + who, 1 + held)
            if cas(st, at, word, word + 1 if i == 0 else word - (1 << 20)):
                return held
            if who > 0:
                store(st, BUSY + who, 0)
    return -1


@inner
def _open(st):  # type: ignore[no-untyped-def]
    # whether a chunk of the job is left to claim
    for who in range(load(st, ACTIVE)):
        word = load(st, RANGES + 8 * who)
        if word & _FIELD < (word >> 20) & _FIELD:
            return True
    return False


@inner
def _claim_and_run(st, who, slept):  # type: ignore[no-untyped-def]
    # claim chunks of the current job until none is left; how many this thread ran. A
    # helper clears its BUSY word after counting its chunk done (in the job's area), so
    # the caller knows when no helper uses an area; it counts the time from a job's post
    # to its first chunk of it (``slept``: the first job after it slept) in its COUNTS
    # words.
    ran = 0
    while True:
        held = _take(st, who)
        if held < 0:
            return ran
        gen = held >> 20
        at = _area(gen)
        if who > 0 and st[COUNTS + 8 * who + SEEN] != gen:
            _count_start(st, who, at, gen, slept != 0 and ran == 0)
        call3(load(st, at + FN), st.ctypes.data + 8 * at, who, held & _FIELD)
        fetch_add(st, at + DONE, 1)
        ran += 1
        if who > 0:
            store(st, BUSY + who, 0)


@inner
def _count_start(st, who, at, gen, slept):  # type: ignore[no-untyped-def]
    # helper ``who`` claimed its first chunk of job ``gen`` (area ``at``): count the time
    # since its post, apart for the first job after a sleep
    mine = COUNTS + 8 * who
    st[mine + SEEN] = gen
    late = cycles() - st[at + POSTED]
    if slept:
        st[mine + SLEPT_STARTED] += late
        st[mine + SLEPT_STARTS] += 1
    else:
        st[mine + STARTED] += late
        st[mine + STARTS] += 1


@entry(nogil=True)
def _helper_spin(st, who):  # type: ignore[no-untyped-def]
    # run chunks as they are posted; return (to sleep) after SPINS idle iterations. While
    # it has no chunk, it asks for the bytes its next range is expected to start with
    # (AHEAD: the caller runs the serial parts between products, the memory rests)
    spins = load(st, SPINS)
    idle = 0
    slept = np.int64(1)  # woken (or started) for the job it claims first (int64: below)
    mine = COUNTS + 8 * who
    ahead, ahead_end = load(st, mine + AHEAD), load(st, mine + AHEAD_END)
    while True:
        ran = _claim_and_run(st, who, slept) if who < load(st, ACTIVE) else 0
        if ran > 0:
            st[mine + HELPER_RAN] += ran
            idle = 0
            slept = np.int64(0)
            ahead, ahead_end = load(st, mine + AHEAD), load(st, mine + AHEAD_END)
            continue
        if ahead < ahead_end:
            lines = carray(ptr_u8(ahead), (AHEAD_STEP,))
            for line in range(0, AHEAD_STEP, 64):
                prefetch(lines, line)
            ahead += AHEAD_STEP
        pause()
        idle += 1
        if idle >= spins:
            store(st, SLEEPING + who, 1)
            if who < load(st, ACTIVE) and _open(st):  # a post between the last look and the flag
                store(st, SLEEPING + who, 0)
                idle = 0
                continue
            return


@entry(nogil=True)
def _stale(st):  # type: ignore[no-untyped-def]
    # whether a helper still holds a chunk of a finished job (descheduled mid-chunk)
    held = 0
    for who in range(1, load(st, HELPERS) + 1):
        held |= load(st, BUSY + who)
    return held != 0


@inner
def _area_held(st, gen):  # type: ignore[no-untyped-def]
    # whether a helper still holds a chunk of a job in the area job ``gen`` would take (a
    # job before the last one: descheduled mid-chunk, which the caller finished)
    for who in range(1, load(st, HELPERS) + 1):
        held = load(st, BUSY + who) - 1
        if held >= 0 and _area(held >> 20) == _area(gen):
            return True
    return False


@entry(nogil=True)
def _work(st, patience):  # type: ignore[no-untyped-def]
    # the caller's share, then wait for the chunks helpers still compute; after
    # ``patience`` idle iterations (a helper descheduled mid-chunk, on a busy machine)
    # compute the chunks helpers hold itself: they write the same values
    # int64 arguments, as the helpers': one compiled function
    ran = _claim_and_run(st, np.int64(0), np.int64(0))
    store(st, RAN, ran)
    word = load(st, CLAIM)
    chunks, gen = (word >> 20) & _FIELD, word >> 40
    st[CHUNKS] += chunks
    st[CALLER_RAN] += ran
    at = _area(gen)
    waited = 0
    began = cycles()
    while load(st, at + DONE) < chunks:
        pause()
        waited += 1
        if waited >= patience:
            for who in range(1, load(st, HELPERS) + 1):
                held = load(st, BUSY + who) - 1
                if held >= 0 and held >> 20 == gen:
                    call3(load(st, at + FN), st.ctypes.data + 8 * at, 0, held & _FIELD)
                    store(st, REDONE, load(st, REDONE) + 1)
            break
    st[WAITED] += cycles() - began


@inner
def _job(st, at, fn, a, b, c, x, out, scratch, rows):  # type: ignore[no-untyped-def]
    # write a product's fields (chunks of ``rows`` output rows) in the area from word
    # ``at``; its chunk count
    ca, cb = (a.shape[0] + rows - 1) // rows, (b.shape[0] + rows - 1) // rows
    st[at + FN] = fn
    st[at + A], st[at + NA], st[at + RBA] = a.ctypes.data, a.shape[0], a.shape[1]
    st[at + B], st[at + NB], st[at + RBB] = b.ctypes.data, b.shape[0], b.shape[1]
    st[at + C], st[at + NC], st[at + RBC] = c.ctypes.data, c.shape[0], c.shape[1]
    st[at + K], st[at + N_OUT] = out.shape[0], out.shape[1]
    st[at + X], st[at + N_IN] = x.ctypes.data, x.shape[0] // out.shape[0]
    st[at + OUT] = out.ctypes.data
    st[at + SCRATCH], st[at + STRIDE] = scratch.ctypes.data, scratch.shape[1]
    st[at + CA], st[at + CB], st[at + ROWS] = ca, cb, rows
    return ca + cb + (c.shape[0] + rows - 1) // rows


@entry(nogil=True)
def _post(st, fn, gen, a, b, c, x, out, scratch, rows, patience):  # type: ignore[no-untyped-def]
    # post job ``gen`` in its area (unless a helper still holds a chunk of the job before
    # the last, which used that area: -1) and, when no helper that may claim sleeps, do
    # the caller's share (0); else clear their sleeping flags and return them (the caller
    # sets their events, then calls _work)
    if _area_held(st, gen):
        return -1
    at = _area(gen)
    chunks = _job(st, at, fn, a, b, c, x, out, scratch, rows)
    store(st, at + DONE, 0)
    st[at + POSTED] = cycles()
    threads = load(st, ACTIVE)
    for who in range(threads):  # contiguous ranges, the caller's first
        first, end = who * chunks // threads, (who + 1) * chunks // threads
        store(st, RANGES + 8 * who, (gen << 40) | (end << 20) | first)
    store(st, CLAIM, (gen << 40) | (chunks << 20))
    woken = 0
    for who in range(1, load(st, ACTIVE)):
        if load(st, SLEEPING + who) == 1:
            store(st, SLEEPING + who, 0)
            woken |= 1 << who
    if woken == 0:
        _work(st, patience)
    return woken


@entry(nogil=True)
def _now():  # type: ignore[no-untyped-def]
    return cycles()


@entry(nogil=True)
def _calibrate(st, n):  # type: ignore[no-untyped-def]
    # n iterations of an idle helper's loop body (microseconds to iterations)
    s = 0
    for _ in range(n):
        s += load(st, ACTIVE)
        pause()
    return s


@entry(nogil=True)
def run_alone(fn, a, b, c, x, out):  # type: ignore[no-untyped-def]
    """Run the chunk function at address ``fn`` over the whole product ``out`` = ``x``
    times the stacked parts ``a``, ``b``, ``c`` (as :meth:`.pool.KernelPool.run` posts
    it) in the calling thread, one chunk a part: each part's rows by the one call the
    pool's chunks make for a part of them (``rows`` past the longest part), in words and
    scratch of its own (no helper reads them). The serial products' path: a format mix
    then compiles its chunk function only, not a serial product beside it (each
    re-optimizing the same row loop). ``x`` is the posted activations (float32, or the
    q8 kernels' quantized bytes), ``k = out.shape[0]`` rows of ``n_in``."""
    run_chunks(fn, a, b, c, x, out, max(a.shape[0], b.shape[0], c.shape[0], 1))


@entry(nogil=True)
def run_chunks(fn, a, b, c, x, out, rows):  # type: ignore[no-untyped-def]
    """As :func:`run_alone`, in chunks of ``rows`` rows as the pool cuts the job (a job
    whose chunk function computes one chunk's task, e.g. one expert a chunk of
    :func:`.experts_kernels.experts_chunk`, needs the pool's cuts)."""
    k = out.shape[0]
    if k == 0:
        return
    st = np.empty(WORDS, np.int64)
    # a thread's scratch as the pool's: 7 n_in float32 (the exact kernels' decoded rows
    # from their first 64-byte line, the q8 tiles' 26 n_in bytes)
    scratch = np.empty((1, 7 * (x.shape[0] // k) + 16), np.float32)
    chunks = _job(st, np.int64(0), fn, a, b, c, x, out, scratch, rows)  # int64: one _job
    for ch in range(chunks):
        call3(fn, st.ctypes.data, 0, ch)
