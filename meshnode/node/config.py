"""The node's configuration: one frozen, strict object built in layers.

Layers, later wins: built-in defaults → TOML file (``--config``) → ``MESHNODE_*`` environment
variables → command-line flags the user actually passed (``None`` means "not passed", the
hypercorn sentinel idea). Unknown keys and wrong types are errors, never ignored: a typo in
a config file should stop the node, not silently run it with a default.

Every setting is declared once in :data:`~meshnode.node.settings.SETTINGS` (TOML section
and key, environment variable, parser from :mod:`meshnode.node.parsers`, command-line option
and help). To add one: add a field to :class:`NodeConfig` and a row to ``SETTINGS``.

Speculative decoding is configured per model, so its TOML tables are nested rather than
flat settings: ``[defaults.speculative]`` and ``[models."<model id>".speculative]`` are
checked key by key (``meshnode.speculative.settings.check_table``) and kept as the document
``resolve_speculative`` reads; the ``--speculative …`` flags travel as one
:class:`~meshnode.speculative.settings.SpeculativeFlags`. Both are resolved against the package's
block only when the model is opened (``meshnode.serve.speculation``).

When no ``--config`` is given, ``<state dir>/config.toml`` is read if it exists
(:func:`config_file_for`).

Errors: :class:`ConfigError` (a ``ValueError``) names the offending source and key.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshnode.engine.backend import WeightsDtype
from meshnode.errors import ConfigError
from meshnode.net.address import Address
from meshnode.net.http_guard import DEFAULT_MAX_BODY_BYTES
from meshnode.net.secret_files import check_private, warn_if_exposed
from meshnode.node.parsers import Device, parse_path
from meshnode.node.settings import BY_NAME, SETTINGS, Setting
from meshnode.speculative.settings import SpeculativeConfigError, SpeculativeFlags, check_table

__all__ = [
    "Address",
    "ConfigError",
    "HeartbeatTimeouts",
    "NodeConfig",
    "SpeculativeFlags",
    "config_file_for",
    "load_config",
]

DEFAULT_LISTEN_PORT = 7470
DEFAULT_API_PORT = 8470
#: The config file read from the state dir when ``--config`` is not given.
DEFAULT_CONFIG_NAME = "config.toml"
OWN_TOKEN_FILE = "mesh-token"


#: How long a stage's node must stay suspect, while its pipeline's passes also stall, before
#: the host drops the stage (``HeartbeatTimeouts.suspect_grace_s``). Two heartbeat intervals
#: at the defaults: beside two busy loops a starved node came back from suspect within
#: 100 ms (issue 35), and a laptop busy compiling stalls its event loop for a second or
#: two; a stage whose heartbeats stop mid-request is still dropped after 5 s of silence,
#: half the dead timeout.
DEFAULT_SUSPECT_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class HeartbeatTimeouts:
    """How often peers ping each other and how long silence may last.

    A peer is *suspect* after ``suspect_after_s`` without any frame from it and *dead*
    after ``dead_after_s``. The defaults tolerate two lost heartbeats on a busy LAN. A
    stage is dropped when its node is dead, or once it has been suspect for
    ``suspect_grace_s`` while its pipeline's passes stalled for as long
    (:func:`meshnode.node.membership.suspect_lost_at`); a grace that reaches past
    ``dead_after_s`` leaves only the dead timeout.
    """

    interval_s: float = 1.0
    suspect_after_s: float = 3.0
    dead_after_s: float = 10.0
    suspect_grace_s: float = DEFAULT_SUSPECT_GRACE_S

    def __post_init__(self) -> None:
        if not 0 < self.interval_s < self.suspect_after_s < self.dead_after_s:
            raise ConfigError(
                "heartbeat timeouts need 0 < interval_s < suspect_after_s < dead_after_s, got "
                f"{self.interval_s}, {self.suspect_after_s}, {self.dead_after_s}"
            )
        if not self.suspect_grace_s >= 0:
            raise ConfigError(f"heartbeat suspect_grace_s must be >= 0, got {self.suspect_grace_s}")


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/meshnode``, falling back to ``~/.local/state/meshnode``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "meshnode"


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything ``meshnode join`` needs; see ``deploy/meshnode.example.toml``."""

    token: str | None = field(default=None, repr=False)  # secret: never logged
    token_file: Path | None = None
    state_dir: Path = field(default_factory=default_state_dir)
    listen: Address = Address("0.0.0.0", DEFAULT_LISTEN_PORT)
    api: Address = Address("127.0.0.1", DEFAULT_API_PORT)
    # The HTTP API's bearer key (None: no key; then only a loopback bind is allowed unless
    # ``allow_open_api``), and its request body cap (meshnode.net.http_guard).
    api_key: str | None = field(default=None, repr=False)  # secret: never logged
    allow_open_api: bool = False
    api_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    interface: str | None = None
    mdns: bool = True
    peers: tuple[Address, ...] = ()
    max_memory_bytes: int | None = None
    device: Device = "cpu"
    # Weights on a CUDA device: auto (bfloat16 for a model trained in it, else float16),
    # float16, bfloat16, or float32 (the golden-parity mode). On the CPU: auto/q8 (the GGUF
    # blocks as stored, their products with 8-bit activations: fast, not exact), native
    # (the same blocks in float32: exact) or float32 (dequantized at load).
    weights_dtype: WeightsDtype = "auto"
    heartbeat: HeartbeatTimeouts = HeartbeatTimeouts()
    log_level: str = "INFO"
    cache_dir: Path | None = None
    # Whether another node's Prepare may name an http(s) URL (hub refs always work): a URL
    # lets a member make this node fetch from hosts that only it can reach.
    allow_url_models: bool = False
    # Paths on this machine that another node's Prepare may name (besides ``model``): any
    # other path is refused, or a member could open this machine's files as a model.
    local_models: tuple[Path, ...] = ()
    threads: int | None = None  # BLAS threads of this node (None: one per core)
    # Browser origins allowed to call the HTTP API (CORS); none by default, so a web page
    # of another site cannot read this node's API through a visitor's browser.
    cors_origins: tuple[str, ...] = ()
    # The host role (stage 0 and the API): the model to serve and how to place it.
    model: str | None = None
    split: int | None = None
    # When the mesh's memory is short, serve the weights past it from the memory-mapped
    # file (node.planner, Larger than memory); ``--no-disk-offload`` waits for nodes instead.
    disk_offload: bool = True
    # "speed": the plan follows the stages' measured speeds (calibrated before serving);
    # "memory": memory alone, for comparisons and meshes whose speeds wander (node.planner).
    placement: str = "speed"
    context_size: int | None = None
    wire_dtype: str = "f16"
    kv_dtype: str = "auto"  # K/V in the run's CPU caches: f32, f16 (auto: f16 if q8)
    prefill_chunk_tokens: int = 256
    # A pass that does not come back within base + per_token x tokens in flight is a stage
    # failure (meshnode.node.remote.PassDeadline, where the defaults are explained).
    pass_deadline_s: float = 60.0
    pass_deadline_per_token_s: float = 0.25
    # Speculative decoding: the flags actually passed, and the TOML document holding the
    # checked ``defaults.speculative`` / ``models."<id>".speculative`` tables.
    speculative: SpeculativeFlags = field(default_factory=SpeculativeFlags)
    speculative_tables: Mapping[str, Any] = field(default_factory=dict)

    @property
    def own_token_file(self) -> Path:
        """Where a node that was given no token keeps the token of the mesh it created."""
        return self.state_dir / OWN_TOKEN_FILE

    def resolve_token(self) -> str | None:
        """The join token from ``token``, ``token_file`` or the state dir's own token file.

        None when there is none at all (the daemon then creates a new mesh). Raises
        :class:`ConfigError` when a named token file cannot be read.
        """
        if self.token:
            return self.token
        path = self.token_file
        if path is None and self.own_token_file.is_file():
            path = self.own_token_file
        if path is None:
            return None
        try:
            if path == self.own_token_file:
                check_private(path, fix=True)  # ours: tightened, or refused if not ours
            else:
                warn_if_exposed(path)  # the user's (maybe a read-only mount): warned
            return path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read token file {path}: {exc}") from exc


