"""Models in ordinary hub repos, opened one stage at a time from byte ranges.

Theory of operation. ``hf://org/repo[@rev][/file.gguf | :QUANT]`` names a repo; its listing at
the pinned commit (:func:`meshnode_packaging.hub.listing`) says what it holds:

- ``model-package.json``: a meshnode layer package, materialized file by file
  (:mod:`meshnode_packaging.fetch`);
- GGUF files: the one named, or the one whose name carries the quantization (``Q4_K_M``), with
  all its shards when it is split (``-00001-of-00003.gguf``);
- ``config.json`` with ``model.safetensors`` or a sharded ``model.safetensors.index.json``.

For the last two, small files (config, tokenizer) are downloaded whole into the shared hub
cache and checked by hash. Each weight file becomes a sparse :class:`PartialFile`: its header
is fetched first (a prefix, grown until it parses), then only the byte ranges of the tensors
the stage runs — its layers, the embedding on the first stage, the final norm and head on the
last (and the embedding there too when the head is tied to it) — several at once. The files
are then opened by the ordinary sources (``GGUFSource``, ``HFFolderSource``) behind a
:class:`RangedSource` that hands out only tensors whose bytes are present, so the engine reads
the same ``ModelSource`` whatever the file was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from meshnode_packaging import hub
from meshnode_packaging.errors import (
    ChecksumMismatch,
    FetchError,
    MissingPart,
    OfflineMissing,
    RefError,
)
from meshnode_packaging.manifest import MANIFEST_NAME, Part
from meshnode_packaging.ranged import (
    ByteRange,
    PartialFile,
    RangeFetcher,
    RangeJob,
    RangeLimits,
    WholeFile,
    pieces,
)
from meshnode_packaging.remote_headers import (
    MAX_HEADER_BYTES,
    FileLayout,
    TensorSpan,
    gguf_layout,
    safetensors_layout,
)
from meshnode_packaging.sources import (
    GGUFSource,
    HFFolderSource,
    ModelSource,
    RawTensor,
    gguf_to_canonical,
    hf_to_canonical,
    open_gguf,
    sampling_defaults,
    tensor_config,
)
from meshnode_packaging.transfer import ProgressFn

if TYPE_CHECKING:
    from meshnode_packaging.reference import RemotePackage

log = logging.getLogger("meshnode_packaging.remote")

# The first read of a header. A GGUF header holds the vocabulary (1-6 MB for real models); a
# safetensors header is tens of KB and says its own length in its first 8 bytes.
FIRST_GGUF_BYTES = 1 << 20
FIRST_SAFETENSORS_BYTES = 64 << 10
_SHARD = re.compile(r"(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
_LAYER = re.compile(r"^layers\.(\d+)\.")
INDEX_NAME = "model.safetensors.index.json"
# Small files read whole when present: the model's config, its tokenizer and chat template.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)


@dataclass(frozen=True)
class Selection:
    """The files of a repo that make the model: weight files (in order) and small ones."""

    kind: Literal["package", "gguf", "safetensors"]
    weights: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()


def _shards(files: dict[str, hub.RepoFile], first: str) -> tuple[str, ...]:
    m = _SHARD.fullmatch(first)
    if m is None:
        return (first,)
    count = int(m["count"])
    names = tuple(f"{m['base']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))
    missing = [n for n in names if n not in files]
    if missing:
        raise RefError(f"split GGUF {first}: the repo lacks {', '.join(missing)}")
    return names


def _gguf_sets(files: dict[str, hub.RepoFile]) -> list[str]:
    """The first file of every GGUF model in the repo (one per split set)."""
    return sorted(
        f
        for f in files
        if f.endswith(".gguf") and ((m := _SHARD.fullmatch(f)) is None or int(m["no"]) == 1)
    )


def _by_quant(files: dict[str, hub.RepoFile], quant: str) -> str:
    token = re.compile(rf"(?:^|[./_-]){re.escape(quant)}(?:[./-]|$)", re.IGNORECASE)
    found = [f for f in _gguf_sets(files) if token.search(f)]
    if len(found) == 1:
        return found[0]
    what = "no GGUF file" if not found else f"{len(found)} GGUF files ({', '.join(found)})"
    have = ", ".join(_gguf_sets(files)) or "none"
    raise RefError(f"{what} for quantization {quant}; GGUF files in the repo: {have}")


def select(listing: hub.Listing, file: str | None, quant: str | None) -> Selection:
    """What ``hf://`` with this ``file`` or ``quant`` opens in ``listing``; raise RefError."""
    files = listing.files
    if file is not None:
        if file not in files:
            raise RefError(f"hf://{listing.repo}: no file {file}")
        if not file.endswith(".gguf"):
            raise RefError(f"{file}: a file reference must name a .gguf file")
        return Selection("gguf", _shards(files, file))
    if quant is not None:
        return Selection("gguf", _shards(files, _by_quant(files, quant)))
    if MANIFEST_NAME in files:
        return Selection("package")
    extras = tuple(f for f in SMALL_FILES if f in files)
    if "config.json" in files and INDEX_NAME in files:
        return Selection("safetensors", (), (*extras, INDEX_NAME))
    if "config.json" in files and "model.safetensors" in files:
        return Selection("safetensors", ("model.safetensors",), extras)
    sets = _gguf_sets(files)
    if len(sets) == 1:
        return Selection("gguf", _shards(files, sets[0]))
    if sets:
        raise RefError(
            f"hf://{listing.repo} holds several GGUF files; choose one with :QUANT or /FILE "
            f"({', '.join(sets)})"
        )
    raise RefError(
        f"hf://{listing.repo}: neither a layer package, a GGUF repo nor a safetensors repo"
    )


