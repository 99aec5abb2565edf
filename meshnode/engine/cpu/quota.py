"""The CPU time a cgroup quota leaves this process, in cores.

A container started with ``docker run --cpus=1.5``, a systemd unit with ``CPUQuota=``, or
a Kubernetes CPU limit runs on all of the machine's cores (``sched_getaffinity`` lists
them all) but gets only ``quota / period`` seconds of CPU a second, summed over its
threads; past that the kernel stops every thread of the group until the next period.
Kernel threads that outnumber the quota then spend it spinning and waiting on each other:
a node limited to 30 % of a core with two kernel threads got through its layers at about
0.6× the rate of its 100 % neighbours in the placement lab, the second thread's spins
and the product's split eating the share the first one needed. So the kernel pool's
gauge (:class:`meshnode.engine.cpu.gauge.CoreGauge`) counts at most this many cores as
the process's, as Go's ``automaxprocs`` and the JVM's container support do.

Read from ``/proc/self/cgroup`` and the cgroup filesystem: cgroup v2's ``cpu.max``
(``"max 100000"`` or ``"30000 100000"``), cgroup v1's ``cpu.cfs_quota_us`` (``-1``: none)
over ``cpu.cfs_period_us``, of the process's group and every group above it (a parent's
quota limits its children too); the smallest wins. Anything missing or unreadable counts
as no quota: the gauge then behaves as it did without this module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePosixPath

__all__ = ["cpu_quota_cores"]

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota_cores(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The cores' worth of CPU time the process's cgroups allow (module docstring); None
    when no quota applies or none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "" and (root / "cgroup.controllers").exists():  # v2, unified
            found += _quotas(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):  # v1: the hierarchy the cpu controller is in
            mount = _v1_mount(root)
            if mount is not None:
                found += _quotas(mount, path, _v1_quota)
    return min(found) if found else None


def _quotas(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas (cores) set on ``path`` and each group above it under ``mount``. In a
    cgroup namespace the process's own path may not exist under the mount (the mount is
    already its group): only the groups that exist are read."""
    found = []
    group = PurePosixPath(path if path.startswith("/") else "/" + path)
    while True:
        folder = mount / str(group).lstrip("/")
        if folder.is_dir():
            cores = read(folder)
            if cores is not None:
                found.append(cores)
        if group == group.parent:
            return found
        group = group.parent


def _v2_quota(folder: Path) -> float | None:
    """cgroup v2: ``cpu.max`` holds "QUOTA PERIOD" or "max PERIOD"."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _cores(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    """cgroup v1: ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _cores(quota, period)


def _cores(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def _v1_mount(root: Path) -> Path | None:
    """Where the v1 hierarchy holding the ``cpu`` controller is mounted: ``cpu``,
    ``cpu,cpuacct`` or ``cpuacct,cpu`` under ``root``."""
    try:
        for entry in sorted(root.iterdir()):
            if "cpu" in entry.name.split(",") and (entry / "cpu.cfs_quota_us").exists():
                return entry
    except OSError:
        return None
    return None
