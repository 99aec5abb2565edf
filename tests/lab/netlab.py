"""A network lab: each node in its own network namespace, all on one bridge (DESIGN §8).

Theory of operation. :class:`NetLab` makes a *bridge namespace* holding a Linux bridge, and
for every host a namespace whose ``eth0`` is one end of a veth pair; the other end is a
port of the bridge. Hosts get addresses in ``10.213.0.0/24``, a private subnet that exists
only on these veths: nothing is routed to or from the root namespace, so the lab's traffic
(mDNS multicast included) never leaves the namespaces it creates. Multicast snooping is off
on the bridge, so mDNS floods to every port as on a plain switch.

Faults are link operations on the bridge side of a host's veth: ``partition`` sets it down
(the host's own interface stays up, as when a cable is pulled at the switch), ``heal`` sets
it up again, ``rate_limit`` shapes both directions with a token bucket (``tc tbf``; this
kernel has no ``netem``, so latency cannot be injected, nor ``prio``). ``shape_pair``
shapes the link between two hosts alone, both ways: on one host's veth, an ``htb`` root
whose default class passes everything unshaped and a second class with the token bucket
under it, which a ``u32`` filter on the other host's address selects.

The test process reaches a host through :meth:`LabHost.get` and :meth:`LabHost.post`: the
HTTP call runs in a thread that entered the host's namespace (``setns``), so a node's API
listens on that namespace's loopback and no address is added to the root namespace.

Names carry a per-run tag (``mn<pid>x<n>``), and :meth:`NetLab.close` deletes every
namespace it made (which deletes their interfaces too), also after a failure. A test run
killed before its finalizers ran leaves its namespaces behind; the next lab deletes those
whose process is gone (:func:`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

SUBNET = "10.213.0"  # private test subnet, only on veths inside the lab's namespaces
FIRST_HOST = 10  # hosts get .10, .11, ...
CLONE_NEWNET = 0x40000000  # <sched.h>; os.setns arrives in Python 3.12
IP_TIMEOUT_S = 10.0  # one `ip`/`tc` command; they take milliseconds
HTTP_THREADS = 12  # concurrent requests into one namespace (eight streams plus polls)
# htb's classes of a pair filter: faster than the lab's traffic ever is (Python framing
# moves tens of MB/s, 1.25 GB/s is 10 Gbit/s), with a burst of 1 MB (htb's own, from the
# rate, shows 0 past ~30 Gbit/s); the quantum (bytes a class sends a round) set, as rate /
# r2q would pass htb's 200,000 limit and warn; it matters only between two busy classes.
HTB_UNSHAPED = ("rate", "10gbit", "burst", "1mb", "cburst", "1mb", "quantum", "60000")
_runs = itertools.count()
_TAG = re.compile(r"^mn(\d+)x\d+-")  # NetLab's namespace names: mn<pid % 100000>x<n>-<host>


class LabUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, or the kernel refused)."""


def ip(*args: str) -> str:
    """Run ``ip ARGS`` (or ``tc`` when the first argument is ``tc``); its stdout."""
    command = list(args) if args[0] == "tc" else ["ip", *args]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why the lab cannot run here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, veths, a bridge)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the network lab needs iproute2 (`ip` and `tc`)"
    probe = f"mnprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
        ip("netns", "del", probe)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    return None


def sweep_stale() -> list[str]:
    """Delete lab namespaces whose test process is gone (it was killed before cleaning
    up), with any process still running in them; the names deleted."""
    running = {pid % 100000 for pid in map(int, filter(str.isdigit, os.listdir("/proc")))}
    stale = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _TAG.match(name)
        if match is None or int(match.group(1)) in running:
            continue
        for pid in ip("netns", "pids", name).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)  # a node of the dead run: nothing else lives in there
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", name)
        stale.append(name)
    return stale


