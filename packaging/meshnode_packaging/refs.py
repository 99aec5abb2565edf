"""Model references: what ``--model`` accepts, resolved to something we can open.

==========================================  =============================================
``smollm2-135m``                            an alias of ``sources.DEFAULT_MODELS``
``/path/model.gguf``                        a GGUF file (opened with ``sources.open_source``)
``/path/checkpoint/``                       a Hugging Face checkpoint folder (``config.json``)
``/path/package/``                          a layer package folder (``model-package.json``)
``hf://org/repo[@rev]``                     a hub repo: a layer package, its one GGUF model,
                                            or a safetensors checkpoint
``hf://org/repo[@rev]:Q4_K_M``              the GGUF of that quantization in a hub repo
``hf://org/repo[@rev]/path/file.gguf``      that GGUF (all shards if it is split)
``https://host/base``                       a layer package served under a base URL
==========================================  =============================================

Revisions are branch, tag or commit names (no ``/``, no ``..``); file paths are relative
plain names. A remote model is opened part by part: :func:`open_ref` with a
:class:`~meshnode_packaging.manifest.Part` fetches only that stage's files (a package, see
:mod:`meshnode_packaging.fetch`) or byte ranges (a GGUF or safetensors repo, see
:mod:`meshnode_packaging.remote`). ``pin`` is what the host resolved the reference to (a hub
commit sha, or a URL package's manifest sha256): every stage reads exactly that.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from meshnode_packaging.errors import DamagedPackage, RefError
from meshnode_packaging.manifest import MANIFEST_NAME, Part
from meshnode_packaging.reference import (
    DEFAULT_REVISION,
    LocalPackage,
    LocalSource,
    ModelRef,
    RemotePackage,
)
from meshnode_packaging.sources import (
    DEFAULT_MODELS,
    ModelSource,
    SourceError,
    default_model_path,
    open_source,
)
from meshnode_packaging.validate import validate_package

_HF_REF = re.compile(
    r"hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[^/:]+))?"
    r"(?:/(?P<file>.+)|:(?P<quant>[A-Za-z0-9_]+))?"
)


def resolve(ref: str | Path) -> ModelRef:
    """What ``ref`` names; raise :class:`RefError` when it names nothing we can open."""
    text = str(ref)
    if m := _HF_REF.fullmatch(text):
        return _hub_ref(m)
    if text.startswith("hf://"):
        raise RefError(
            f"{text!r}: expected hf://org/repo[@revision] with an optional /file.gguf or :QUANT"
        )
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
    if not path.exists() and _looks_like_path(text):
        raise RefError(f"{text!r}: no such file or folder")
    known = ", ".join(sorted(DEFAULT_MODELS))
    raise RefError(
        f"{text!r} is not a model alias ({known}), a .gguf file, a checkpoint or package folder, "
        "hf://org/repo[@revision] or an https:// URL"
    )


def _looks_like_path(text: str) -> bool:
    # An alias is a bare word (smollm2-135m); a missing file would otherwise be told it is
    # "not a model alias, a .gguf file, ...", which hides the typo in its path.
    return "/" in text or os.sep in text or text.startswith(("~", ".")) or text.endswith(".gguf")


def _hub_ref(m: re.Match[str]) -> RemotePackage:
    from meshnode_packaging.hub import check_repo_path, check_revision

    repo = m["repo"]
    if any(p in (".", "..") for p in repo.split("/")):
        raise RefError(f"repository {repo!r}: expected org/name")
    revision = check_revision(m["rev"]) if m["rev"] is not None else DEFAULT_REVISION
    file = check_repo_path(m["file"]) if m["file"] is not None else None
    return RemotePackage(repo=repo, revision=revision, file=file, quant=m["quant"])


class RefKind(enum.StrEnum):
    """Where a reference's bytes come from (see :func:`ref_kind`)."""

    HUB = "hub"  # hf://: the hub of this process (HF_ENDPOINT)
    URL = "url"  # http(s)://: any host
    ALIAS = "alias"  # a model bundled in an installed package (sources.DEFAULT_MODELS)
    LOCAL = "local"  # anything else: a path on this machine


