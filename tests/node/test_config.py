"""Config layering (defaults → file → env → flags) and strictness."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshnode.node.config import (
    Address,
    ConfigError,
    HeartbeatTimeouts,
    NodeConfig,
    load_config,
)
from meshnode.node.parsers import parse_bytes


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "meshnode.toml"
    path.write_text(text)
    return path


def test_defaults_need_nothing() -> None:
    config = load_config(env={})
    assert config == NodeConfig(state_dir=config.state_dir)
    assert config.listen == Address("0.0.0.0", 7470)
    assert config.mdns


def test_layers_apply_in_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [node]
        listen = "127.0.0.1:1000"
        api = "127.0.0.1:2000"
        max_memory = "1GiB"
        [discovery]
        peers = ["10.0.0.2:7470", "[::1]:7471"]
        [heartbeat]
        interval_s = 0.5
        """,
    )
    env = {"MESHNODE_API": "127.0.0.1:3000", "MESHNODE_LISTEN": "127.0.0.1:4000"}
    config = load_config(
        config_file=path, env=env, flags={"listen": Address("127.0.0.1", 5000), "api": None}
    )
    assert config.listen == Address("127.0.0.1", 5000)  # flag beats env beats file
    assert config.api == Address("127.0.0.1", 3000)  # env beats file; unpassed flag ignored
    assert config.max_memory_bytes == 1 << 30
    assert config.peers == (Address("10.0.0.2", 7470), Address("::1", 7471))
    assert config.heartbeat == HeartbeatTimeouts(0.5, 3.0, 10.0)


def test_env_values_are_parsed() -> None:
    env = {
        "MESHNODE_MDNS": "off",
        "MESHNODE_PEERS": "a:1,b:2",
        "MESHNODE_HEARTBEAT_S": "0.2",
        "MESHNODE_SUSPECT_S": "0.6",
        "MESHNODE_DEAD_S": "1.5",
        "MESHNODE_SUSPECT_GRACE_S": "0",
        "MESHNODE_DEVICE": "cuda",
        "MESHNODE_DTYPE": "bfloat16",
    }
    config = load_config(env=env)
    assert not config.mdns
    assert config.peers == (Address("a", 1), Address("b", 2))
    assert config.heartbeat == HeartbeatTimeouts(0.2, 0.6, 1.5, suspect_grace_s=0.0)
    assert config.device == "cuda"
    assert config.weights_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[node]\nlisten_port = 1\n", r"unknown setting \[node\] listen_port"),
        ("[nodes]\nlisten = 'a:1'\n", r"unknown setting \[nodes\] listen"),
        ("listen = 'a:1'\n", "must be a"),
        ("[node]\nlisten = 7470\n", "expected a string"),
        ("[node]\nlisten = 'nohost'\n", "HOST:PORT"),
        ("[node]\ndevice = 'tpu'\n", "cpu or cuda"),
        ("[node]\ndtype = 'int3'\n", "dtype must be one of auto, float32, float16, bfloat16"),
        ("[discovery]\nmdns = 'maybe'\n", "boolean"),
        ("[heartbeat]\ninterval_s = 5.0\n", "interval_s < suspect_after_s"),
        ("[heartbeat]\nsuspect_grace_s = -1.0\n", "suspect_grace_s"),
        ("[node\n", "cannot read config file"),
    ],
)
def test_bad_files_are_rejected(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(config_file=write(tmp_path, text), env={})


def test_bad_env_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="MESHNODE_MAX_MEMORY"):
        load_config(env={"MESHNODE_MAX_MEMORY": "lots"})


def test_unknown_flags_are_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(env={}, flags={"colour": "blue"})


def test_config_is_frozen_and_hides_the_token() -> None:
    config = load_config(env={"MESHNODE_TOKEN": "mesh1-secret"})
    assert "secret" not in repr(config)
    with pytest.raises(AttributeError):
        config.token = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "value"), [("8GiB", 8 << 30), ("512M", 512_000_000), ("100", 100), (7, 7)]
)
def test_byte_counts(text: str | int, value: int) -> None:
    assert parse_bytes(text) == value


