"""The node's settings, each declared once: ``SETTINGS``, one :class:`Setting` per knob.

A row names the :class:`~meshnode.node.config.NodeConfig` field, its TOML section and key,
its environment variable, its parser (:mod:`meshnode.node.parsers`), its command-line
option with its help text and how that option is typed (``cli``). Everything else is
derived from the table: the TOML and environment layers (:mod:`meshnode.node.config`) and
``meshnode join``'s options (:mod:`meshnode.cli.options`). To add a knob: a field of
``NodeConfig`` and a row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from meshnode.engine.kv_cache import parse_kv_dtype
from meshnode.node.parsers import (
    parse_address,
    parse_api_key,
    parse_body_bytes,
    parse_bool,
    parse_bytes,
    parse_device,
    parse_log_level,
    parse_non_negative_float,
    parse_nonempty,
    parse_origins,
    parse_path,
    parse_paths,
    parse_peers,
    parse_placement,
    parse_positive_float,
    parse_positive_int,
    parse_weights_dtype,
    parse_wire_dtype,
)
from meshnode.node.stage import DEFAULT_MAX_CONTEXT

#: ``--dtype``'s help, ``join``'s and ``generate``'s (README "Performance": why q8 is the
#: CPU's default).
DTYPE_HELP = (
    "Weights: auto, float16, bfloat16 or float32 on CUDA. On the CPU: q8 (auto: GGUF "
    "blocks kept as stored, activations quantized to 8 bits in their products, as "
    "llama.cpp does: fast, inexact), native (the same blocks in float32: exact, the golden "
    "references' arithmetic) or float32 (dequantized, for parity checks)."
)
#: ``--kv-dtype``'s help, ``join``'s and ``generate``'s.
KV_DTYPE_HELP = (
    "KV cache of CPU stages: f32, f16 (half the memory and the bytes decode reads; "
    "rounded, inexact) or auto (default: f16 with --dtype q8, the CPU's default, else f32)."
)

#: How a setting's command-line option is typed: a value (text, a whole number, a number or
#: a path), a repeatable value (``list``), or a switch that turns the setting on or off
#: (``on``: ``--allow-open-api``; ``off``: ``--no-mdns``). A switch that is not passed
#: leaves the setting to the lower layers.
CliKind = Literal["str", "int", "float", "path", "list", "on", "off"]


@dataclass(frozen=True, slots=True)
class Setting:
    """One configurable value: where it lives in TOML, the environment and the command
    line, and how to parse it.

    ``name`` is the :class:`NodeConfig` field, or ``heartbeat.<field>`` for the nested
    :class:`HeartbeatTimeouts`; ``flag`` is its command-line option (``--{flag}``), named
    in errors about a flag's value. Every layer goes through the same ``parse``. ``help``
    is the option's help text (its environment variable is added: :meth:`help_text`).
    """

    name: str
    section: str
    key: str
    env: str
    parse: Callable[[object], Any]
    flag: str = ""
    help: str = ""
    cli: CliKind = "str"

    @property
    def option(self) -> str:
        """The command-line option, e.g. ``--max-memory``."""
        return "--" + (self.flag or self.key.replace("_", "-"))

    @property
    def help_text(self) -> str:
        """The option's help, with its environment variable."""
        return env_help(self.name, self.help)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "token",
        "mesh",
        "token",
        "MESHNODE_TOKEN",
        parse_nonempty,
        help="Join token (or use --token-file / MESHNODE_TOKEN).",
    ),
    Setting(
        "token_file",
        "mesh",
        "token_file",
        "MESHNODE_TOKEN_FILE",
        parse_path,
        help="File holding the join token.",
        cli="path",
    ),
    Setting(
        "listen",
        "node",
        "listen",
        "MESHNODE_LISTEN",
        parse_address,
        help="Mesh listen address HOST:PORT (default 0.0.0.0:7470).",
    ),
    Setting(
        "api",
        "node",
        "api",
        "MESHNODE_API",
        parse_address,
        help="HTTP API address HOST:PORT (default 127.0.0.1:8470).",
    ),
    Setting(
        "api_key",
        "node",
        "api_key",
        "MESHNODE_API_KEY",
        parse_api_key,
        help="Require 'Authorization: Bearer KEY' on the HTTP API (needed to bind it to a "
        "non-loopback address).",
    ),
    Setting(
        "allow_open_api",
        "node",
        "allow_open_api",
        "MESHNODE_ALLOW_OPEN_API",
        parse_bool,
        help="Serve the API on a non-loopback address without a key.",
        cli="on",
    ),
    Setting(
        "api_max_body_bytes",
        "node",
        "api_max_body",
        "MESHNODE_API_MAX_BODY",
        parse_body_bytes,
        flag="api-max-body",
        help="Largest HTTP request body (default 2MiB).",
    ),
    Setting(
        "state_dir",
        "node",
        "state_dir",
        "MESHNODE_STATE_DIR",
        parse_path,
        help="Identity, config and caches of this node.",
        cli="path",
    ),
    Setting(
        "interface",
        "discovery",
        "interface",
        "MESHNODE_INTERFACE",
        parse_nonempty,
        help="Limit mDNS to the interface with this address.",
    ),
    Setting(
        "peers",
        "discovery",
        "peers",
        "MESHNODE_PEERS",
        parse_peers,
        flag="peer",
        help="Static peer HOST:PORT (repeatable).",
        cli="list",
    ),
    Setting(
        "allow_url_models",
        "node",
        "allow_url_models",
        "MESHNODE_ALLOW_URL_MODELS",
        parse_bool,
        help="Let other nodes ask this one to fetch a model from an http(s) URL "
        "(hf:// always works).",
        cli="on",
    ),
    Setting(
        "local_models",
        "node",
        "local_models",
        "MESHNODE_LOCAL_MODELS",
        parse_paths,
        flag="local-model",
        help="A model path on this machine that other nodes may ask this one to open "
        "(repeatable; others are refused).",
        cli="list",
    ),
    Setting(
        "cors_origins",
        "node",
        "cors_origins",
        "MESHNODE_CORS_ORIGINS",
        parse_origins,
        flag="cors-origin",
        help="Let web pages of this origin (https://host[:port], or *) call the HTTP API "
        "from a browser (repeatable; default: none).",
        cli="list",
    ),
    Setting(
        "mdns",
        "discovery",
        "mdns",
        "MESHNODE_MDNS",
        parse_bool,
        flag="no-mdns",
        # The variable is the setting's (on/off), so its value to disable is said here.
        help="Disable mDNS discovery (as MESHNODE_MDNS=0 does).",
        cli="off",
    ),
    Setting(
        "max_memory_bytes",
        "node",
        "max_memory",
        "MESHNODE_MAX_MEMORY",
        parse_bytes,
        help="Cap on memory offered to the mesh (e.g. 8GiB).",
    ),
    Setting("device", "node", "device", "MESHNODE_DEVICE", parse_device, help="cpu or cuda."),
    Setting(
        "weights_dtype",
        "node",
        "dtype",
        "MESHNODE_DTYPE",
        parse_weights_dtype,
        flag="dtype",
        help=DTYPE_HELP,
    ),
    Setting(
        "heartbeat.interval_s",
        "heartbeat",
        "interval_s",
        "MESHNODE_HEARTBEAT_S",
        parse_positive_float,
        flag="heartbeat-interval",
        help="Seconds between heartbeats.",
        cli="float",
    ),
    Setting(
        "heartbeat.suspect_after_s",
        "heartbeat",
        "suspect_after_s",
        "MESHNODE_SUSPECT_S",
        parse_positive_float,
        flag="suspect-after",
        help="Seconds of silence before a peer is suspect.",
        cli="float",
    ),
    Setting(
        "heartbeat.dead_after_s",
        "heartbeat",
        "dead_after_s",
        "MESHNODE_DEAD_S",
        parse_positive_float,
        flag="dead-after",
        help="Seconds of silence before a peer is dead.",
        cli="float",
    ),
    Setting(
        "heartbeat.suspect_grace_s",
        "heartbeat",
        "suspect_grace_s",
        "MESHNODE_SUSPECT_GRACE_S",
        parse_non_negative_float,
        flag="suspect-grace",
        help="Seconds a stage's node stays suspect, its passes stalled, before the host "
        "drops the stage (a dead node is dropped at once).",
        cli="float",
    ),
    Setting(
        "log_level",
        "node",
        "log_level",
        "MESHNODE_LOG_LEVEL",
        parse_log_level,
        help="DEBUG, INFO, WARNING or ERROR.",
    ),
    Setting(
        "model",
        "model",
        "ref",
        "MESHNODE_MODEL",
        parse_nonempty,
        flag="model",
        help="Serve this model (alias, .gguf, folder, hf://org/repo[@rev], https:// URL): "
        "this node becomes the host, holds stage 0 and serves the OpenAI API on --api.",
    ),
    Setting(
        "split",
        "model",
        "split",
        "MESHNODE_SPLIT",
        parse_positive_int,
        help="Exactly this many stages, when that many nodes are up.",
        cli="int",
    ),
    Setting(
        "placement",
        "model",
        "placement",
        "MESHNODE_PLACEMENT",
        parse_placement,
        help="How layers are split: speed (measured before and while serving; memory until "
        "every node is measured) or memory (by memory alone, never re-placed by speed).",
    ),
    Setting(
        "disk_offload",
        "model",
        "disk_offload",
        "MESHNODE_DISK_OFFLOAD",
        parse_bool,
        flag="no-disk-offload",
        help="Refuse to serve a model larger than the mesh's memory from the memory-mapped "
        "file (disk offload is on by default; KV never goes to disk).",
        cli="off",
    ),
    Setting(
        "context_size",
        "model",
        "context_size",
        "MESHNODE_CONTEXT",
        parse_positive_int,
        flag="context",
        help=f"Context size in tokens (default: model's, max {DEFAULT_MAX_CONTEXT}).",
        cli="int",
    ),
    Setting(
        "wire_dtype",
        "model",
        "wire_dtype",
        "MESHNODE_WIRE_DTYPE",
        parse_wire_dtype,
        help="Activation dtype between stages: f16 (default) or f32.",
    ),
    Setting(
        "kv_dtype",
        "model",
        "kv_dtype",
        "MESHNODE_KV_DTYPE",
        parse_kv_dtype,
        flag="kv-dtype",
        help=KV_DTYPE_HELP,
    ),
    Setting(
        "prefill_chunk_tokens",
        "model",
        "prefill_chunk_tokens",
        "MESHNODE_PREFILL_CHUNK",
        parse_positive_int,
        flag="prefill-chunk",
        help="Prompt tokens per prefill pass (default 256).",
        cli="int",
    ),
    Setting(
        "pass_deadline_s",
        "model",
        "pass_deadline_s",
        "MESHNODE_PASS_DEADLINE",
        parse_positive_float,
        flag="pass-deadline",
        help="Seconds a pass across the stages may take, plus --pass-deadline-per-token "
        "per token in flight, before its stage counts as failed (default 60).",
        cli="float",
    ),
    Setting(
        "pass_deadline_per_token_s",
        "model",
        "pass_deadline_per_token_s",
        "MESHNODE_PASS_DEADLINE_PER_TOKEN",
        parse_non_negative_float,
        flag="pass-deadline-per-token",
        help="Seconds added to --pass-deadline per token in flight (default 0.25).",
        cli="float",
    ),
    Setting(
        "cache_dir",
        "node",
        "cache_dir",
        "MESHNODE_CACHE_DIR",
        parse_path,
        help="Where layer packages are materialized.",
        cli="path",
    ),
    Setting(
        "threads",
        "node",
        "threads",
        "MESHNODE_THREADS",
        parse_positive_int,
        help="BLAS threads on CPU (default: one per core; 1 when nodes share cores).",
        cli="int",
    ),
)
BY_NAME = {s.name: s for s in SETTINGS}


def env_help(name: str, text: str) -> str:
    """``text`` with the setting's environment variable, for a command-line help line."""
    return f"{text} [env: {BY_NAME[name].env}]"
