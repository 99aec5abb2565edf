"""Resolve the speculative-decoding settings of one model from every place they can be set.

Precedence, highest first (DESIGN §7):

1. CLI flags actually passed (``--speculative``, ``--draft-model``, ``--no-draft``, window
   and n-gram flags);
2. the TOML config's ``[models."<model id>".speculative]`` table;
3. its ``[defaults.speculative]`` table;
4. the package's ``generation.speculative_decoding`` block (a ``default`` strategy name and
   named ``strategies``, each with ``type`` ngram | draft-model | layer-skip, parameters
   inline or under ``params``, and a ``window_policy``);
5. the built-in default (``BUILTIN``).

The strategy is taken from the first source that names one. Every other field is taken
from the first source that sets it; the package contributes the fields of its strategy
entry that matches the resolved strategy. A draft strategy is skipped — resolution moves
on to the next source's non-draft choice — when ``--no-draft`` is passed, when the draft
is known to be unusable (``draft_unavailable``), or when no source names a draft model;
the last two leave a warning for ``meshnode status``.

TOML tables are strict (an unknown key is an error naming its table); the package block
is the publisher's, so a malformed one is ignored with a warning rather than refusing to
serve.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from meshnode_packaging.package import PackageSource
from meshnode_packaging.sources import ModelSource

from meshnode.errors import ConfigError
from meshnode.speculative.ngram import NgramParams
from meshnode.speculative.window import WindowKind, WindowPolicy

Strategy = Literal["off", "auto", "ngram", "draft", "layer-skip", "mtp"]
STRATEGIES: tuple[Strategy, ...] = ("off", "auto", "ngram", "draft", "layer-skip", "mtp")

# Package strategy ``type`` → the strategy it provides. An ngram entry with ``auto: true``
# asks for the auto mode.
PACKAGE_TYPES: dict[str, Strategy] = {
    "ngram": "ngram",
    "draft-model": "draft",
    "layer-skip": "layer-skip",
    "mtp": "mtp",  # the model's multi-token-prediction module (hybrid Qwen3.5 checkpoints)
}

# Keys of a TOML ``speculative`` table, with the type each must have.
TABLE_KEYS: dict[str, type] = {
    "strategy": str,
    "draft_model": str,
    "window_policy": str,
    "initial_window": int,
    "min_window": int,
    "max_window": int,
    "ngram_min": int,
    "ngram_max": int,
    "ngram_max_proposal": int,
    "layer_skip_layers": int,
}

# The built-in default: auto n-gram costs nothing until the request shows that it pays,
# with an adaptive window of 1..16 starting at 4 drafts (meshnode.speculative.window sizes it by
# measured step costs; on a CPU, a GPU or across a network a 16-draft pass costs well under
# twice a 4-draft one, and copying output accepts long runs).
BUILTIN: dict[str, Any] = {
    "strategy": "auto",
    "window_policy": "adaptive",
    "initial_window": 4,
    "min_window": 1,
    "max_window": 16,
    "ngram_min": 2,
    "ngram_max": 4,
    "ngram_max_proposal": 16,
}

SOURCE_CLI = "cli"
SOURCE_DEFAULTS = "config [defaults.speculative]"
SOURCE_BUILTIN = "built-in default"


class SpeculativeConfigError(ConfigError):
    """A speculative setting from the CLI or the TOML config is invalid; names its source."""


@dataclass(frozen=True, slots=True)
class SpeculativeFlags:
    """The speculative CLI flags actually passed (``None``: not passed)."""

    strategy: str | None = None
    draft_model: str | None = None
    no_draft: bool = False
    window_policy: str | None = None
    initial_window: int | None = None
    min_window: int | None = None
    max_window: int | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    ngram_max_proposal: int | None = None
    layer_skip_layers: int | None = None

    def table(self) -> dict[str, Any]:
        """The flags as a settings table (unset flags left out)."""
        keys = TABLE_KEYS.keys()
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    """The resolved settings, and where each decision came from (for ``meshnode status``)."""

    strategy: Strategy
    draft_model: str | None
    window: WindowPolicy
    ngram: NgramParams
    layer_skip_layers: int | None
    sources: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view for status output."""
        return {
            "strategy": self.strategy,
            "draft_model": self.draft_model,
            "window": {
                "policy": self.window.kind,
                "initial": self.window.initial_window,
                "min": self.window.min_window,
                "max": self.window.max_window,
            },
            "ngram": {
                "min_n": self.ngram.min_n,
                "max_n": self.ngram.max_n,
                "max_proposal": self.ngram.max_proposal,
            },
            "layer_skip_layers": self.layer_skip_layers,
            "sources": dict(self.sources),
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, slots=True)
class _Choice:
    strategy: Strategy
    source: str
    package_entry: Mapping[str, Any] | None = None


def package_block(source: ModelSource) -> Mapping[str, Any] | None:
    """The package's ``generation.speculative_decoding`` block (GGUF and HF sources have none)."""
    if isinstance(source, PackageSource):
        return source.manifest.speculative_decoding
    return None


