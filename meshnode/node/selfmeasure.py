"""A node measures itself for the model it is asked to prepare (issue 34).

Theory of operation. Once a ``Prepare``'s part is materialized, the node times one of the
layers it prepared, on its own backend, threads and that layer's formats, at decode with
one and eight rows and at prefill (:func:`meshnode.engine.selftime.time_layer`). It also
reads a bounded slice of the model file it maps (:data:`DISK_PROBE_BYTES`, after asking the
kernel to drop that slice from its page cache) for the disk's read rate, which the planner
counts for weights served past memory. The result, :class:`SelfMeasure`, travels in the
node's ``InventoryReport`` and is cached in a file under the node's cache folder, keyed by
the model, the layer's formats and the machine (host, CPU, core count, backend, threads),
so that a node asked again for the same model answers at once and a changed machine misses.
Beside it, a file keyed by the model and the machine alone (:func:`model_key`, no layer)
names the latest measurement of that model: a host asks for it before its first plan
(``SpeedQuery``) and places a warm mesh by speed at once (:func:`latest`).

Bounded: the timing stops after ``selftime.BUDGET_S`` (fewer repeats) and the read after
:data:`DISK_PROBE_BYTES`; a failure is reported as the reason and the node is planned by
memory (:func:`measure_or_reason`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshnode_packaging.sources import ModelSource
from meshnode_protocol import PeerLink, SpeedQuery, SpeedReport

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.selftime import compute_threads, time_layer

log = logging.getLogger("meshnode.node")

#: Bytes of the model file read for the disk rate: enough to pass a disk's cache and
#: read-ahead (tens of MiB), little enough to take under a second on a slow SSD.
DISK_PROBE_BYTES = 64 << 20
#: Read size of the disk probe.
_CHUNK = 1 << 20
#: Bump when what is measured changes: older cache files then miss.
CACHE_VERSION = 1


@dataclass(frozen=True, slots=True)
class SelfMeasure:
    """What a node measured of itself for one model, in seconds per layer per token."""

    decode_s: float  # one row: a token's time through one layer
    batch_s: float  # BATCH_ROWS rows in one pass, per row
    prefill_s: float  # PREFILL_ROWS rows in one pass, per row
    layer_bytes: int  # weight bytes of the layer timed
    disk_bytes_per_s: float  # the model file's read rate (0: not measured)


def _machine(backend: Backend) -> dict[str, Any]:
    return {
        "host": platform.node(),
        "arch": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "backend": backend.describe(),
        "threads": compute_threads(),
        "version": CACHE_VERSION,
    }


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def cache_key(config: ModelConfig, model_id: str, layer: int, backend: Backend) -> str:
    """The cache file's name for timing ``layer`` of ``model_id`` on this machine: every
    input that changes the figures is in it (module docstring)."""
    shape = [config.hidden_size, config.intermediate_size, config.num_layers]
    return _digest({**_machine(backend), "model": model_id, "layer": layer, "shape": shape})


def model_key(model_id: str, backend: Backend) -> str:
    """The name of the file that names the latest measurement of ``model_id`` (a reference
    and its pin) on this machine, whatever layer it timed: what a ``SpeedQuery`` reads."""
    return "model-" + _digest({**_machine(backend), "model": model_id})


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "")


def cached(folder: Path | None, key: str) -> SelfMeasure | None:
    """The measurement cached under ``key`` in ``folder``, if a readable one is there."""
    if folder is None:
        return None
    try:
        body = json.loads((folder / f"{key}.json").read_text())
        return SelfMeasure(**{k: body[k] for k in SelfMeasure.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(folder: Path | None, key: str, measure: SelfMeasure) -> None:
    """Write ``measure`` under ``key`` (atomically: a reader never sees half a file)."""
    _write(folder, key, asdict(measure))


def _write(folder: Path | None, key: str, body: dict[str, Any]) -> None:
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temp = folder / f".{key}.{os.getpid()}.tmp"
        temp.write_text(json.dumps(body))
        temp.replace(folder / f"{key}.json")
    except OSError as exc:  # a read-only cache only costs a measurement next time
        log.info("self-measurement not cached: %s", exc)


def measure(config: ModelConfig, source: ModelSource, layer: int, backend: Backend) -> SelfMeasure:
    """Time ``layer`` of ``source`` on ``backend`` and read the model file (module
    docstring). Blocking: call it off the event loop. Raises what loading the layer raises."""
    timing = time_layer(config, source, layer, backend)
    path = getattr(source, "path", None)
    disk = disk_read_rate(Path(path)) if isinstance(path, str | Path) else 0.0
    return SelfMeasure(timing.decode_s, timing.batch_s, timing.prefill_s, timing.layer_bytes, disk)


def disk_read_rate(path: Path, n_bytes: int = DISK_PROBE_BYTES) -> float:
    """Bytes a second read from the middle of ``path`` (a file; a folder: its largest
    file), at most ``n_bytes``, after dropping them from the page cache; 0.0 when the file
    is too small to tell (under 4 MiB) or cannot be read."""
    try:
        if path.is_dir():
            path = max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        size = path.stat().st_size
        span = min(n_bytes, size // 2)
        if span < 4 * _CHUNK:
            return 0.0
        offset = (size - span) // 2 // _CHUNK * _CHUNK
        with path.open("rb", buffering=0) as f:
            fd = f.fileno()
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, span, os.POSIX_FADV_DONTNEED)
            buffer = bytearray(_CHUNK)
            began = time.perf_counter()
            done = 0
            while done < span:
                got = os.preadv(fd, [buffer], offset + done)
                if got <= 0:
                    break
                done += got
            seconds = time.perf_counter() - began
    except (OSError, ValueError):
        return 0.0
    return done / seconds if seconds > 0 else 0.0


def remember_latest(
    folder: Path | None, key: str, measure: SelfMeasure, layer: int, source: ModelSource
) -> None:
    """Name ``measure`` (of ``layer``) as the latest of its model under ``key``
    (:func:`model_key`), with the model file's path and identity when it has one, so that a
    file replaced at the same path is not answered for."""
    path = getattr(source, "path", None)
    where = str(path) if isinstance(path, str | Path) else ""
    body = {**asdict(measure), "layer": layer, "path": where, "file": _file_identity(source)}
    _write(folder, key, body)


def latest(
    cache_dir: Path | None, model_id: str, backend: Backend
) -> tuple[SelfMeasure, int] | None:
    """The latest measurement of ``model_id`` on this machine and the layer it timed, from
    the cache under ``cache_dir``/calibration; None when there is none, it cannot be read,
    or the model file it was measured on changed. Reads one small file: no model is opened,
    nothing is downloaded (a ``SpeedQuery`` is answered at once)."""
    if cache_dir is None:
        return None
    try:
        name = f"{model_key(model_id, backend)}.json"
        body = json.loads((cache_dir / "calibration" / name).read_text())
        found = SelfMeasure(**{k: body[k] for k in SelfMeasure.__dataclass_fields__})
        layer, path, identity = int(body["layer"]), str(body["path"]), str(body["file"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if path and _identity_of(Path(path)) != identity:
        return None  # the file was replaced (or removed) since
    return found, layer


def measure_or_reason(
    source: ModelSource,
    layer: int,
    backend: Backend,
    *,
    model_id: str,
    cache_dir: Path | None,
) -> SelfMeasure | str:
    """The node's measurement for ``layer`` of ``model_id`` (from the cache under
    ``cache_dir``/calibration when there, else measured and cached), or why it failed.
    Blocking: call it off the event loop."""
    folder = None if cache_dir is None else cache_dir / "calibration"
    try:
        config = ModelConfig.from_hf(source.config)
        key = cache_key(config, f"{model_id} {_file_identity(source)}", layer, backend)
        result = cached(folder, key)
        if result is None:
            result = measure(config, source, layer, backend)
            store(folder, key, result)
    except Exception as exc:  # any failure: the node is planned by memory, with the reason
        log.warning("self-measurement failed: %s: %s", type(exc).__name__, exc)
        return f"{type(exc).__name__}: {exc}"[:200]
    remember_latest(folder, model_key(model_id, backend), result, layer, source)
    return result


def _file_identity(source: ModelSource) -> str:
    """The model file's size and modification time: a file replaced at the same path (a
    local model) misses the cache."""
    path = getattr(source, "path", None)
    return _identity_of(Path(path)) if isinstance(path, str | Path) else ""


def _identity_of(path: Path) -> str:
    try:
        stat = path.stat()
    except OSError:
        return ""
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def report_fields(measured: SelfMeasure | str | None) -> dict[str, Any]:
    """``measured`` as the fields of an ``InventoryReport`` (none while not yet measured)."""
    if measured is None:
        return {}
    if isinstance(measured, str):
        return {"measure_error": measured}
    return {
        "decode_us": measured.decode_s * 1e6,
        "batch_us": measured.batch_s * 1e6,
        "prefill_us": measured.prefill_s * 1e6,
        "layer_bytes": measured.layer_bytes,
        "disk_bytes_per_s": measured.disk_bytes_per_s,
    }


def speed_report(
    query: SpeedQuery,
    node_id: str,
    backend: Backend,
    cache_dir: Path | None,
    links: tuple[PeerLink, ...] = (),
    measuring: bool = False,
    known: tuple[SelfMeasure, int] | None = None,
) -> SpeedReport:
    """The answer to ``query``: this node's latest measurement of the model it names, as
    :func:`measure_or_reason` keeps it (the worker's model id: reference ``@`` pin), else
    ``known`` (one it keeps in memory, and its layer), or an empty report (``decode_us``
    0) when there is none, saying whether the node is ``measuring`` itself; either with
    this node's measured ``links`` to its peers. Blocking (one small file read)."""
    found = latest(cache_dir, f"{query.package_ref}@{query.pin}", backend) or known
    if found is None:
        return SpeedReport(
            node_id=node_id, nonce=query.nonce, package_ref=query.package_ref, links=links,
            measuring=measuring,
        )  # fmt: skip
    measured, layer = found
    return SpeedReport(
        node_id=node_id,
        nonce=query.nonce,
        package_ref=query.package_ref,
        layer=layer,
        decode_us=measured.decode_s * 1e6,
        batch_us=measured.batch_s * 1e6,
        prefill_us=measured.prefill_s * 1e6,
        layer_bytes=measured.layer_bytes,
        disk_bytes_per_s=measured.disk_bytes_per_s,
        links=links,
    )
