"""The run's KV dtype (``--kv-dtype``): from the settings to the ``Load``, honoured by the
worker's stage, and counted by the planner's footprint (a float16 node holds twice the
context in the same memory); and the run's CPU arithmetic (``Load.cpu_dtype``), the host's,
which a worker's stage takes whatever its own ``--dtype``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.sources import open_source
from meshnode_protocol import Load, PeerInfo

from meshnode.cli.join import run_cpu_dtype
from meshnode.engine.backend import CpuBackend, cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.errors import ConfigError, RunError
from meshnode.node.config import load_config
from meshnode.node.footprint import check_load, model_footprint
from meshnode.node.worker import build_runner
from tests.engine.tiny import write_tiny_model


def _load(kv_dtype: str, layers: tuple[int, int], cpu_dtype: str = "") -> Load:
    me = PeerInfo(node_id="me", address="127.0.0.1:1")
    return Load(
        run_id="r", term=1, package_ref="tiny", manifest_sha256="", layer_range=layers,
        has_embed=False, has_head=True, upstream=me, downstream=me, context_size=16,
        kv_dtype=kv_dtype, cpu_dtype=cpu_dtype,
    )  # fmt: skip


@pytest.mark.parametrize(("weights", "kv"), [("q8", "f16"), ("q8", "f32"), ("native", "f16")])
def test_the_worker_keeps_the_loads_kv_dtype(tmp_path: Path, weights: str, kv: str) -> None:
    """A stage built for a ``Load`` keeps its caches in the Load's KV dtype, whatever its
    weights (the host resolved ``auto``); an unknown one is refused before loading."""
    source = open_source(write_tiny_model(tmp_path, "Q8_0"))
    backend = CpuBackend(weights_dtype=weights)  # type: ignore[arg-type]
    runner = build_runner(backend, source, 1, 3, _load(kv, (1, 3)))
    assert runner.stage.kv_dtype == kv
    want = np.float16 if kv == "f16" else np.float32
    assert runner.stage.new_cache(16).k.dtype == want
    with pytest.raises(RunError, match="KV dtype 'auto'; a stage keeps f32 or f16"):
        build_runner(backend, source, 1, 3, _load("auto", (1, 3)))


def test_f16_kv_halves_the_footprint_and_doubles_the_context_a_node_holds(
    tmp_path: Path,
) -> None:
    config = ModelConfig.from_hf(open_source(write_tiny_model(tmp_path, "Q8_0")).config)
    f32, f16 = (model_footprint(config, kv_dtype=kv) for kv in ("f32", "f16"))
    assert f32.kv_bytes(0, 3, 100, "cpu") == 2 * f16.kv_bytes(0, 3, 100, "cpu") > 0
    offered = f32.kv_bytes(0, 3, 100, "cpu")
    check_load(config, 0, 3, 100, offered, "f32")
    check_load(config, 0, 3, 200, offered, "f16")
    with pytest.raises(RunError, match="KV cache alone"):
        check_load(config, 0, 3, 200, offered, "f32")


def test_the_setting_takes_auto_f32_f16_from_every_layer(tmp_path: Path) -> None:
    assert load_config(env={}).kv_dtype == "auto"
    assert load_config(env={"MESHNODE_KV_DTYPE": "F16"}).kv_dtype == "f16"
    assert load_config(env={}, flags={"kv_dtype": "f32"}).kv_dtype == "f32"
    toml = tmp_path / "config.toml"
    toml.write_text('[model]\nkv_dtype = "f16"\n')
    assert load_config(config_file=toml, env={}).kv_dtype == "f16"
    with pytest.raises(ConfigError, match="KV dtype must be one of auto, f32, f16, got 'q8'"):
        load_config(env={}, flags={"kv_dtype": "q8"})


@pytest.mark.parametrize(
    ("own", "host", "computes"),
    [("q8", "native", "native"), ("native", "q8", "q8"), ("q8", "", "q8"),
     ("float32", "q8", "float32")],
)  # fmt: skip
def test_a_worker_computes_in_the_hosts_cpu_dtype(
    tmp_path: Path, own: str, host: str, computes: str
) -> None:
    """A stage that keeps GGUF blocks computes as the host does (``--dtype native`` on the
    host makes the whole mesh exact); float32 (dequantized) weights stay float32; a mode
    the worker does not know fails the Load."""
    source = open_source(write_tiny_model(tmp_path, "Q8_0"))
    backend = CpuBackend(weights_dtype=own)  # type: ignore[arg-type]
    runner = build_runner(backend, source, 1, 3, _load("f32", (1, 3), host))
    assert runner.stage.backend.weights_dtype == computes
    with pytest.raises(RunError, match="the run computes in 'q4'; this node knows native and q8"):
        build_runner(backend, source, 1, 3, _load("f32", (1, 3), "q4"))


def test_the_host_asks_every_stage_for_its_own_arithmetic() -> None:
    """q8 where the host computes in q8 (the CPU's default), exact where it is exact."""
    assert run_cpu_dtype(cpu_backend("q8")) == "q8"
    assert run_cpu_dtype(cpu_backend("native")) == "native"
    assert run_cpu_dtype(cpu_backend("float32")) == "native"
