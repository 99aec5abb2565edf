"""What a model reference names, as records: a :class:`LocalSource` (a GGUF file or a
checkpoint folder), a :class:`LocalPackage` or a :class:`RemotePackage` (a hub repo or a
package's base URL). Parsing a reference and opening what it names is
:mod:`meshnode_packaging.refs`; the fetchers (:mod:`meshnode_packaging.fetch`,
:mod:`meshnode_packaging.remote`) read these records without importing that dispatch back.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"


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
    """A model behind HTTP: a hub repo (``repo``, any kind) or a package's base URL (``url``).

    ``file`` and ``quant`` choose a GGUF in a hub repo (see the module docstring).
    """

    repo: str | None
    revision: str = DEFAULT_REVISION
    url: str | None = None
    file: str | None = None
    quant: str | None = None

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
