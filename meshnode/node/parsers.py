"""Parsers of the node's settings: each takes a TOML value, an environment string or a
command-line value and returns the setting's value, or raises :class:`ConfigError` saying
what it expected (the caller adds where the value came from: :mod:`meshnode.node.config`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal, cast

from meshnode.engine.backend import WEIGHTS_DTYPES, WeightsDtype
from meshnode.errors import ConfigError
from meshnode.net.address import Address

Device = Literal["cpu", "cuda"]


def parse_str(v: object) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"expected a string, got {v!r}")
    return v


def parse_path(v: object) -> Path:
    return (v if isinstance(v, Path) else Path(parse_str(v))).expanduser()


def parse_paths(v: object) -> tuple[Path, ...]:
    if isinstance(v, str):  # environment: separated as in PATH
        return tuple(parse_path(p) for p in v.split(os.pathsep) if p.strip())
    if isinstance(v, list | tuple):
        return tuple(parse_path(p) for p in v)
    raise ConfigError(f"expected a list of paths, got {v!r}")


def parse_address(v: object) -> Address:
    return v if isinstance(v, Address) else Address.parse(parse_str(v))


def parse_bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
        return v.lower() in {"1", "true", "yes", "on"}
    raise ConfigError(f"expected a boolean, got {v!r}")


def parse_float(v: object) -> float:
    if isinstance(v, bool):
        raise ConfigError(f"expected a number, got {v!r}")
    if isinstance(v, int | float):
        return float(v)
    try:
        return float(parse_str(v))
    except ValueError as exc:
        raise ConfigError(f"expected a number, got {v!r}") from exc


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(v: object) -> int:
    """Bytes as an integer or a string such as ``8GiB``, ``512M``, ``1000000``."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?)?b?\s*", parse_str(v).lower())
    if m is None:
        raise ConfigError(f"expected a byte count such as 8GiB, got {v!r}")
    return int(m.group(1)) * _UNITS[m.group(2) or ""]


def parse_peers(v: object) -> tuple[Address, ...]:
    if isinstance(v, str):  # environment: comma-separated
        return tuple(Address.parse(p) for p in v.split(",") if p.strip())
    if isinstance(v, list | tuple):
        return tuple(parse_address(p) for p in v)
    raise ConfigError(f"expected a list of HOST:PORT, got {v!r}")


def parse_weights_dtype(v: object) -> WeightsDtype:
    """A weights dtype name; raises ``ConfigError`` naming the choices."""
    s = parse_str(v)
    if s in WEIGHTS_DTYPES:
        return cast(WeightsDtype, s)
    raise ConfigError(f"dtype must be one of {', '.join(WEIGHTS_DTYPES)}, got {s!r}")


def parse_device(v: object) -> Device:
    s = parse_str(v)
    if s == "cpu":
        return "cpu"
    if s == "cuda":
        return "cuda"
    raise ConfigError(f"device must be cpu or cuda, got {s!r}")


def parse_log_level(v: object) -> str:
    s = parse_str(v).upper()
    if s not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ConfigError(f"log level must be DEBUG, INFO, WARNING or ERROR, got {s!r}")
    return s


def parse_positive_int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise ConfigError(f"expected a positive integer, got {v!r}")
    try:
        n = int(v)
    except ValueError as exc:
        raise ConfigError(f"expected a positive integer, got {v!r}") from exc
    if n < 1:
        raise ConfigError(f"expected a positive integer, got {n}")
    return n


def parse_nonempty(v: object) -> str:
    s = parse_str(v)
    if not s.strip():
        raise ConfigError("expected a non-empty string")
    return s


def parse_positive_float(v: object) -> float:
    f = parse_float(v)
    if not 0 < f < float("inf"):
        raise ConfigError(f"expected a positive number, got {v!r}")
    return f


def parse_non_negative_float(v: object) -> float:
    f = parse_float(v)
    if not 0 <= f < float("inf"):
        raise ConfigError(f"expected a number >= 0, got {v!r}")
    return f


def parse_api_key(v: object) -> str:
    # It travels in an HTTP header: visible ASCII only, so it can be typed and sent intact.
    s = parse_str(v)
    if not s or not all("!" <= c <= "~" for c in s):
        raise ConfigError("an API key must be non-empty printable ASCII without spaces")
    return s


def parse_body_bytes(v: object) -> int:
    n = parse_bytes(v)
    if n < 1:
        raise ConfigError(f"expected a positive byte count, got {v!r}")
    return n


def parse_wire_dtype(v: object) -> str:
    s = parse_str(v).lower()
    if s not in {"f16", "f32"}:
        raise ConfigError(f"wire dtype must be f16 or f32, got {s!r}")
    return s


def parse_placement(v: object) -> str:
    s = parse_str(v).lower()
    if s not in {"speed", "memory"}:
        raise ConfigError(f"placement must be speed or memory, got {s!r}")
    return s


def parse_origin(v: object) -> str:
    s = parse_str(v).strip().rstrip("/")
    if s == "*":
        return s
    m = re.fullmatch(r"(https?)://([^/?#\s]+)", s)
    if m is None:
        raise ConfigError(f"expected an origin such as https://app.example:8080 or *, got {v!r}")
    return s


def parse_origins(v: object) -> tuple[str, ...]:
    if isinstance(v, str):  # environment: comma-separated
        return tuple(parse_origin(o) for o in v.split(",") if o.strip())
    if isinstance(v, list | tuple):
        return tuple(parse_origin(o) for o in v)
    raise ConfigError(f"expected a list of origins, got {v!r}")