def ref_kind(ref: str) -> RefKind:
    """What kind of reference ``ref`` is, read from its text alone.

    Nothing is looked up (no file system, no network), so a node can decide whether to
    open a reference another node sent before touching anything it names. A malformed
    ``hf://`` reference is still ``HUB`` (:func:`resolve` refuses it later).
    """
    if ref.startswith("hf://"):
        return RefKind.HUB
    if is_url(ref):
        return RefKind.URL
    if ref in DEFAULT_MODELS:
        return RefKind.ALIAS
    return RefKind.LOCAL


def is_url(ref: str | Path | ModelRef) -> bool:
    """Whether ``ref`` names a package behind a URL other than the hub's (an http(s) URL)."""
    return str(ref).startswith(("https://", "http://"))


def pin_ref(ref: str | ModelRef, *, cache_dir: Path | None = None) -> str:
    """What ``ref`` names now, for every stage to read exactly that (the host calls this).

    A hub repo: its revision's commit sha. A URL package: its manifest's sha256. Local
    models: ``""`` (nothing to pin). Raises the ``FetchError`` tree.
    """
    target = ref if isinstance(ref, LocalSource | LocalPackage | RemotePackage) else resolve(ref)
    if not isinstance(target, RemotePackage):
        return ""
    if target.repo is not None:
        from meshnode_packaging.hub import resolve_commit

        return resolve_commit(target.repo, target.revision)
    from meshnode_packaging.fetch import Materializer

    folder = Materializer(cache_dir).fetch(target, Part(0, 0))
    return hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest()


def pinned_ref(ref: str, pin: str) -> str:
    """``ref`` with its hub revision replaced by the commit ``pin`` (other refs unchanged)."""
    target = resolve(ref)
    if not pin or not isinstance(target, RemotePackage) or target.repo is None:
        return ref
    tail = f"/{target.file}" if target.file else f":{target.quant}" if target.quant else ""
    return f"hf://{target.repo}@{pin}{tail}"


def check_local_package(folder: Path, part: Part | None = None) -> None:
    """Check the files ``part`` needs (``None``: all) of the package in ``folder`` against
    its manifest: presence, size and sha256, as a cache hit is checked, so a damaged local
    package is refused when it is opened rather than served. Raises :class:`DamagedPackage`.
    """
    problems = validate_package(folder, part=part)
    if problems:
        raise DamagedPackage(folder, problems)


def open_ref(
    ref: str | Path | ModelRef,
    part: Part | None = None,
    *,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
    pin: str = "",
    cancel: threading.Event | None = None,
) -> ModelSource:
    """Open ``ref`` as a ``ModelSource``, materializing ``part`` first if it is remote.

    ``part=None`` means the whole model. Local sources and packages are opened in place (a
    local package is memory-mapped, so a stage still reads only its own tensors); the files
    a local package's ``part`` needs are checked first (:func:`check_local_package`). ``pin``
    (from :func:`pin_ref`) fixes what a remote reference reads; setting ``cancel`` stops a
    fetch within about a second. Raises :class:`RefError`, :class:`DamagedPackage`, or a
    :class:`~meshnode_packaging.errors.FetchError` from the fetch.
    """
    from meshnode_packaging.fetch import Materializer, default_cache_dir
    from meshnode_packaging.package import open_package
    from meshnode_packaging.remote import open_hub

    target = ref if isinstance(ref, LocalSource | LocalPackage | RemotePackage) else resolve(ref)
    if isinstance(target, LocalPackage):
        check_local_package(target.path, part)
        return open_package(target.path)
    if isinstance(target, LocalSource):
        try:
            return open_source(target.path)
        except SourceError as exc:
            raise RefError(str(exc)) from exc
    if target.repo is not None:
        cache = cache_dir if cache_dir is not None else default_cache_dir()
        return open_hub(target, part, cache_dir=cache, pin=pin, progress=progress, cancel=cancel)
    folder = Materializer(cache_dir, cancel=cancel).fetch(
        target, part, progress=progress, manifest_sha256=pin or None
    )
    return open_package(folder)
