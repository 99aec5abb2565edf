"""A TCP endpoint as the daemon and its tools name it: ``HOST:PORT`` or ``[V6]:PORT``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshnode.errors import ConfigError


@dataclass(frozen=True, slots=True, order=True)
class Address:
    """A TCP endpoint; port 0 asks the OS for a free port (tests)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port out of range: {self.port}")

    @classmethod
    def parse(cls, text: str) -> Address:
        """Parse ``HOST:PORT`` or ``[V6]:PORT``; raises :class:`ConfigError`."""
        m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", text.strip())
        if m is None:
            raise ConfigError(f"expected HOST:PORT, got {text!r}")
        host = m.group(1) or m.group(3)
        return cls(host, int(m.group(2) or m.group(4)))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