def wanted(canonical: str | None, raw: str, part: Part | None, head_embeds: bool) -> bool:
    """Whether a stage running ``part`` needs the tensor ``raw`` (canonical name or None);
    ``head_embeds``: the last stage reads the embedding too (a tied head, or an MTP module)."""
    if part is None:
        return True
    if canonical is None:
        # A tensor the remap table ignores: per-layer ones are unused, file-level ones (rope
        # frequency factors) are small and read when the file is opened.
        return not raw.startswith("blk.")
    if m := _LAYER.match(canonical):
        return part.start <= int(m[1]) < part.end
    if canonical == "embed_tokens.weight":
        return part.embed or (part.head and head_embeds)
    return part.head  # final norm, output projection, the MTP module (mtp.*)


class RangedSource:
    """A ``ModelSource`` over files of which only some tensors' bytes are present."""

    def __init__(self, inner: ModelSource, present: set[str], commit: str, folder: Path) -> None:
        self._inner = inner
        self._present = present
        self.commit = commit
        self.folder = folder  # where the partial files and the small files' links are
        self.config: dict[str, Any] = inner.config
        self.tokenizer_json: str | None = inner.tokenizer_json
        self.chat_template: str | None = inner.chat_template
        self.sampling_defaults = sampling_defaults(inner)

    def tensor_names(self) -> list[str]:
        """Canonical names of the tensors whose bytes were fetched."""
        return [n for n in self._inner.tensor_names() if n in self._present]

    def tensor(self, name: str) -> RawTensor:
        """Tensor ``name``; raises :class:`MissingPart` if this stage did not fetch it."""
        if name not in self._present:
            raise MissingPart(f"tensor {name!r} was not fetched for this stage")
        return self._inner.tensor(name)


class ShardedGGUFSource(GGUFSource):
    """A split GGUF model (``-0000k-of-0000N.gguf``): metadata from the first shard."""

    def __init__(self, paths: list[Path]) -> None:
        super().__init__(paths[0])
        self._readers = [open_gguf(p) for p in paths[1:]]  # kept: tensors view them
        for reader in self._readers:
            for t in reader.tensors:
                if (canonical := gguf_to_canonical(t.name, self.architecture)) is not None:
                    self._tensors[canonical] = t
        self.config.update(tensor_config(set(self._tensors)))


@dataclass
class _Weights:
    rel: str
    file: PartialFile  # or a WholeFile found in the shared hub cache
    layout: FileLayout


