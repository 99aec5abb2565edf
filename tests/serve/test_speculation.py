"""Speculation on the serving node: settings from TOML and flags, drafts, parity, telemetry.

Precedence (CLI > ``[models."<id>"]`` > ``[defaults]`` > package > built-in) is checked
here through the real config loader and a real layer package; the pure resolution table
lives in tests/speculative/test_settings.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from meshnode_packaging.package import open_package
from meshnode_packaging.writer import write_package
from safetensors.numpy import save_file

from meshnode.errors import ConfigError
from meshnode.node.config import config_file_for, load_config
from meshnode.serve.service import ServeService
from meshnode.serve.single import build_single_node_service
from meshnode.serve.speculation import resolve_for_model
from meshnode.speculative.settings import SpeculativeFlags
from tests.e2e.cluster import cli
from tests.serve.conftest import (
    TINY_CONFIG,
    TINY_CONTEXT,
    TINY_MODEL_ID,
    Server,
    _tiny_weights,
    start_server,
)

REQUEST_TIMEOUT_S = 60.0
# Repetitive, so that n-gram lookups find drafts, and longer than auto mode's
# SHAPE_MIN_PROMPT_TOKENS so that auto turns on from the prompt's shape.
REPETITIVE = " ".join(["x = f(a, b); y = g(x); z = h(y);"] * 8)
PROMPTS = [REPETITIVE, "The quick brown fox jumps over the lazy dog. " * 3, "Hello"]


@pytest.fixture(scope="module")
def tiny_package(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a layer package declaring a draft (itself) and an n-gram strategy."""
    out = tmp_path_factory.mktemp("tiny-package")
    policy = {"default": "fixed", "initial_window": 3, "min_window": 1, "max_window": 6}
    block = {
        "default": "draft",
        "strategies": {
            "draft": {"type": "draft-model", "draft": str(tiny_model_dir), "window_policy": policy},
            "lookup": {"type": "ngram", "min_n": 2, "max_n": 3, "window_policy": policy},
        },
    }
    write_package(tiny_model_dir, out, speculative=block, model_id=TINY_MODEL_ID)
    return out


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A checkpoint whose vocabulary is smaller than the tiny model's: not a usable draft."""
    folder = tmp_path_factory.mktemp("other-vocab")
    config = {**TINY_CONFIG, "vocab_size": 1024}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text((tiny_model_dir / "tokenizer.json").read_text())
    save_file(_tiny_weights(config, seed=3), str(folder / "model.safetensors"))
    return folder


# -- precedence through the config loader ---------------------------------------------------

MODEL_TABLE = f'[models."{TINY_MODEL_ID}".speculative]'


@pytest.mark.parametrize(
    ("toml", "flags", "expected"),
    [
        ("", SpeculativeFlags(), "draft"),  # the package's default
        ("", SpeculativeFlags(no_draft=True), "ngram"),  # --no-draft: package's next choice
        ('[defaults.speculative]\nstrategy = "off"\n', SpeculativeFlags(), "off"),
        (
            f'[defaults.speculative]\nstrategy = "off"\n{MODEL_TABLE}\nstrategy = "layer-skip"\n',
            SpeculativeFlags(),
            "layer-skip",
        ),
        (
            f'{MODEL_TABLE}\nstrategy = "layer-skip"\n',
            SpeculativeFlags(strategy="auto"),
            "auto",
        ),
        ('[defaults.speculative]\nstrategy = "draft"\n', SpeculativeFlags(no_draft=True), "ngram"),
        (
            '[models."some-other-model".speculative]\nstrategy = "off"\n',
            SpeculativeFlags(),
            "draft",
        ),
    ],
)
def test_config_and_flags_resolve_to_strategy(
    tmp_path: Path, tiny_package: Path, toml: str, flags: SpeculativeFlags, expected: str
) -> None:
    path = tmp_path / "meshnode.toml"
    path.write_text(toml)
    config = load_config(config_file=path, env={}, flags={"speculative": flags})
    settings = resolve_for_model(
        config.speculative,
        config.speculative_tables,
        model_id=TINY_MODEL_ID,
        model_ref=str(tiny_package),
        source=open_package(tiny_package),
    )
    assert settings.strategy == expected
    if expected != "draft":
        assert settings.draft_model is None


def test_window_settings_come_from_the_highest_source(tmp_path: Path, tiny_package: Path) -> None:
    path = tmp_path / "meshnode.toml"
    path.write_text(f"[defaults.speculative]\nmax_window = 5\n{MODEL_TABLE}\nmin_window = 2\n")
    flags = SpeculativeFlags(strategy="ngram", initial_window=4)
    config = load_config(config_file=path, env={}, flags={"speculative": flags})
    settings = resolve_for_model(
        config.speculative,
        config.speculative_tables,
        model_id=TINY_MODEL_ID,
        model_ref=None,
        source=open_package(tiny_package),
    )
    window = settings.window
    # initial from the CLI, min from [models], max from [defaults], policy from the package
    assert (window.kind, window.initial_window, window.min_window, window.max_window) == (
        "fixed",
        4,
        2,
        5,
    )
    assert settings.ngram.max_n == 3  # the package's n-gram entry