def test_token_file_is_read_when_no_token(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("mesh1-abc\n")
    assert load_config(env={"MESHNODE_TOKEN_FILE": str(tmp_path / "t")}).resolve_token() == (
        "mesh1-abc"
    )
    # No token anywhere: the daemon will create a mesh; its token then lives in the state dir.
    config = load_config(env={"MESHNODE_STATE_DIR": str(tmp_path / "state")})
    assert config.resolve_token() is None
    config.own_token_file.parent.mkdir()
    config.own_token_file.write_text("mesh1-own\n")
    assert config.resolve_token() == "mesh1-own"
    with pytest.raises(ConfigError, match="cannot read token file"):
        load_config(env={"MESHNODE_TOKEN_FILE": str(tmp_path / "missing")}).resolve_token()


def test_the_example_config_loads() -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "meshnode.example.toml"
    config = load_config(config_file=example, env={})
    assert config.token_file == Path("/etc/meshnode/token")
    assert config.heartbeat == HeartbeatTimeouts()


def test_the_example_configs_optional_tables_load(tmp_path: Path) -> None:
    # The host-only tables are commented out in the example; uncommented they must load.
    example = Path(__file__).resolve().parents[2] / "deploy" / "meshnode.example.toml"
    keys = "ref|split|context_size|wire_dtype|strategy|window_policy|initial_window|max_window"
    text = re.sub(rf"(?m)^# (\[|(?:{keys}|min_window) )", r"\1", example.read_text())
    (tmp_path / "host.toml").write_text(text)
    config = load_config(config_file=tmp_path / "host.toml", env={})
    assert (config.model, config.split, config.context_size) == ("smollm2-135m", 3, 2048)
    tables = config.speculative_tables
    assert tables["defaults"]["speculative"]["strategy"] == "auto"
    assert tables["models"]["smollm2-135m"]["speculative"]["strategy"] == "ngram"


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        ({"split": 0}, "--split: expected a positive integer, got 0"),
        ({"threads": 0}, "--threads: expected a positive integer, got 0"),
        ({"context_size": 0}, "--context: expected a positive integer, got 0"),
        ({"wire_dtype": "bf16"}, "--wire-dtype: wire dtype must be f16 or f32, got 'bf16'"),
        ({"log_level": "verbose"}, "--log-level: log level must be DEBUG, INFO, WARNING or ERROR"),
        ({"listen": "nowhere"}, "--listen: expected HOST:PORT, got 'nowhere'"),
        ({"max_memory_bytes": "lots"}, "--max-memory: expected a byte count"),
        ({"heartbeat.interval_s": -1.0}, "--heartbeat-interval: expected a positive number"),
        ({"model": " "}, "--model: expected a non-empty string"),
        ({"weights_dtype": "int3"}, "--dtype: dtype must be one of"),
    ],
)
def test_flags_get_the_checks_the_file_gets(flags: dict[str, object], problem: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)):
        load_config(env={}, flags=flags)


def test_flag_text_is_parsed_like_the_file() -> None:
    config = load_config(
        env={},
        flags={"listen": "127.0.0.1:5000", "peers": ["127.0.0.1:1", "[::1]:2"], "threads": 2,
               "max_memory_bytes": "1GiB", "device": "cpu"},
    )  # fmt: skip
    assert config.listen == Address("127.0.0.1", 5000)
    assert config.peers == (Address("127.0.0.1", 1), Address("::1", 2))
    assert config.threads == 2
    assert config.max_memory_bytes == 1 << 30


def test_one_variable_names_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshnode_packaging.fetch import default_cache_dir

    monkeypatch.setenv("MESHNODE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert load_config(env={"MESHNODE_CACHE_DIR": str(tmp_path / "c")}).cache_dir == tmp_path / "c"


def test_cors_origins_from_every_layer(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\ncors_origins = ["https://a.example", "http://b.local:3000/"]\n')
    assert load_config(config_file=path, env={}).cors_origins == (
        "https://a.example",
        "http://b.local:3000",
    )
    env = {"MESHNODE_CORS_ORIGINS": "https://c.example, *"}
    assert load_config(env=env).cors_origins == ("https://c.example", "*")
    flags = {"cors_origins": ["https://d.example"]}
    assert load_config(config_file=path, env=env, flags=flags).cors_origins == (
        "https://d.example",
    )
    assert load_config(env={}).cors_origins == ()
    with pytest.raises(ConfigError, match=re.escape("--cors-origin: expected an origin")):
        load_config(env={}, flags={"cors_origins": ["https://a.example/path"]})


def test_local_models_from_every_layer(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nlocal_models = ["/srv/a.gguf", "~/b"]\n')
    assert load_config(config_file=path, env={}).local_models == (
        Path("/srv/a.gguf"),
        Path.home() / "b",
    )
    env = {"MESHNODE_LOCAL_MODELS": "/srv/c.gguf:/srv/pkg"}
    assert load_config(env=env).local_models == (Path("/srv/c.gguf"), Path("/srv/pkg"))
    flags = {"local_models": ["/srv/d"]}
    assert load_config(config_file=path, env=env, flags=flags).local_models == (Path("/srv/d"),)
    assert load_config(env={}).local_models == ()
    bad = write(tmp_path, "[node]\nlocal_models = 3\n")
    with pytest.raises(ConfigError, match="expected a list of paths"):
        load_config(config_file=bad, env={})


def test_placement_and_disk_offload_from_every_layer() -> None:
    """``--placement`` and ``--no-disk-offload`` (issue 34): speed and on by default."""
    assert load_config().placement == "speed"
    assert load_config().disk_offload is True
    env = {"MESHNODE_PLACEMENT": "memory", "MESHNODE_DISK_OFFLOAD": "0"}
    config = load_config(env=env)
    assert (config.placement, config.disk_offload) == ("memory", False)
    flags: dict[str, object] = {"placement": "speed", "disk_offload": False}
    assert load_config(env=env, flags=flags).placement == "speed"
    with pytest.raises(ConfigError, match="placement must be speed or memory, got 'fast'"):
        load_config(flags={"placement": "fast"})
