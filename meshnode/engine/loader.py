"""Resolving a model reference and loading everything a single node needs to generate.

This is the one place where ``--model`` references resolve: an alias from
``meshnode_packaging.sources.DEFAULT_MODELS``, a layer-package folder (it holds
``model-package.json``), a Hugging Face checkpoint folder, or a ``.gguf`` file.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from meshnode_packaging.sources import (
    DEFAULT_MODELS,
    ModelSource,
    SourceError,
    default_model_path,
    open_source,
)

from meshnode.engine.backend import Backend
from meshnode.engine.config import ConfigError, ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.tokenizer import ChatTemplate, TemplateError, Tokenizer

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelLoadError", "load_model", "resolve_source"]

DEFAULT_MODEL = "smollm2-135m"
PACKAGE_MANIFEST = "model-package.json"


class ModelLoadError(Exception):
    """The model reference cannot be resolved or the model cannot be loaded."""


def resolve_source(ref: str | None) -> ModelSource:
    """The :class:`ModelSource` behind ``ref`` (None means the default model).

    Raises :class:`ModelLoadError` with a one-line reason.
    """
    ref = ref or DEFAULT_MODEL
    try:
        if ref in DEFAULT_MODELS:
            return open_source(default_model_path(ref))
        path = Path(ref).expanduser()
        if (path / PACKAGE_MANIFEST).is_file():
            return _open_package(path)
        if not path.exists() and "/" not in ref and not ref.endswith(".gguf"):
            known = ", ".join(sorted(DEFAULT_MODELS))
            raise ModelLoadError(f"unknown model {ref!r}: not an alias ({known}) nor a path")
        return open_source(path)
    except SourceError as exc:
        raise ModelLoadError(str(exc)) from exc


def _open_package(folder: Path) -> ModelSource:
    try:
        package = importlib.import_module("meshnode_packaging.package")
    except ImportError as exc:
        raise ModelLoadError(f"{folder}: layer packages are not supported yet") from exc
    source: ModelSource = package.open_package(folder)
    return source


@dataclass(frozen=True)
class LoadedModel:
    """A whole model on one node: one stage over every layer, tokenizer, chat template."""

    config: ModelConfig
    stage: Stage
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None


def load_model(ref: str | None, backend: Backend) -> LoadedModel:
    """Resolve ``ref`` and load all layers with embedding and head onto ``backend``.

    Raises :class:`ModelLoadError`.
    """
    source = resolve_source(ref)
    try:
        config = ModelConfig.from_hf(source.config)
        tokenizer = Tokenizer(source.tokenizer_json)
        template = None
        if source.chat_template:
            template = ChatTemplate(source.chat_template, _special_tokens(tokenizer, config))
        stage = Stage(config, source, 0, config.num_layers, embed=True, head=True, backend=backend)
    except (ConfigError, TemplateError, SourceError) as exc:
        raise ModelLoadError(str(exc)) from exc
    except KeyError as exc:
        raise ModelLoadError(f"model lacks tensor {exc.args[0]!r}") from exc
    return LoadedModel(config, stage, tokenizer, template)


def _special_tokens(tokenizer: Tokenizer, config: ModelConfig) -> dict[str, str]:
    """``bos_token``/``eos_token`` strings that chat templates may refer to."""
    out = {}
    if config.bos_token_id is not None:
        out["bos_token"] = tokenizer.decode([config.bos_token_id])
    if config.eos_token_ids:
        out["eos_token"] = tokenizer.decode([config.eos_token_ids[0]])
    return out