def _from_toml(doc: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Flatten a TOML document into ``{setting name: parsed value}``, rejecting unknowns."""
    known = {(s.section, s.key): s for s in SETTINGS}
    out: dict[str, Any] = {}
    speculative = _speculative_tables(doc, source)
    if speculative:
        out["speculative_tables"] = speculative
    for section, table in doc.items():
        if section in _SPECULATIVE_SECTIONS:
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: top-level key {section!r} must be a [table]")
        for key, raw in table.items():
            setting = known.get((section, key))
            if setting is None:
                raise ConfigError(f"{source}: unknown setting [{section}] {key}")
            out[setting.name] = _parse(setting, raw, f"{source}: [{section}] {key}")
    return out


# Top-level TOML tables that hold per-model speculative settings, not flat settings.
_SPECULATIVE_SECTIONS = ("defaults", "models")


def _speculative_tables(doc: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The checked ``[defaults.speculative]`` and ``[models."<id>".speculative]`` tables."""
    out: dict[str, Any] = {}
    defaults = doc.get("defaults")
    if defaults is not None:
        out["defaults"] = {"speculative": _speculative_table(defaults, "defaults", source)}
    models = doc.get("models")
    if models is not None:
        if not isinstance(models, dict):
            raise ConfigError(f"{source}: [models] must be a table of model ids")
        out["models"] = {
            model_id: {"speculative": _speculative_table(table, f'models."{model_id}"', source)}
            for model_id, table in models.items()
        }
    return out


def _speculative_table(table: object, where: str, source: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{where}] must be a table")
    unknown = sorted(set(table) - {"speculative"})
    if unknown:
        raise ConfigError(f"{source}: unknown setting [{where}] {unknown[0]}")
    inner = table.get("speculative", {})
    if not isinstance(inner, dict):
        raise ConfigError(f"{source}: [{where}.speculative] must be a table")
    try:
        return check_table(inner, f"{source}: [{where}.speculative]")
    except SpeculativeConfigError as exc:
        raise ConfigError(str(exc)) from exc


def _check_flags(flags: SpeculativeFlags) -> SpeculativeFlags:
    try:
        check_table(flags.table(), "command line")
    except SpeculativeConfigError as exc:
        raise ConfigError(str(exc)) from exc
    if flags.no_draft and flags.strategy == "draft":
        raise ConfigError("--speculative draft contradicts --no-draft")
    return flags


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    return {s.name: _parse(s, env[s.env], s.env) for s in SETTINGS if s.env in env}


def _parse(setting: Setting, raw: object, where: str) -> Any:
    try:
        return setting.parse(raw)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _build(values: Mapping[str, Any]) -> NodeConfig:
    heartbeat = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("heartbeat.")}
    flat = {k: v for k, v in values.items() if not k.startswith("heartbeat.")}
    config = NodeConfig(**flat)
    if heartbeat:
        config = replace(config, heartbeat=replace(config.heartbeat, **heartbeat))
    return config