def test_a_model_table_may_name_the_model_by_its_reference(
    tmp_path: Path, tiny_package: Path
) -> None:
    path = tmp_path / "meshnode.toml"
    path.write_text(f'[models."{tiny_package}".speculative]\nstrategy = "ngram"\n')
    config = load_config(config_file=path, env={})
    settings = resolve_for_model(
        config.speculative,
        config.speculative_tables,
        model_id=TINY_MODEL_ID,
        model_ref=str(tiny_package),
        source=open_package(tiny_package),
    )
    assert settings.strategy == "ngram"
    assert settings.sources["strategy"] == f'config [models."{tiny_package}".speculative]'


@pytest.mark.parametrize(
    ("toml", "problem"),
    [
        ("[defaults.speculative]\nstrategy = 'fast'\n", "strategy must be one of"),
        ("[defaults.speculative]\nwindow = 3\n", "unknown key 'window'"),
        ("[defaults]\nspeculatve = {}\n", "unknown setting [defaults] speculatve"),
        ('[models."m".speculative]\nmax_window = 0\n', "max_window must be >= 1"),
        ('[models."m"]\nwire_dtype = "f32"\n', 'unknown setting [models."m"] wire_dtype'),
        ("models = 3\n", "[models] must be a table"),
    ],
)
def test_config_speculative_tables_are_strict(tmp_path: Path, toml: str, problem: str) -> None:
    path = tmp_path / "meshnode.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(config_file=path, env={})
    assert problem in str(info.value)


def test_bad_flags_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="contradicts --no-draft"):
        load_config(env={}, flags={"speculative": SpeculativeFlags("draft", no_draft=True)})
    with pytest.raises(ConfigError, match="window_policy must be fixed or adaptive"):
        load_config(env={}, flags={"speculative": SpeculativeFlags(window_policy="wide")})


def test_default_config_file_is_found_in_the_state_dir(tmp_path: Path) -> None:
    assert config_file_for(None, tmp_path, env={}) is None
    (tmp_path / "config.toml").write_text("[defaults.speculative]\nstrategy = 'ngram'\n")
    assert config_file_for(None, tmp_path, env={}) == tmp_path / "config.toml"
    assert config_file_for(None, None, env={"MESHNODE_STATE_DIR": str(tmp_path)}) == (
        tmp_path / "config.toml"
    )
    explicit = tmp_path / "other.toml"
    assert config_file_for(explicit, tmp_path, env={}) == explicit


@pytest.mark.parametrize(
    ("args", "config", "problem"),
    [
        (["--speculative", "fast"], None, "strategy must be one of"),
        (["--speculative", "draft", "--no-draft"], None, "contradicts --no-draft"),
        (["--min-window", "0"], None, "min_window must be >= 1"),
        ([], "[defaults.speculative]\nwindow = 3\n", "unknown key 'window'"),  # state dir
    ],
)
def test_join_refuses_bad_speculative_settings(
    tmp_path: Path, args: list[str], config: str | None, problem: str
) -> None:
    if config is not None:
        (tmp_path / "config.toml").write_text(config)
    result = cli("join", "--state-dir", str(tmp_path), "--no-mdns", *args)
    assert result.returncode == 2, result.stderr
    assert problem in result.stderr


# -- drafts: loaded, disabled, unavailable --------------------------------------------------


def package_service(
    package: Path, flags: SpeculativeFlags, *, draft_memory_bytes: int | None = None
) -> ServeService:
    return build_single_node_service(
        str(package),
        model_id=TINY_MODEL_ID,
        context_size=TINY_CONTEXT,
        speculative=flags,
        draft_memory_bytes=draft_memory_bytes,
    )


def test_package_draft_is_loaded_and_no_draft_really_disables_it(tiny_package: Path) -> None:
    with_draft = package_service(tiny_package, SpeculativeFlags())
    assert with_draft.spec_host is not None
    assert with_draft.spec_host.draft_stage is not None
    assert with_draft.speculation_status()["strategy"] == "draft"

    without = package_service(tiny_package, SpeculativeFlags(no_draft=True))
    assert without.spec_host is not None
    assert without.spec_host.draft_stage is None  # never loaded
    status = without.speculation_status()
    assert status["strategy"] == "ngram"
    assert status["draft_model"] is None
    assert status["sources"]["draft_model"] == "cli --no-draft"
    assert status["warnings"] == []