def _enter_netns(name: str) -> None:
    """Move the calling thread into namespace ``name`` (sockets it opens live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


@dataclass
class LabHost:
    """One namespace on the bridge: its name, address and bridge-side port."""

    name: str
    netns: str
    address: str
    port: str  # the veth end on the bridge
    _threads: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._threads = ThreadPoolExecutor(
            HTTP_THREADS, thread_name_prefix=self.netns, initializer=_enter_netns,
            initargs=(self.netns,),
        )  # fmt: skip

    def get(self, url: str, timeout: float = 5.0) -> httpx.Response:
        """``GET url`` from inside this namespace."""
        return self._threads.submit(httpx.get, url, timeout=timeout).result()

    def post(self, url: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
        """``POST url`` with a JSON body, from inside this namespace."""
        return self._threads.submit(httpx.post, url, json=body, timeout=timeout).result()

    def run(self, work: Callable[[], T]) -> T:
        """``work()`` in a thread inside this namespace (its sockets live there)."""
        return self._threads.submit(work).result()

    def command(self, *args: str) -> list[str]:
        """``args`` run inside this namespace."""
        return ["ip", "netns", "exec", self.netns, *args]

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)


class NetLab:
    """Namespaces on one bridge; see the module docstring. Close it (or use ``with``)."""

    def __init__(self) -> None:
        sweep_stale()
        self.tag = f"mn{os.getpid() % 100000}x{next(_runs)}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts: dict[str, LabHost] = {}
        self._namespaces: list[str] = []
        self._add_namespace(self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        ip("-n", self.bridge_ns, "link", "set", "br0", "up")

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> LabHost:
        """A new namespace with ``eth0`` on the bridge and the next lab address."""
        index = len(self.hosts)
        netns = f"{self.tag}-{name}"
        port = f"{self.tag}p{index}"[-15:]  # interface names have at most 15 characters
        self._add_namespace(netns)
        ip("-n", self.bridge_ns, "link", "add", port, "type", "veth",
           "peer", "name", "eth0", "netns", netns)  # fmt: skip
        ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        address = f"{SUBNET}.{FIRST_HOST + index}"
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "multicast", "on", "up")
        host = LabHost(name, netns, address, port)
        self.hosts[name] = host
        return host

    def partition(self, host: LabHost) -> None:
        """Cut ``host`` off the bridge (its own link stays up)."""
        ip("-n", self.bridge_ns, "link", "set", host.port, "down")

    def heal(self, host: LabHost) -> None:
        """Put ``host`` back on the bridge."""
        ip("-n", self.bridge_ns, "link", "set", host.port, "up")

    def rate_limit(self, host: LabHost, rate: str, *, burst: str, latency: str) -> None:
        """Shape ``host``'s traffic both ways with a token bucket (``tc qdisc … tbf``)."""
        shape = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        ip("tc", "-n", host.netns, "qdisc", "replace", "dev", "eth0", *shape)
        ip("tc", "-n", self.bridge_ns, "qdisc", "replace", "dev", host.port, *shape)

    def shape_pair(
        self, host: LabHost, peer: LabHost, rate: str, *, burst: str, latency: str
    ) -> None:
        """Shape only the traffic between ``host`` and ``peer``, both ways, with a token
        bucket, on ``host``'s veth (module docstring): its ``eth0`` shapes what goes to
        ``peer``'s address, its bridge port what comes from it. The rest of the two hosts'
        traffic passes unshaped. ``unlimit(host)`` removes it."""
        for netns, device, match in ((host.netns, "eth0", "dst"),
                                     (self.bridge_ns, host.port, "src")):  # fmt: skip
            tc = ("tc", "-n", netns)
            ip(*tc, "qdisc", "replace", "dev", device, "root", "handle", "1:", "htb",
               "default", "1")  # fmt: skip
            for classid in ("1:1", "1:2"):
                ip(*tc, "class", "add", "dev", device, "parent", "1:", "classid", classid,
                   "htb", *HTB_UNSHAPED)  # fmt: skip
            ip(*tc, "qdisc", "add", "dev", device, "parent", "1:2", "tbf", "rate", rate,
               "burst", burst, "latency", latency)  # fmt: skip
            ip(*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio",
               "1", "u32", "match", "ip", match, f"{peer.address}/32", "flowid", "1:2")  # fmt: skip

    def unlimit(self, host: LabHost) -> None:
        """Remove ``rate_limit``'s or ``shape_pair``'s shaping of ``host``."""
        ip("tc", "-n", host.netns, "qdisc", "del", "dev", "eth0", "root")
        ip("tc", "-n", self.bridge_ns, "qdisc", "del", "dev", host.port, "root")

    def close(self) -> None:
        """Delete every namespace of the lab (their interfaces go with them)."""
        for host in self.hosts.values():
            host.close()
        for name in reversed(self._namespaces):
            # One already gone must not keep the others from being deleted.
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                ip("netns", "del", name)
        self._namespaces.clear()

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