def load_config(
    *,
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Build the config: defaults → ``config_file`` → ``env`` → ``flags`` (non-None only).

    ``flags`` maps setting names (``"listen"``, ``"heartbeat.interval_s"``, …) to the
    values given on the command line (text, numbers, or values already of the field's
    type), or to ``None`` for a flag that was not passed. Flags go through the same parsers
    as the file and the environment, so ``--split 0`` fails as ``split = 0`` does; the
    speculative flags travel as one ``"speculative"``: :class:`SpeculativeFlags`.
    ``env`` defaults to ``os.environ``, read here rather than at import time.
    Raises :class:`ConfigError`.
    """
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            doc = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
        values |= _from_toml(doc, str(config_file))
    values |= _from_env(os.environ if env is None else env)
    for name, value in (flags or {}).items():
        if name == "speculative" and value is not None:
            values[name] = _check_flags(value)
        elif name not in BY_NAME:
            raise ConfigError(f"unknown setting {name!r}")
        elif value is not None:
            setting = BY_NAME[name]
            values[name] = _parse(setting, value, setting.option)
    return _build(values)


def config_file_for(
    explicit: Path | None, state_dir: Path | None, env: Mapping[str, str] | None = None
) -> Path | None:
    """The config file to read: ``explicit``, else ``<state dir>/config.toml`` if it exists.

    The state dir is the flag's, else ``MESHNODE_STATE_DIR``, else the default one (the
    file cannot choose the directory it is found in).
    """
    if explicit is not None:
        return explicit
    env = os.environ if env is None else env
    if state_dir is None:
        state_dir = parse_path(env["MESHNODE_STATE_DIR"]) if "MESHNODE_STATE_DIR" in env else None
    candidate = (state_dir or default_state_dir()) / DEFAULT_CONFIG_NAME
    return candidate if candidate.is_file() else None
