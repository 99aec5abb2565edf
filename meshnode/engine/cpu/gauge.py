"""How many of this process's cores other processes leave it (:class:`CoreGauge`).

The kernel threads (:mod:`.pool`) and the tile threads (:mod:`.tiles`) use no more threads
than this: a helper spinning or computing on a core other processes want slows them and
the thread it helps. Read from ``/proc/stat`` and the cgroup quota (:mod:`.quota`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from meshnode.engine.cpu.quota import cpu_quota_cores

__all__ = ["QUOTA_SECONDS", "SAMPLE_SECONDS", "CoreGauge", "usable_cpus"]

# How often the pool looks at the cores' idle time (/proc/stat counts it in 10 ms ticks),
# and how much each look weighs in the running average it keeps.
SAMPLE_SECONDS = 0.1
SAMPLE_WEIGHT = 0.5
# How often it reads the cgroup quota again (:mod:`.quota`): the files of every group above
# the process's, ~0.2 ms of the caller's CPU a read (cgroup v1 here), which at every sample
# cost a two-thread decode of the Llama-3.2-1B shape (~35 ms a token) ~0.2 % of its time
# between the helpers' chunks. A quota changed while the process runs counts within this.
QUOTA_SECONDS = 2.0


class CoreGauge:
    """How many of this process's cores other processes leave it.

    A helper that spins or computes on a core other threads want takes its time from them
    and, in the same scheduling group, from the thread it helps: on two busy cores, two
    spinning threads made a forward several times slower than one. So the pool uses as
    many threads as the cores it can have: over the last interval, the idle time of the
    cores it may run on (``/proc/stat``, those of ``sched_getaffinity``: a container's
    cpuset) plus this process's own CPU time, as a running average. The time of niced
    processes counts as free when this one is not niced (they yield to it: a nice-19
    build takes ~1.5 % of a core from a nice-0 thread). Without ``/proc`` every core
    counts as free. A cgroup CPU quota caps it (:mod:`.quota`: a container limited to
    1.5 cores has 1.5 however idle the machine's cores are), read again every
    :data:`QUOTA_SECONDS`, so a process moved into a group, or a quota changed, counts
    from the first sample after that.
    """

    def __init__(
        self,
        stat: Path = Path("/proc/stat"),
        cpus: set[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
        quota: Callable[[], float | None] = cpu_quota_cores,
    ) -> None:
        self._stat, self._clock, self._cpu_time = stat, clock, cpu_time
        self._cpus = cpus if cpus is not None else usable_cpus()
        self._quota = quota
        self._most = 0.0  # the cores it may use at most, as last read
        self._quota_read = -math.inf  # when _cores() last read the quota
        self._tick = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self._free = self._cores()
        self._sampled = -math.inf  # when free() last looked
        self._last: tuple[float, float, float] | None = None  # clock, idle s, own CPU s
        # /proc/stat's columns counted as free: idle and iowait, and nice unless we are
        self._columns = (3, 4) if _niced() else (1, 3, 4)

    def free(self) -> float:
        """Cores this process can have now (a running average, 0 .. its cores)."""
        now = self._clock()
        if now - self._sampled < SAMPLE_SECONDS:
            return self._free
        self._sampled = now
        cores = self._cores()
        idle = self._idle_seconds()
        if idle is None:  # without /proc every core it may use counts as free
            self._free = cores
            return self._free
        sample = (now, idle, self._cpu_time())
        if self._last is not None:
            span = now - self._last[0]
            have = (sample[1] - self._last[1] + sample[2] - self._last[2]) / span
            have = min(cores, max(0.0, have))
            self._free += SAMPLE_WEIGHT * (have - self._free)
        self._free = min(self._free, cores)
        self._last = sample
        return self._free

    def _cores(self) -> float:
        """The cores this process may use at most: its CPUs, capped by a cgroup quota (read
        again once :data:`QUOTA_SECONDS` have passed)."""
        now = self._clock()
        if now - self._quota_read >= QUOTA_SECONDS:
            self._quota_read = now
            quota = self._quota()
            cores = float(len(self._cpus))
            self._most = cores if quota is None else max(0.0, min(cores, quota))
        return self._most

    def _idle_seconds(self) -> float | None:
        """Time this process's cores were idle (or ran niced processes) since boot (None:
        no /proc)."""
        try:
            lines = self._stat.read_text().splitlines()
        except OSError:
            return None
        ticks = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self._cpus:
                fields = rest.split()
                ticks += sum(int(fields[i]) for i in self._columns)
        return ticks * self._tick


def _niced() -> bool:
    """Whether this process runs at a lower priority than the default."""
    return hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) > 0


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))
