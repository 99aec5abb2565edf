"""Loading everything a single node needs to generate from one model reference.

References resolve in one place, ``meshnode_packaging.refs`` (an alias of
``sources.DEFAULT_MODELS``, a ``.gguf`` file, a Hugging Face checkpoint folder, a layer
package folder, ``hf://org/repo`` or an https URL); this module only maps its errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from meshnode_packaging.errors import PackageError
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import open_ref
from meshnode_packaging.sources import ModelSource, SourceError, sampling_defaults

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig, ModelConfigError
from meshnode.engine.model import Stage
from meshnode.engine.tokenizer import ChatTemplate, TemplateError, Tokenizer
from meshnode.errors import ModelError

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelLoadError",
    "ModelSource",
    "generation_defaults",
    "load_model",
    "open_stage_source",
    "reading_model",
    "resolve_source",
]

DEFAULT_MODEL = "smollm2-135m"


class ModelLoadError(ModelError):
    """The model reference cannot be resolved or the model cannot be loaded."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


@contextlib.contextmanager
def reading_model() -> Iterator[None]:
    """Map what reading a model raises to :class:`ModelLoadError`, with a one-line reason.

    This is the boundary where ``meshnode_packaging``'s ``PackageError``/``SourceError``,
    and the ``OSError``, ``ValueError`` and ``KeyError`` (a missing tensor) of files that
    are not what they claim, enter meshnode's tree; a :class:`~meshnode.errors.ModelError`
    passes through unchanged.
    """
    try:
        yield
    except ModelError:
        raise
    except (PackageError, SourceError, OSError, ValueError) as exc:
        raise ModelLoadError(_one_line(exc)) from exc
    except KeyError as exc:
        raise ModelLoadError(f"model lacks tensor {exc.args[0]!r}") from exc


def resolve_source(ref: str | None, *, cache_dir: Path | None = None) -> ModelSource:
    """The whole-model :class:`ModelSource` behind ``ref`` (None: the default model),
    fetched into ``cache_dir`` (None: the default cache) when it is remote.

    Raises :class:`ModelLoadError` with a one-line reason.
    """
    with reading_model():
        return open_ref(ref or DEFAULT_MODEL, cache_dir=cache_dir)


def open_stage_source(
    ref: str, start: int, end: int, *, embed: bool, head: bool, cache_dir: Path | None = None
) -> ModelSource:
    """What a stage over layers ``[start, end)`` (with the embedding and/or the head) reads
    of ``ref``, fetched first when it is remote.

    Raises what ``meshnode_packaging`` raises (map it with :func:`reading_model`).
    """
    return open_ref(ref, Part(start, end, embed=embed, head=head), cache_dir=cache_dir)


def generation_defaults(source: ModelSource) -> dict[str, float | int]:
    """The sampling settings the model ships (GGUF ``general.sampling.*``, a checkpoint's
    ``generation_config.json``, a package's ``generation.sampling``); often empty."""
    return sampling_defaults(source)


@dataclass(frozen=True)
class LoadedModel:
    """A whole model on one node: one stage over every layer, tokenizer, chat template."""

    config: ModelConfig
    stage: Stage
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    # The model's own sampling defaults (GGUF general.sampling.*, generation_config.json).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)


def load_model(ref: str | None, backend: Backend, kv_dtype: str = "auto") -> LoadedModel:
    """Resolve ``ref`` and load all layers with embedding and head onto ``backend``, with
    KV caches of ``kv_dtype`` (``Stage``'s).

    Raises :class:`ModelLoadError`.
    """
    source = resolve_source(ref)
    try:
        with reading_model():
            config = ModelConfig.from_hf(source.config)
            tokenizer = Tokenizer(source.tokenizer_json)
            template = None
            if source.chat_template:
                template = ChatTemplate(source.chat_template, _special_tokens(tokenizer, config))
            stage = Stage(
                config,
                source,
                0,
                config.num_layers,
                embed=True,
                head=True,
                backend=backend,
                kv_dtype=kv_dtype,
            )
    except (ModelConfigError, TemplateError) as exc:
        raise ModelLoadError(_one_line(exc)) from exc
    return LoadedModel(config, stage, tokenizer, template, generation_defaults(source))


def _special_tokens(tokenizer: Tokenizer, config: ModelConfig) -> dict[str, str]:
    """``bos_token``/``eos_token`` strings that chat templates may refer to."""
    out = {}
    if config.bos_token_id is not None:
        out["bos_token"] = tokenizer.decode([config.bos_token_id])
    if config.eos_token_ids:
        out["eos_token"] = tokenizer.decode([config.eos_token_ids[0]])
    return out
