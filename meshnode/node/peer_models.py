"""Which model references another node may make this one open (issue 15, item 3).

A ``Prepare`` names a model reference, and the worker opens it: a hub repo, a package behind
a URL, an alias of a bundled model, or a path on this machine. The sender is any member of
the mesh, which is not the owner of this machine, so what it may name is this node's
setting, decided here from the reference's text alone (:func:`~meshnode_packaging.refs.
ref_kind`), before anything it names is touched:

=========  ==========================================================================
``hub``    always: the hub of this node's own ``HF_ENDPOINT``, into its cache only
``alias``  always: a public model bundled in an installed package (what the README's
           three-machine setup sends)
``url``    only with ``allow_url_models``: a URL lets a member make this node fetch from
           hosts only it can reach
``local``  only a path this node's own config names (``model``, ``local_models``):
           otherwise a member could open any file here as a model, then read it
           through the stage's outputs or learn from errors what exists
=========  ==========================================================================

Every refusal says only which kinds this node accepts, never whether the path exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshnode_packaging.refs import RefKind, ref_kind

if TYPE_CHECKING:
    from meshnode.node.config import NodeConfig


def local_key(path: str | Path) -> str:
    """``path`` absolute and normalized lexically (``~``, ``.``, ``..``), as compared.

    Symbolic links are not followed: a reference is allowed for the name the config
    gives, not for every other name of the same file.
    """
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


@dataclass(frozen=True, slots=True)
class PeerModels:
    """The references another node's ``Prepare`` may name here (module docstring)."""

    urls: bool = False
    local_paths: frozenset[str] = frozenset()  # as :func:`local_key` writes them

    @classmethod
    def of(cls, *, urls: bool, local_paths: Iterable[str | Path]) -> PeerModels:
        """The policy that accepts URLs if ``urls`` and exactly ``local_paths`` on disk."""
        return cls(urls=urls, local_paths=frozenset(local_key(p) for p in local_paths))

    @classmethod
    def of_config(cls, config: NodeConfig) -> PeerModels:
        """The policy of ``config``: ``allow_url_models``, and ``local_models`` plus
        ``model`` when that is a local path (the node serves it already)."""
        own = [config.model] if config.model and ref_kind(config.model) is RefKind.LOCAL else []
        return cls.of(urls=config.allow_url_models, local_paths=[*own, *config.local_models])

    def refusal(self, ref: str) -> str:
        """Why this node will not open ``ref`` for another node (empty: it will)."""
        kind = ref_kind(ref)
        if kind is RefKind.URL and not self.urls:
            return "this node fetches models from the hub only (allow_url_models is off)"
        if kind is RefKind.LOCAL and local_key(ref) not in self.local_paths:
            return (
                "this node opens hf:// references, bundled model aliases and the local "
                "models its own config names (local_models) for other nodes, no other path"
            )
        return ""
