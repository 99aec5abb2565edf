"""``model-package.json``: the manifest of a layer package, and the parts a stage needs.

The manifest is kept as the parsed JSON document itself (``Manifest.data``) with typed
accessors on top, so that keys this version does not know survive a read and a write unchanged
(a newer writer may add them; an older reader must not drop them). ``packaging/README.md`` is
the specification; ``schema/model-package.schema.json`` its machine-checkable half.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from meshnode_packaging.errors import InvalidPackage, Problem

FORMAT_NAME = "meshnode-layer-package"
FORMAT_VERSION = 1
MANIFEST_NAME = "model-package.json"
EMBED_FILE = "embed.safetensors"
HEAD_FILE = "head.safetensors"
TOKENIZER_FILE = "tokenizer.json"
SCHEMA_NAME = "model-package.schema.json"


def layer_file(index: int) -> str:
    """Relative path of the file holding layer ``index`` (five digits: up to 99,999 layers)."""
    return f"layers/{index:05d}.safetensors"


@cache
def schema() -> dict[str, Any]:
    """The JSON Schema of the manifest, shipped inside the package (works from a wheel too)."""
    text = resources.files("meshnode_packaging").joinpath("schema", SCHEMA_NAME).read_text()
    data: dict[str, Any] = json.loads(text)
    return data


@dataclass(frozen=True)
class Part:
    """What one pipeline stage runs: layers ``[start, end)``, plus embedding and/or head.

    The files it needs are :meth:`Manifest.files_for`; the tokenizer comes with the embedding,
    because the stage that embeds is the one that serves the API and tokenizes, and with the
    head, because the last stage compiles grammars against it (constrained decoding).
    """

    start: int
    end: int
    embed: bool = False
    head: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"bad layer range [{self.start}, {self.end})")

    @classmethod
    def parse_range(cls, text: str, *, embed: bool = False, head: bool = False) -> Part:
        """``"10:20"`` → ``Part(10, 20)``; raise ``ValueError`` on anything else."""
        start, sep, end = text.partition(":")
        if not sep:
            raise ValueError(f"layer range must look like START:END, got {text!r}")
        return cls(int(start), int(end), embed=embed, head=head)


class Manifest:
    """A parsed ``model-package.json`` (structure checked by :mod:`meshnode_packaging.validate`)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    @classmethod
    def loads(cls, text: str | bytes) -> Manifest:
        """Parse manifest text; raise :class:`InvalidPackage` unless it is a JSON object."""
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidPackage([Problem(MANIFEST_NAME, "", f"not JSON: {exc}")]) from exc
        if not isinstance(data, dict):
            raise InvalidPackage([Problem(MANIFEST_NAME, "", "top level is not an object")])
        return cls(data)

    @classmethod
    def load(cls, folder: Path) -> Manifest:
        """Read ``folder/model-package.json``."""
        path = folder / MANIFEST_NAME
        if not path.is_file():
            raise InvalidPackage([Problem(MANIFEST_NAME, "", f"missing in {folder}")])
        return cls.loads(path.read_bytes())

    def dumps(self) -> str:
        """The manifest as JSON text, unknown keys included, in their original order."""
        return json.dumps(self.data, indent=2, ensure_ascii=False) + "\n"

    @property
    def config(self) -> dict[str, Any]:
        """The model's Hugging Face ``config.json`` keys."""
        config: dict[str, Any] = self.data["config"]
        return config

    @property
    def num_layers(self) -> int:
        """``config.num_hidden_layers``."""
        return int(self.config["num_hidden_layers"])

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        """Relative path → ``{"size", "sha256", ...}`` for every file except the manifest."""
        files: dict[str, dict[str, Any]] = self.data["files"]
        return files

    @property
    def layers(self) -> list[dict[str, Any]]:
        """Layer file entries: ``{"file", "start", "end", "weight_bytes", "tensors"}``."""
        layers: list[dict[str, Any]] = self.data["layers"]
        return layers

    @property
    def head_tied(self) -> bool:
        """True when the output projection is the embedding matrix (the head holds the norm)."""
        return bool(self.data["head"].get("tied_to_embed", False))

    @property
    def head_reads_embed(self) -> bool:
        """True when the last stage needs the embedding too: a tied head, or a head holding
        the checkpoint's MTP module (``mtp.*``), which embeds the tokens it predicts from."""
        tensors = self.data["head"].get("tensors", [])
        return self.head_tied or any(str(t).startswith("mtp.") for t in tensors)

    @property
    def chat_template(self) -> str | None:
        """The chat template (Jinja2 source), if the model has one."""
        template = self.data.get("chat_template")
        return template if isinstance(template, str) else None

    @property
    def speculative_decoding(self) -> dict[str, Any] | None:
        """``generation.speculative_decoding`` if present."""
        block = self.data.get("generation", {}).get("speculative_decoding")
        return block if isinstance(block, dict) else None

    @property
    def sampling(self) -> dict[str, float | int]:
        """``generation.sampling``: the model's own sampling defaults (may be empty)."""
        block = self.data.get("generation", {}).get("sampling")
        return dict(block) if isinstance(block, dict) else {}

    def parts(self) -> list[dict[str, Any]]:
        """Every tensor-holding entry: embed, the layers in order, head."""
        return [self.data["embed"], *self.layers, self.data["head"]]

    def layer_weight_bytes(self) -> list[int]:
        """Weight bytes of each layer (a file holding several layers splits its bytes evenly)."""
        out = [0] * self.num_layers
        for entry in self.layers:
            start, end = int(entry["start"]), int(entry["end"])
            for i in range(start, min(end, self.num_layers)):
                out[i] += int(entry["weight_bytes"]) // max(1, end - start)
        return out

    def files_for(self, part: Part) -> list[str]:
        """Relative paths a stage running ``part`` needs, in fetch order (manifest excluded)."""
        if part.end > self.num_layers:
            raise ValueError(f"layer range [{part.start}, {part.end}) exceeds {self.num_layers}")
        paths: list[str] = []
        if part.embed or (part.head and self.head_reads_embed):
            paths.append(self.data["embed"]["file"])
        if part.embed:
            paths.append(self.data["tokenizer"]["file"])
        paths += [
            e["file"]
            for e in self.layers
            if int(e["start"]) < part.end and int(e["end"]) > part.start
        ]
        if part.head:
            paths.append(self.data["head"]["file"])
            # A few MiB at most; the last stage reads it only for a constrained request.
            paths.append(self.data["tokenizer"]["file"])
        return list(dict.fromkeys(paths))  # a file shared by two parts is fetched once
