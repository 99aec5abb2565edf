"""Model references: what ``--model`` accepts, resolved to something we can open.

=========================================  =============================================
``smollm2-135m``                           an alias of ``sources.DEFAULT_MODELS``
``/path/model.gguf``                       a GGUF file (opened with ``sources.open_source``)
``/path/checkpoint/``                      a Hugging Face checkpoint folder (``config.json``)
``/path/package/``                         a layer package folder (``model-package.json``)
``hf://org/repo`` / ``hf://org/repo@rev``  a layer package in a Hugging Face model repo
``https://host/base``                      a layer package served under a base URL
=========================================  =============================================

A remote package is opened part by part: :func:`open_ref` with a
:class:`~meshnode_packaging.manifest.Part` materializes only that stage's files (see
:mod:`meshnode_packaging.fetch`) and opens the cached snapshot.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from meshnode_packaging.errors import RefError
from meshnode_packaging.manifest import MANIFEST_NAME, Part
from meshnode_packaging.sources import (
    DEFAULT_MODELS,
    ModelSource,
    SourceError,
    default_model_path,
    open_source,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
_HF_REF = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


@dataclass(frozen=True)
class LocalSource:
    """A GGUF file or a Hugging Face checkpoint folder (not a package)."""

    path: Path


@dataclass(frozen=True)
class LocalPackage:
    """A layer package folder on this machine."""

    path: Path


@dataclass(frozen=True)
class RemotePackage:
    """A layer package behind HTTP: a Hugging Face repo (``repo``) or a base URL (``url``)."""

    repo: str | None
    revision: str = DEFAULT_REVISION
    url: str | None = None

    def file_url(self, rel: str, endpoint: str | None = None) -> str:
        """URL of file ``rel``; ``endpoint`` defaults to ``HF_ENDPOINT`` read now."""
        if self.url is not None:
            return f"{self.url.rstrip('/')}/{rel}"
        base = endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
        return f"{base.rstrip('/')}/{self.repo}/resolve/{self.revision}/{rel}"

    @property
    def cache_name(self) -> str:
        """The folder name in the cache, as the Hugging Face cache spells repositories."""
        if self.repo is not None:
            return "models--" + self.repo.replace("/", "--")
        parts = urlsplit(self.url or "")
        words = [parts.netloc.replace(":", "-"), *filter(None, parts.path.split("/"))]
        return "urls--" + "--".join(re.sub(r"[^\w.-]", "_", w) for w in words)


ModelRef = LocalSource | LocalPackage | RemotePackage


def resolve(ref: str | Path) -> ModelRef:
    """What ``ref`` names; raise :class:`RefError` when it names nothing we can open."""
    text = str(ref)
    if m := _HF_REF.match(text):
        return RemotePackage(repo=m["repo"], revision=m["rev"] or DEFAULT_REVISION)
    if text.startswith("hf://"):
        raise RefError(f"{text!r}: expected hf://org/repo or hf://org/repo@revision")
    if text.startswith(("https://", "http://")):
        return RemotePackage(repo=None, url=text.rstrip("/"))
    if text in DEFAULT_MODELS:
        try:
            return LocalSource(default_model_path(text))
        except SourceError as exc:
            raise RefError(str(exc)) from exc
    path = Path(text).expanduser()
    if (path / MANIFEST_NAME).is_file():
        return LocalPackage(path)
    if path.is_file() or (path / "config.json").is_file():
        return LocalSource(path)
    known = ", ".join(sorted(DEFAULT_MODELS))
    raise RefError(
        f"{text!r} is not a model alias ({known}), a .gguf file, a checkpoint or package folder, "
        "hf://org/repo[@revision] or an https:// URL"
    )


def open_ref(
    ref: str | Path | ModelRef,
    part: Part | None = None,
    *,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ModelSource:
    """Open ``ref`` as a ``ModelSource``, materializing ``part`` first if it is remote.

    ``part=None`` means the whole model. Local sources and packages are opened in place (a
    local package is memory-mapped, so a stage still reads only its own tensors). Raises
    :class:`RefError`, or a :class:`~meshnode_packaging.errors.FetchError` from the fetch.
    """
    from meshnode_packaging.fetch import Materializer
    from meshnode_packaging.package import open_package

    target = ref if isinstance(ref, LocalSource | LocalPackage | RemotePackage) else resolve(ref)
    if isinstance(target, LocalPackage):
        return open_package(target.path)
    if isinstance(target, LocalSource):
        try:
            return open_source(target.path)
        except SourceError as exc:
            raise RefError(str(exc)) from exc
    folder = Materializer(cache_dir).fetch(target, part, progress=progress)
    return open_package(folder)
