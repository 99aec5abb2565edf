"""Speculative settings: precedence CLI > [models.<id>] > [defaults] > package > built-in."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.speculative.settings import (
    SOURCE_BUILTIN,
    SOURCE_CLI,
    SOURCE_DEFAULTS,
    SpeculativeConfigError,
    SpeculativeFlags,
    resolve_speculative,
)

MODEL = "smollm2-135m"
MODEL_SRC = f'config [models."{MODEL}".speculative]'

# The block ``meshnode package write --speculative-default draft --strategy …`` writes.
PACKAGE_DRAFT: dict[str, Any] = {
    "default": "draft",
    "strategies": {
        "draft": {
            "type": "draft-model",
            "draft": "hf://org/tiny-draft",
            "window_policy": {
                "default": "adaptive",
                "initial_window": 3,
                "min_window": 2,
                "max_window": 6,
            },
        },
        "lookup": {
            "type": "ngram",
            "min_n": 3,
            "max_n": 5,
            "window_policy": {
                "default": "fixed",
                "initial_window": 5,
                "min_window": 1,
                "max_window": 8,
            },
        },
    },
}
PACKAGE_NGRAM: dict[str, Any] = {
    "default": "lookup",
    "strategies": {"lookup": PACKAGE_DRAFT["strategies"]["lookup"]},
}


def config(
    defaults: dict[str, Any] | None = None, model: dict[str, Any] | None = None
) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if defaults is not None:
        doc["defaults"] = {"speculative": defaults}
    if model is not None:
        doc["models"] = {
            MODEL: {"speculative": model},
            "other": {"speculative": {"strategy": "off"}},
        }
    return doc


F = SpeculativeFlags
# (case, flags, config, package block, strategy, strategy source, draft model)
TABLE: list[tuple[str, SpeculativeFlags, dict[str, Any], Any, str, str, str | None]] = [
    ("nothing set", F(), {}, None, "auto", SOURCE_BUILTIN, None),
    (
        "package default draft",
        F(),
        {},
        PACKAGE_DRAFT,
        "draft",
        "package strategy 'draft'",
        "hf://org/tiny-draft",
    ),
    ("package ngram", F(), {}, PACKAGE_NGRAM, "ngram", "package strategy 'lookup'", None),
    (
        "defaults beat package",
        F(),
        config({"strategy": "ngram"}),
        PACKAGE_DRAFT,
        "ngram",
        SOURCE_DEFAULTS,
        None,
    ),
    (
        "model beats defaults",
        F(),
        config({"strategy": "ngram"}, {"strategy": "layer-skip"}),
        PACKAGE_DRAFT,
        "layer-skip",
        MODEL_SRC,
        None,
    ),
    (
        "cli beats model",
        F(strategy="off"),
        config({"strategy": "ngram"}, {"strategy": "draft"}),
        PACKAGE_DRAFT,
        "off",
        SOURCE_CLI,
        None,
    ),
    ("other model's table is ignored", F(), config(model={}), None, "auto", SOURCE_BUILTIN, None),
    (
        "no-draft skips package draft to its ngram",
        F(no_draft=True),
        {},
        PACKAGE_DRAFT,
        "ngram",
        "package strategy 'lookup'",
        None,
    ),
    (
        "no-draft skips config draft",
        F(no_draft=True),
        config({"strategy": "draft"}),
        PACKAGE_NGRAM,
        "ngram",
        "package strategy 'lookup'",
        None,
    ),
    (
        "no-draft without package falls to built-in",
        F(no_draft=True),
        config(model={"strategy": "draft", "draft_model": "x"}),
        None,
        "auto",
        SOURCE_BUILTIN,
        None,
    ),
    (
        "cli draft uses package draft ref",
        F(strategy="draft"),
        {},
        PACKAGE_NGRAM | {"strategies": PACKAGE_DRAFT["strategies"]},
        "draft",
        SOURCE_CLI,
        "hf://org/tiny-draft",
    ),
    (
        "cli draft model beats package ref",
        F(strategy="draft", draft_model="./d.gguf"),
        {},
        PACKAGE_DRAFT,
        "draft",
        SOURCE_CLI,
        "./d.gguf",
    ),
    (
        "config draft model beats package ref",
        F(),
        config({"draft_model": "cfg"}),
        PACKAGE_DRAFT,
        "draft",
        "package strategy 'draft'",
        "cfg",
    ),
    (
        "draft with no ref anywhere falls through",
        F(),
        config({"strategy": "draft"}),
        None,
        "auto",
        SOURCE_BUILTIN,
        None,
    ),
    (
        "package ngram with auto flag",
        F(),
        {},
        {"default": "n", "strategies": {"n": {"type": "ngram", "auto": True}}},
        "auto",
        "package strategy 'n'",
        None,
    ),
]


@pytest.mark.parametrize(
    ("flags", "cfg", "package", "strategy", "source", "draft"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_strategy_precedence(
    flags: SpeculativeFlags,
    cfg: dict[str, Any],
    package: Any,
    strategy: str,
    source: str,
    draft: str | None,
) -> None:
    settings = resolve_speculative(flags, cfg, MODEL, package)
    assert settings.strategy == strategy
    assert settings.sources["strategy"] == source
    assert settings.draft_model == draft


def test_fields_come_from_the_first_source_that_sets_them() -> None:
    settings = resolve_speculative(
        F(max_window=7),
        config({"min_window": 3, "ngram_max": 6}, {"window_policy": "fixed"}),
        MODEL,
        PACKAGE_DRAFT,
    )
    assert settings.strategy == "draft"
    # initial from the package's draft entry, min from defaults, max from the CLI.
    assert (settings.window.kind, settings.window.initial_window) == ("fixed", 3)
    assert (settings.window.min_window, settings.window.max_window) == (3, 7)
    assert settings.sources["window_policy"] == MODEL_SRC
    assert settings.sources["initial_window"] == "package"
    assert settings.sources["min_window"] == SOURCE_DEFAULTS
    assert settings.sources["max_window"] == SOURCE_CLI
    # The draft entry has no n-gram sizes: min from the built-in, max from defaults.
    assert (settings.ngram.min_n, settings.ngram.max_n) == (2, 6)


def test_package_params_follow_the_resolved_strategy() -> None:
    settings = resolve_speculative(F(strategy="ngram"), {}, MODEL, PACKAGE_DRAFT)
    assert (settings.ngram.min_n, settings.ngram.max_n) == (3, 5)
    assert (settings.window.kind, settings.window.initial_window) == ("fixed", 5)


def test_no_draft_is_silent_but_visible_in_sources() -> None:
    settings = resolve_speculative(F(no_draft=True), {}, MODEL, PACKAGE_DRAFT)
    assert settings.warnings == ()
    assert settings.sources["draft_model"] == "cli --no-draft"


def test_unavailable_draft_falls_back_with_a_warning() -> None:
    settings = resolve_speculative(
        F(), {}, MODEL, PACKAGE_DRAFT, draft_unavailable="vocabulary 32000 != 49152"
    )
    assert settings.strategy == "ngram"
    assert settings.draft_model is None
    assert len(settings.warnings) == 1
    assert "hf://org/tiny-draft" in settings.warnings[0]
    assert "vocabulary 32000 != 49152" in settings.warnings[0]
    assert settings.as_dict()["warnings"] == list(settings.warnings)


def test_cli_draft_with_no_draft_is_an_error() -> None:
    with pytest.raises(SpeculativeConfigError, match="contradicts"):
        resolve_speculative(F(strategy="draft", no_draft=True), {}, MODEL, None)


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"stratgy": "auto"}, "unknown key 'stratgy'"),
        ({"strategy": "medusa"}, "strategy must be one of"),
        ({"max_window": "8"}, "max_window must be int"),
        ({"max_window": True}, "max_window must be int"),
        ({"min_window": 0}, "min_window must be >= 1"),
        ({"window_policy": "sliding"}, "fixed or adaptive"),
        ({"min_window": 17}, "min_window 17 .* exceeds max_window 16"),
        ({"ngram_min": 5}, "n-gram sizes"),
    ],
)
def test_bad_config_names_its_table(table: dict[str, Any], match: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=match):
        resolve_speculative(F(), config(table), MODEL, None)


def test_malformed_package_block_is_ignored_with_a_warning() -> None:
    block = {"default": "x", "strategies": {"y": {"type": "ngram"}}}
    settings = resolve_speculative(F(), {}, MODEL, block)
    assert settings.strategy == "auto"
    assert "package speculative_decoding block ignored" in settings.warnings[0]


def test_initial_window_is_clamped_into_higher_precedence_bounds() -> None:
    settings = resolve_speculative(F(max_window=2), {}, MODEL, None)
    assert settings.window.initial_window == 2
    assert "clamped" in settings.warnings[0]
