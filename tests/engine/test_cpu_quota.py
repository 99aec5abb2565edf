"""A cgroup CPU quota caps the cores the kernel pool counts as its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshnode.engine.cpu.gauge import QUOTA_SECONDS
from meshnode.engine.cpu.pool import SAMPLE_SECONDS, CoreGauge, KernelPool
from meshnode.engine.cpu.quota import cpu_quota_cores


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v1(tmp_path: Path, groups: dict[str, tuple[int, int]], own: str) -> tuple[Path, Path]:
    root = tmp_path / "sys"
    for group, (quota, period) in groups.items():
        folder = root / "cpu,cpuacct" / group.lstrip("/")
        _write(folder / "cpu.cfs_quota_us", f"{quota}\n")
        _write(folder / "cpu.cfs_period_us", f"{period}\n")
    (root / "memory").mkdir()
    proc = tmp_path / "cgroup"
    proc.write_text(f"4:memory:/elsewhere\n3:cpu,cpuacct:{own}\n2:cpuset:/\n")
    return proc, root


def test_v1_quota_over_period_of_the_process_group(tmp_path: Path) -> None:
    proc, root = _v1(tmp_path, {"/": (-1, 100000), "/node": (1000, 3333)}, "/node")
    assert cpu_quota_cores(proc, root) == pytest.approx(0.3, abs=1e-3)


def test_v1_a_parent_quota_limits_its_children(tmp_path: Path) -> None:
    groups = {"/": (-1, 100000), "/box": (150000, 100000), "/box/node": (400000, 100000)}
    proc, root = _v1(tmp_path, groups, "/box/node")
    assert cpu_quota_cores(proc, root) == pytest.approx(1.5)


def test_v1_no_quota_anywhere(tmp_path: Path) -> None:
    proc, root = _v1(tmp_path, {"/": (-1, 100000), "/node": (-1, 100000)}, "/node")
    assert cpu_quota_cores(proc, root) is None


def test_v1_a_path_missing_under_the_mount_reads_the_groups_that_exist(tmp_path: Path) -> None:
    # in a cgroup namespace the mount is already the process's group
    proc, root = _v1(tmp_path, {"/": (50000, 100000)}, "/docker/abc")
    assert cpu_quota_cores(proc, root) == pytest.approx(0.5)


def test_v2_cpu_max(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "user.slice" / "cpu.max", "max 100000\n")
    _write(root / "user.slice" / "app" / "cpu.max", "250000 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/app\n")
    assert cpu_quota_cores(proc, root) == pytest.approx(2.5)
    (root / "user.slice" / "app" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota_cores(proc, root) is None


@pytest.mark.parametrize("text", ["", "garbage\n", "0::/\n", "3:cpu:/x\n"])
def test_nothing_readable_is_no_quota(tmp_path: Path, text: str) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text(text)
    assert cpu_quota_cores(proc, tmp_path / "absent") is None
    assert cpu_quota_cores(tmp_path / "no-proc", tmp_path) is None


def test_the_gauge_counts_at_most_the_quota_and_follows_it(tmp_path: Path) -> None:
    quota: list[float | None] = [0.3]
    now = [0.0]
    stat = tmp_path / "no-stat"  # no /proc/stat: every core counts as free
    gauge = CoreGauge(stat, cpus={0, 1, 2, 3}, clock=lambda: now[0], quota=lambda: quota[0])
    assert gauge.free() == pytest.approx(0.3)
    pool = KernelPool(gauge)
    ran = pool.run(0, (None, None, None), None, None, threads=4)  # declines before posting
    assert ran is False
    quota[0] = 2.0
    now[0] += SAMPLE_SECONDS  # the next sample: the quota as read QUOTA_SECONDS ago
    assert gauge.free() == pytest.approx(0.3)
    now[0] += QUOTA_SECONDS  # read again at the first sample after QUOTA_SECONDS
    assert gauge.free() == pytest.approx(2.0)
    quota[0] = None
    gauge_free = CoreGauge(stat, cpus={0, 1, 2, 3}, quota=lambda: quota[0])
    assert gauge_free.free() == 4.0


def _cpu_cgroup_writable() -> Path | None:
    root = Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0 or not (root / "cpu.cfs_quota_us").exists():
        return None
    return root


def test_a_process_in_a_real_quota_group_reads_it(tmp_path: Path) -> None:
    root = _cpu_cgroup_writable()
    if root is None:
        pytest.skip("needs root and a cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu")
    group = root / f"meshnode-test-quota-{os.getpid()}"
    group.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; sys.stdin.readline()\n"
         "from meshnode.engine.cpu.quota import cpu_quota_cores; print(cpu_quota_cores())"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        (group / "cpu.cfs_period_us").write_text("10000")
        (group / "cpu.cfs_quota_us").write_text("3000")
        (group / "cgroup.procs").write_text(str(child.pid))
        out, _ = child.communicate("go\n", timeout=60)
        assert float(out) == pytest.approx(0.3)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        for pid in (group / "cgroup.procs").read_text().split():
            (root / "cgroup.procs").write_text(pid)
        group.rmdir()