def resolve_speculative(
    flags: SpeculativeFlags,
    config: Mapping[str, Any],
    model_id: str,
    package_block: Mapping[str, Any] | None,
    *,
    draft_unavailable: str | None = None,
) -> SpeculativeSettings:
    """Resolve one model's speculative settings (precedence in the module docstring).

    ``config`` is the parsed TOML document (only its ``defaults.speculative`` and
    ``models."<model_id>".speculative`` tables are read). ``draft_unavailable`` is the
    reason a previously resolved draft failed to load; resolving again with it falls back
    to the next non-draft choice. Raises ``SpeculativeConfigError`` for an invalid flag or
    config value.
    """
    warnings: list[str] = []
    model_source = f'config [models."{model_id}".speculative]'
    tables = [
        (SOURCE_CLI, check_table(flags.table(), "CLI flags")),
        (model_source, _config_table(config, ("models", model_id, "speculative"), model_source)),
        (SOURCE_DEFAULTS, _config_table(config, ("defaults", "speculative"), SOURCE_DEFAULTS)),
    ]
    entries = _package_entries(package_block, warnings)
    draft_ref, draft_source = _draft_ref(tables, entries)
    blocked = _draft_block_reason(flags, draft_unavailable, draft_ref)
    if flags.no_draft and flags.strategy == "draft":
        raise SpeculativeConfigError("--speculative draft contradicts --no-draft")
    choice = _choose(tables, entries, blocked, warnings)
    package_fields = _package_fields(choice, entries)
    layers = [*tables, ("package", package_fields), (SOURCE_BUILTIN, BUILTIN)]
    values, sources = _merge(layers)
    sources["strategy"] = choice.source
    if choice.strategy == "draft":
        sources["draft_model"] = draft_source
    else:
        draft_ref = None
        sources.pop("draft_model", None)
    if flags.no_draft:
        sources["draft_model"] = "cli --no-draft"
    return SpeculativeSettings(
        strategy=choice.strategy,
        draft_model=draft_ref,
        window=_window(values, sources, warnings),
        ngram=_ngram(values, sources),
        layer_skip_layers=values.get("layer_skip_layers"),
        sources=sources,
        warnings=tuple(warnings),
    )


# -- sources ---------------------------------------------------------------------------


def _config_table(config: Mapping[str, Any], path: tuple[str, ...], where: str) -> dict[str, Any]:
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping):
            raise SpeculativeConfigError(f"{where}: expected a table above {key!r}")
        node = node.get(key)
        if node is None:
            return {}
    if not isinstance(node, Mapping):
        raise SpeculativeConfigError(f"{where}: expected a table, got {type(node).__name__}")
    return check_table(node, where)


