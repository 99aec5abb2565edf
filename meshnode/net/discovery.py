"""mDNS discovery: advertise this node and browse for peers of the same mesh.

zeroconf runs its own threads (and an asyncio loop); trio must not block on them. Blocking
calls (start, register, unregister, close) go through ``trio.to_thread``; the browser's
callbacks run in zeroconf's thread, resolve the record there, and hand a small
:class:`Discovered` / :class:`Vanished` value to trio through ``TrioToken.run_sync_soon``
onto a bounded memory channel. If trio falls behind, adverts are dropped: mDNS repeats
them, and a dropped one only delays a dial.

The TXT record carries only what discovery needs, and no secret: protocol version, the
public mesh id (an HKDF output of the token, see :mod:`meshnode.net.identity`) and the node
id (the hash of its public key, which its TLS certificate shows anyone who connects). What
a node runs on and how much memory it has free are for members: they learn them from its
``Hello`` after the mutual TLS handshake (issue 36, item 4).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import socket
from dataclasses import dataclass

import ifaddr  # zeroconf's own dependency for interface enumeration
import trio
from zeroconf import Error as ZeroconfError
from zeroconf import (
    InterfaceChoice,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshnode._tcp.local."
# How long the browser thread waits for a record's SRV/TXT/A answers.
RESOLVE_TIMEOUT_MS = 3000
# Instance names remembered (to map a removal back to its node id). A LAN of meshnode
# nodes has tens; spoofed adverts beyond this are still reported, but not remembered.
MAX_ADVERTS = 256
# Unregistering sends goodbye packets; never let a dead network stall shutdown longer.
SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Advert:
    """What a node says about itself in its TXT record (module docstring)."""

    node_id: str
    mesh_id: str
    protocol_version: int
    port: int

    def properties(self) -> dict[str, str]:
        return {"v": str(self.protocol_version), "mesh": self.mesh_id, "id": self.node_id}


@dataclass(frozen=True, slots=True)
class Discovered:
    """A peer of our mesh is advertising at ``host:port``."""

    node_id: str
    host: str
    port: int
    protocol_version: int


@dataclass(frozen=True, slots=True)
class Vanished:
    """A peer withdrew its record (clean shutdown) or its record expired."""

    node_id: str


DiscoveryEvent = Discovered | Vanished


def _instance_name(node_id: str) -> str:
    return f"{node_id}.{SERVICE_TYPE}"


def advertised_addresses(listen_host: str, interface: str | None) -> list[str]:
    """The addresses for our A records: the listen host if it is one address, else the
    ``--interface`` address, else every non-loopback address (loopback if there is none).
    """
    if listen_host not in {"0.0.0.0", "", "::"}:
        return [listen_host]
    if interface is not None:
        return [interface]
    found = [
        ip.ip
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if ip.is_IPv4 and isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback
    ]
    return found or ["127.0.0.1"]


def _parse_info(info: ServiceInfo, mesh_id: str) -> Discovered | None:
    """A :class:`Discovered` for a record of our mesh, else ``None``."""
    props = {
        k.decode(errors="replace"): (v or b"").decode(errors="replace")
        for k, v in info.properties.items()
    }
    if props.get("mesh") != mesh_id or not info.port:
        return None
    addresses = info.parsed_addresses()
    try:
        version = int(props.get("v", ""))
    except ValueError:
        return None
    if not addresses or "id" not in props:
        return None
    return Discovered(props["id"], addresses[0], info.port, version)


class _Bridge:
    """zeroconf browser callbacks (zeroconf's thread) → trio memory channel."""

    def __init__(
        self,
        own_id: str,
        mesh_id: str,
        send: trio.MemorySendChannel[DiscoveryEvent],
        token: trio.lowlevel.TrioToken,
    ) -> None:
        self._own_id = own_id
        self._mesh_id = mesh_id
        self._send = send
        self._token = token
        # Instance name → node id from its TXT record (a renamed record is not its id).
        self._ids: dict[str, str] = {}

    def on_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        event: DiscoveryEvent | None
        if state_change is ServiceStateChange.Removed:
            node_id = self._ids.pop(name, None)
            event = None if node_id is None else Vanished(node_id)
        else:
            info = zeroconf.get_service_info(service_type, name, timeout=RESOLVE_TIMEOUT_MS)
            event = None if info is None else _parse_info(info, self._mesh_id)
            if event is not None and event.node_id == self._own_id:
                event = None  # our own record (or one claiming our id)
            if event is not None and (name in self._ids or len(self._ids) < MAX_ADVERTS):
                self._ids[name] = event.node_id
        if event is not None:
            self._post(event)

    def _post(self, event: DiscoveryEvent) -> None:
        def deliver() -> None:
            try:
                self._send.send_nowait(event)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                log.debug("discovery: dropped %s", event)

        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(deliver)


async def run_discovery(
    advert: Advert,
    addresses: list[str],
    interface: str | None,
    send: trio.MemorySendChannel[DiscoveryEvent],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Advertise ``advert`` and post peers of its mesh to ``send`` until cancelled.

    Calls ``task_status.started()`` once the record is registered; on cancellation
    unregisters it (peers see it vanish at once) and closes zeroconf.
    """
    interfaces = [interface] if interface is not None else InterfaceChoice.All
    zc = await trio.to_thread.run_sync(lambda: Zeroconf(interfaces=interfaces))
    info = ServiceInfo(
        SERVICE_TYPE,
        _instance_name(advert.node_id),
        addresses=[socket.inet_pton(_family(a), a) for a in addresses],
        port=advert.port,
        properties=advert.properties(),
        server=f"{advert.node_id}.local.",
    )
    bridge = _Bridge(advert.node_id, advert.mesh_id, send, trio.lowlevel.current_trio_token())
    browser: ServiceBrowser | None = None
    registered: ServiceInfo | None = None
    try:
        registered = await _register(zc, info)
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[bridge.on_change])
        task_status.started()
        await trio.sleep_forever()
    finally:
        with trio.move_on_after(SHUTDOWN_TIMEOUT_S) as scope:
            scope.shield = True
            await trio.to_thread.run_sync(
                _shutdown, zc, registered, browser, abandon_on_cancel=True
            )


async def _register(zc: Zeroconf, info: ServiceInfo) -> ServiceInfo | None:
    """Advertise ``info``, renamed if another host holds its name; ``None`` if impossible.

    Anyone on the LAN can answer for our instance name (a stale record of ours, another
    node, or a spoofer): zeroconf's probe then raises ``NonUniqueNameException``, which
    used to stop the node from starting. A renamed record still carries our id in its TXT
    record; if even that fails, the node runs without advertising (peers still find it
    through ``--peer`` and the peer lists of ``Hello``), browsing as before.
    """
    wanted = info.name
    register = functools.partial(zc.register_service, info, allow_name_change=True)
    try:
        await trio.to_thread.run_sync(register)
    except (ZeroconfError, OSError) as exc:
        log.warning("mDNS: cannot advertise %s (%r); peers must use --peer", wanted, exc)
        return None
    if info.name != wanted:
        log.warning(
            "mDNS: another host answers for %s; advertising as %s instead", wanted, info.name
        )
    return info


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _shutdown(zc: Zeroconf, info: ServiceInfo | None, browser: ServiceBrowser | None) -> None:
    if browser is not None:
        browser.cancel()
    if info is not None:
        zc.unregister_service(info)
    zc.close()