@pytest.mark.parametrize("case", ["missing", "vocab", "memory"])
async def test_unusable_draft_serves_without_it_and_says_why(
    tiny_model_dir: Path, other_vocab_model: Path, tmp_path: Path, case: str
) -> None:
    ref = {
        "missing": str(tmp_path / "no-such-model"),
        "vocab": str(other_vocab_model),
        "memory": str(tiny_model_dir),
    }[case]
    service = build_single_node_service(
        str(tiny_model_dir),
        model_id=TINY_MODEL_ID,
        context_size=TINY_CONTEXT,
        speculative=SpeculativeFlags(strategy="draft", draft_model=ref),
        draft_memory_bytes=1 if case == "memory" else None,
    )
    status = service.speculation_status()
    assert status["requested"] == "draft"
    assert status["strategy"] == "auto"  # the next choice: the built-in default
    [warning] = status["warnings"]
    expected = {"missing": "cannot open", "vocab": "vocabulary", "memory": "not enough memory"}
    assert expected[case] in warning
    assert ref in warning
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, service)
        reply = await complete(server, "Hello there", max_tokens=5)
        nursery.cancel_scope.cancel()
    assert reply["usage"]["completion_tokens"] == 5


def test_layer_skip_that_cannot_be_built_falls_back(tiny_model_dir: Path) -> None:
    # The tiny model has 2 layers: a 2-layer "skip" is the whole model, which is refused.
    service = build_single_node_service(
        str(tiny_model_dir),
        model_id=TINY_MODEL_ID,
        context_size=TINY_CONTEXT,
        speculative=SpeculativeFlags(strategy="layer-skip", layer_skip_layers=2),
    )
    status = service.speculation_status()
    assert status["strategy"] == "auto"
    assert "layer-skip unavailable" in status["warnings"][0]


# -- greedy parity through the API ----------------------------------------------------------


async def complete(server: Server, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": TINY_MODEL_ID,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        response = await http.post(server.base_url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


@pytest.fixture(scope="module")
def plain_cache() -> dict[str, list[str]]:
    """Where ``plain_replies`` keeps its answer for the module's later tests."""
    return {}


@pytest.fixture
async def plain_replies(
    nursery: trio.Nursery, tiny_model_dir: Path, plain_cache: dict[str, list[str]]
) -> list[str]:
    """The replies of a service without speculation, asked once per module."""
    if "replies" not in plain_cache:
        service = build_single_node_service(
            str(tiny_model_dir), model_id=TINY_MODEL_ID, context_size=TINY_CONTEXT
        )
        server = await start_server(nursery, service)
        replies = [await complete(server, p, 40) for p in PROMPTS]
        plain_cache["replies"] = [r["choices"][0]["text"] for r in replies]
    return plain_cache["replies"]


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("strategy", ["ngram", "auto", "layer-skip"])
async def test_greedy_parity_through_the_api(
    nursery: trio.Nursery,
    tiny_model_dir: Path,
    plain_replies: list[str],
    strategy: str,
    policy: str,
) -> None:
    flags = SpeculativeFlags(
        strategy=strategy, window_policy=policy, initial_window=3, layer_skip_layers=1
    )
    service = build_single_node_service(
        str(tiny_model_dir), model_id=TINY_MODEL_ID, context_size=TINY_CONTEXT, speculative=flags
    )
    assert service.speculation_status()["strategy"] == strategy
    server = await start_server(nursery, service)
    replies = [await complete(server, p, 40) for p in PROMPTS]
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        metrics = (await http.get(server.base_url + "/metrics")).text
    assert [r["choices"][0]["text"] for r in replies] == plain_replies
    stats = replies[0]["meshnode"]["speculation"]
    assert stats["strategy"] == strategy
    assert stats["windows"] > 0  # the repetitive prompt really was verified in windows
    assert stats["tokens_per_verify"] >= 1.0
    assert stats["verify_seconds"] > 0
    assert stats["cost_per_accepted_token_s"] > 0
    total = service.spec_total
    assert total.windows == sum(r["meshnode"]["speculation"]["windows"] for r in replies)
    assert f"meshnode_spec_windows_total {total.windows}" in metrics
    assert f'meshnode_spec_requests_total{{strategy="{strategy}"}} {len(PROMPTS)}' in metrics
    assert "meshnode_spec_accept_rate " in metrics
    acceptance = service.speculation_status()["acceptance"]
    assert acceptance["proposed"] == total.proposed


async def test_streaming_final_chunk_carries_speculation(
    nursery: trio.Nursery, tiny_model_dir: Path
) -> None:
    service = build_single_node_service(
        str(tiny_model_dir),
        model_id=TINY_MODEL_ID,
        context_size=TINY_CONTEXT,
        speculative=SpeculativeFlags(strategy="ngram"),
    )
    body = {
        "model": TINY_MODEL_ID,
        "prompt": REPETITIVE,
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
    }
    url = "/v1/completions"
    server = await start_server(nursery, service)
    async with (
        httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http,
        http.stream("POST", server.base_url + url, json=body) as response,
    ):
        # Read to the end of the stream, so no iterator is left half-consumed.
        text = (await response.aread()).decode()
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    [final] = finals
    speculation = final["meshnode"]["speculation"]
    assert speculation["strategy"] == "ngram"
    assert speculation["windows"] > 0
    assert all(c.get("meshnode") is None for c in chunks if c is not final)