class HubModel:
    """One GGUF or safetensors repo at one commit, opened for one part (module docstring)."""

    def __init__(
        self,
        ref: RemotePackage,
        listing: hub.Listing,
        selection: Selection,
        cache_dir: Path,
        limits: RangeLimits,
        cancel: threading.Event | None,
    ) -> None:
        assert ref.repo is not None
        self.repo, self.listing, self.selection = ref.repo, listing, selection
        self.root = cache_dir / ref.cache_name / "ranges" / listing.commit
        self.limits, self.cancel = limits, cancel

    def _fetcher(self, progress: ProgressFn | None = None) -> RangeFetcher:
        return RangeFetcher(
            limits=self.limits, pin=self.listing.commit, cancel=self.cancel, progress=progress
        )

    def _url(self, rel: str) -> str:
        return hub.file_url(self.repo, self.listing.commit, rel)

    def open(self, part: Part | None, progress: ProgressFn | None) -> RangedSource:
        extras = {rel: self._small(rel) for rel in self.selection.extras}
        weights = self.selection.weights or self._index_files(extras)
        files = [self._header(rel) for rel in weights]
        spans = self._spans(files)
        head_embeds = self._tied(spans, extras) or any(c.startswith("mtp.") for c in spans)
        want = {c: s for c, s in spans.items() if wanted(c, s.name, part, head_embeds)}
        self._fetch(files, list(want.values()), progress)
        self._verify_whole(files)
        present = {c for c, s in want.items() if self._file(files, s.file).has(s.bytes)}
        inner = self._inner(files)
        return RangedSource(inner, present, self.listing.commit, self.root)

    # -- files ------------------------------------------------------------------------

    def _small(self, rel: str) -> Path:
        path = hub.download_small(self.repo, self.listing.commit, rel, self.listing.files[rel])
        link = self.root / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_file() or link.resolve() != path.resolve():
            tmp = link.with_name(f".{link.name}.tmp")
            tmp.unlink(missing_ok=True)
            os.symlink(path.resolve(), tmp)
            os.replace(tmp, link)
        return path

    def _index_files(self, extras: dict[str, Path]) -> tuple[str, ...]:
        try:
            weight_map = json.loads(extras[INDEX_NAME].read_text(encoding="utf-8"))["weight_map"]
            names = sorted({hub.check_repo_path(str(v)) for v in weight_map.values()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FetchError(f"{INDEX_NAME}: no weight_map of file names") from exc
        absent = [n for n in names if n not in self.listing.files]
        if absent:
            raise FetchError(f"{INDEX_NAME} names files the repo lacks: {', '.join(absent)}")
        return tuple(names)

    def _header(self, rel: str) -> _Weights:
        entry = self.listing.files[rel]
        pf = self._cached_whole(rel, entry) or PartialFile(self.root / rel, entry.size)
        gguf_file = self.selection.kind == "gguf"
        parse = gguf_layout if gguf_file else safetensors_layout
        n = min(entry.size, FIRST_GGUF_BYTES if gguf_file else FIRST_SAFETENSORS_BYTES)
        while True:
            self._fetch_into(pf, rel, [ByteRange(0, n)])
            buf = pf.read(ByteRange(0, n))
            layout = parse(buf, rel, entry.size)
            if layout is not None:
                return _Weights(rel, pf, layout)
            if n >= min(entry.size, MAX_HEADER_BYTES):
                raise FetchError(f"{rel}: header longer than {MAX_HEADER_BYTES} bytes")
            # safetensors says how long its header is; a GGUF header is grown until it parses
            need = n * 4 if gguf_file else 8 + int.from_bytes(buf[:8], "little")
            n = min(entry.size, MAX_HEADER_BYTES, need)

    def _cached_whole(self, rel: str, entry: hub.RepoFile) -> WholeFile | None:
        """``rel`` whole in the shared hub cache at this commit (``hf download`` put it
        there), linked into our folder so that the readers find it; else None."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(
            self.repo, rel, cache_dir=hub.hub_cache_dir(), revision=self.listing.commit
        )
        if not isinstance(found, str) or Path(found).stat().st_size != entry.size:
            return None
        target = Path(found).resolve()
        link = self.root / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not (link.is_symlink() and link.resolve() == target):
            link.unlink(missing_ok=True)
            link.with_name(link.name + ".ranges.json").unlink(missing_ok=True)
            link.symlink_to(target)
        return WholeFile(target, entry.size, self.root / f"{rel}.whole.json")

    def _fetch_into(self, pf: PartialFile, rel: str, ranges: list[ByteRange]) -> None:
        missing = pf.missing(ranges)
        if missing:
            self._offline_check(rel)
            jobs = [RangeJob(self._url(rel), pf, p) for p in pieces(missing, self.limits)]
            self._fetcher().run(jobs)

    @staticmethod
    def _offline_check(rel: str) -> None:
        if hub.is_offline():
            raise OfflineMissing(f"HF_HUB_OFFLINE is set and bytes of {rel} are not cached")

    @staticmethod
    def _file(files: list[_Weights], rel: str) -> PartialFile:
        return next(w.file for w in files if w.rel == rel)

    def _spans(self, files: list[_Weights]) -> dict[str, TensorSpan]:
        spans: dict[str, TensorSpan] = {}
        for w in files:
            for s in w.layout.tensors:
                key = self._canonical(s.name)
                spans[key if key is not None else f"raw:{s.name}"] = s
        return spans

    def _canonical(self, name: str) -> str | None:
        if self.selection.kind == "gguf":
            return gguf_to_canonical(name)
        return hf_to_canonical(name)

    def _tied(self, spans: dict[str, TensorSpan], extras: dict[str, Path]) -> bool:
        if "lm_head.weight" not in spans:
            return True
        if "config.json" not in extras:
            return False
        config = json.loads(extras["config.json"].read_text(encoding="utf-8"))
        return bool(config.get("tie_word_embeddings", False))

    def _fetch(
        self, files: list[_Weights], spans: list[TensorSpan], progress: ProgressFn | None
    ) -> None:
        jobs: list[RangeJob] = []
        for w in files:
            ranges = [s.bytes for s in spans if s.file == w.rel]
            missing = w.file.missing(ranges)
            if missing:
                self._offline_check(w.rel)
            jobs += [RangeJob(self._url(w.rel), w.file, p) for p in pieces(missing, self.limits)]
        total = sum(j.piece.size for j in jobs)
        log.info("hf://%s: %d byte ranges, %d bytes to fetch", self.repo, len(jobs), total)
        if jobs:
            self._fetcher(progress).run(jobs)
        elif progress is not None:
            progress(0, 0)

    def _verify_whole(self, files: list[_Weights]) -> None:
        """A file fetched in full is checked against the hub's sha256 (once)."""
        for w in files:
            sha = self.listing.files[w.rel].sha256
            if sha is None or not w.file.complete() or w.file.verified == sha:
                continue
            h = hashlib.sha256()
            with w.file.path.open("rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            if h.hexdigest() != sha:
                w.file.forget()
                raise ChecksumMismatch(f"{w.rel}: sha256 differs from the hub's")
            w.file.mark_verified(sha)

    def _inner(self, files: list[_Weights]) -> ModelSource:
        if self.selection.kind == "safetensors":
            return HFFolderSource(self.root)
        paths = [w.file.path for w in files]
        return GGUFSource(paths[0]) if len(paths) == 1 else ShardedGGUFSource(paths)


def open_hub(
    ref: RemotePackage,
    part: Part | None,
    *,
    cache_dir: Path,
    pin: str = "",
    progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
    limits: RangeLimits | None = None,
) -> ModelSource:
    """Open ``part`` of the hub model ``ref`` at commit ``pin`` (resolved now when empty).

    Raises :class:`RefError` for a reference the repo cannot satisfy, the ``FetchError`` tree
    for transfers, ``SourceError`` for files the sources cannot read.
    """
    assert ref.repo is not None
    commit = pin or hub.resolve_commit(ref.repo, ref.revision)
    hub.check_commit(commit)
    if hub.COMMIT.fullmatch(ref.revision) and ref.revision != commit:
        raise RefError(f"hf://{ref.repo}@{ref.revision} does not match the pin {commit}")
    listing = hub.listing(ref.repo, commit, cache_dir)
    selection = select(listing, ref.file, ref.quant)
    if selection.kind == "package":
        from meshnode_packaging.fetch import Materializer
        from meshnode_packaging.package import open_package

        pinned = dataclasses.replace(ref, revision=commit)
        folder = Materializer(cache_dir, cancel=cancel).fetch(pinned, part, progress=progress)
        return open_package(folder)
    model = HubModel(ref, listing, selection, cache_dir, limits or RangeLimits(), cancel)
    return model.open(part, progress)