def check_table(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key, value in table.items():
        expected = TABLE_KEYS.get(key)
        if expected is None:
            raise SpeculativeConfigError(f"{where}: unknown key {key!r}")
        if not isinstance(value, expected) or isinstance(value, bool):
            raise SpeculativeConfigError(f"{where}: {key} must be {expected.__name__}")
        if isinstance(value, int) and value < 1:
            raise SpeculativeConfigError(f"{where}: {key} must be >= 1, got {value}")
    strategy = table.get("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        raise SpeculativeConfigError(
            f"{where}: strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
        )
    policy = table.get("window_policy")
    if policy is not None and policy not in ("fixed", "adaptive"):
        raise SpeculativeConfigError(f"{where}: window_policy must be fixed or adaptive")
    return dict(table)


def _package_entries(
    block: Mapping[str, Any] | None, warnings: list[str]
) -> list[tuple[str, Mapping[str, Any]]]:
    """Named package strategies, the default first; ``[]`` if absent or malformed."""
    if not block:
        return []
    strategies = block.get("strategies")
    default = block.get("default")
    problem = None
    if not isinstance(strategies, Mapping) or not all(
        isinstance(e, Mapping) for e in strategies.values()
    ):
        problem = "'strategies' must map names to tables"
    elif default is not None and default not in strategies:
        problem = f"default {default!r} is not one of its strategies"
    else:
        unknown = [n for n, e in strategies.items() if e.get("type") not in PACKAGE_TYPES]
        problem = f"unknown strategy type in {unknown}" if unknown else None
    if problem is not None:
        warnings.append(f"package speculative_decoding block ignored: {problem}")
        return []
    named = cast(Mapping[str, Mapping[str, Any]], strategies)
    order = sorted(named, key=lambda name: name != default)  # stable: default, then declared
    return [(name, named[name]) for name in order]


def _entry_params(entry: Mapping[str, Any]) -> dict[str, Any]:
    inline = {k: v for k, v in entry.items() if k not in ("type", "params", "window_policy")}
    params = entry.get("params")
    return {**inline, **(params if isinstance(params, Mapping) else {})}


def _entry_strategy(entry: Mapping[str, Any]) -> Strategy:
    strategy = PACKAGE_TYPES[entry["type"]]
    # ``auto=1`` is how ``meshnode package write --strategy NAME:type=ngram,auto=1`` spells it.
    if strategy == "ngram" and _entry_params(entry).get("auto") in (True, 1, "true"):
        return "auto"
    return strategy


def _entry_draft_ref(entry: Mapping[str, Any]) -> str | None:
    params = _entry_params(entry)
    for key in ("draft", "model", "draft_model"):
        if isinstance(params.get(key), str):
            return cast(str, params[key])
    return None


def _draft_ref(
    tables: list[tuple[str, dict[str, Any]]], entries: list[tuple[str, Mapping[str, Any]]]
) -> tuple[str | None, str]:
    for source, table in tables:
        if "draft_model" in table:
            return cast(str, table["draft_model"]), source
    for name, entry in entries:
        ref = _entry_draft_ref(entry) if entry["type"] == "draft-model" else None
        if ref is not None:
            return ref, f"package strategy {name!r}"
    return None, SOURCE_BUILTIN


def _draft_block_reason(
    flags: SpeculativeFlags, unavailable: str | None, ref: str | None
) -> tuple[str, bool] | None:
    """Why a draft strategy cannot be used, and whether that deserves a warning."""
    if flags.no_draft:
        return "--no-draft", False
    if unavailable is not None:
        return f"draft model {ref!r} unavailable: {unavailable}", True
    if ref is None:
        return "no draft model is configured", True
    return None


def _candidates(
    tables: list[tuple[str, dict[str, Any]]], entries: list[tuple[str, Mapping[str, Any]]]
) -> Iterator[_Choice]:
    for source, table in tables:
        if "strategy" in table:
            yield _Choice(cast(Strategy, table["strategy"]), source)
    for name, entry in entries:
        yield _Choice(_entry_strategy(entry), f"package strategy {name!r}", entry)
    yield _Choice(cast(Strategy, BUILTIN["strategy"]), SOURCE_BUILTIN)


def _choose(
    tables: list[tuple[str, dict[str, Any]]],
    entries: list[tuple[str, Mapping[str, Any]]],
    blocked: tuple[str, bool] | None,
    warnings: list[str],
) -> _Choice:
    for choice in _candidates(tables, entries):
        if choice.strategy != "draft" or blocked is None:
            return choice
        reason, warn = blocked
        if warn:
            warnings.append(f"draft strategy from {choice.source} skipped: {reason}")
    raise AssertionError("the built-in default is never a draft strategy")


def _package_fields(
    choice: _Choice, entries: list[tuple[str, Mapping[str, Any]]]
) -> dict[str, Any]:
    """The settings the package gives for the resolved strategy (its matching entry)."""
    entry = choice.package_entry
    if entry is None:
        kinds = {choice.strategy, "ngram"} if choice.strategy == "auto" else {choice.strategy}
        entry = next((e for _, e in entries if _entry_strategy(e) in kinds), None)
    if entry is None:
        return {}
    params = _entry_params(entry)
    out: dict[str, Any] = {}
    renames = {
        "min_n": "ngram_min",
        "max_n": "ngram_max",
        "max_proposal": "ngram_max_proposal",
        "layers": "layer_skip_layers",
    }
    for key, target in renames.items():
        if isinstance(params.get(key), int) and not isinstance(params[key], bool):
            out[target] = params[key]
    policy = entry.get("window_policy")
    if isinstance(policy, Mapping):
        if policy.get("default") in ("fixed", "adaptive"):
            out["window_policy"] = policy["default"]
        for key in ("initial_window", "min_window", "max_window"):
            if isinstance(policy.get(key), int) and not isinstance(policy[key], bool):
                out[key] = policy[key]
    return out


def _merge(
    layers: Sequence[tuple[str, Mapping[str, Any]]],
) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, table in layers:
        for key, value in table.items():
            if key not in values and key != "strategy":
                values[key] = value
                sources[key] = source
    return values, sources


# -- typed results ---------------------------------------------------------------------


def _window(values: dict[str, Any], sources: dict[str, str], warnings: list[str]) -> WindowPolicy:
    low, high = values["min_window"], values["max_window"]
    if low > high:
        raise SpeculativeConfigError(
            f"min_window {low} (from {sources['min_window']}) exceeds "
            f"max_window {high} (from {sources['max_window']})"
        )
    initial = values["initial_window"]
    clamped = min(max(initial, low), high)
    if clamped != initial:
        warnings.append(f"initial_window {initial} clamped to {clamped} (window {low}..{high})")
    return WindowPolicy(cast(WindowKind, values["window_policy"]), clamped, low, high)


def _ngram(values: dict[str, Any], sources: dict[str, str]) -> NgramParams:
    try:
        return NgramParams(values["ngram_min"], values["ngram_max"], values["ngram_max_proposal"])
    except ValueError as exc:
        where = f"{sources['ngram_min']} / {sources['ngram_max']}"
        raise SpeculativeConfigError(f"n-gram sizes from {where}: {exc}") from exc
